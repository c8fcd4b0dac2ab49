// The token panels, grown in place. One hidden component (the panel feed) receives one small JSON message per update
// for all of them (props.value):
//   {panels: {engine: {run, start, tokens: [span html...], total, status, error, reset, final_html}}, run, charts}
// and applies each to the panel `#<engine>-panel .live-panel`: new token spans are appended; spans already shown are
// never re-created. `reset` (a re-classification) and a missed message (start beyond what is shown, repaired by the
// last message's final_html) re-render once. One component rather than one per panel: the browser's work per update
// grows with the number of components an update names, shown or hidden (docs/page-cost.md).
const EMPTY = '<div class="tokens"><span class="placeholder">waiting for tokens…</span></div>'
  + '<div class="panel-error" hidden></div><div class="panel-status"></div>';

// what a panel shows is kept on its element, so a panel that Gradio renders anew (a column shown again) starts empty
function applyTo(root, m) {
  if (m.run !== root.run || m.reset) { root.innerHTML = EMPTY; root.shown = 0; root.run = m.run; }
  const box = root.querySelector('.tokens');
  if (m.start <= root.shown) {
    const add = m.tokens.slice(root.shown - m.start);
    if (add.length) {
      if (root.shown === 0) box.textContent = '';
      box.insertAdjacentHTML('beforeend', add.join(''));
      root.shown = m.start + m.tokens.length;
    }
  }
  if (m.final_html !== undefined && root.shown !== m.total) { box.innerHTML = m.final_html; root.shown = m.total; }
  const error = root.querySelector('.panel-error');
  error.hidden = !m.error;
  error.textContent = m.error || '';
  root.querySelector('.panel-status').textContent = m.status || '';
  if (m.start + m.tokens.length > 0) box.scrollTop = box.scrollHeight;
  root.dataset.run = m.run;  // lets a test or benchmark see which run the panel shows, and whether it ended
  root.dataset.final = m.final_html !== undefined ? 'yes' : 'no';
}

// The charts are not redrawn as a run begins (their drawing is the page's largest cost; specconsole/tab_run.py):
// until the run's first chart update they show the last run's, faded.
const CHARTS = '#chart-steps, #chart-positions, #chart-tokens, #chart-time';
let chartsRun = null;

// Gradio's plot component mounts a new plotly graph for each new value and leaves the old one to plotly, whose
// listeners keep it alive: about 600 DOM nodes and 150 listeners more per comparison (docs/page-cost.md). Each chart
// update purges the graphs that have left the page since the last one.
let graphs = [];
function purgeLeftGraphs() {
  if (!window.Plotly) return;
  for (const gd of graphs) if (!gd.isConnected) window.Plotly.purge(gd);
  graphs = [...document.querySelectorAll('.js-plotly-plot')];
}

// Gradio's plot component follows each new value (Plotly.react) with Plotly.Plots.resize, which lays the chart out
// and draws it again 100 ms later, even where its size has not changed: the charts, the page's largest cost, drawn
// twice (docs/page-cost.md). The resize goes ahead where the chart no longer fits its box (the window resized).
const RESIZE_DEBOUNCE_MS = 100;  // plotly's own
function fits(gd) {
  const layout = gd._fullLayout, box = gd.isConnected && window.getComputedStyle(gd);
  return Boolean(layout && box) && Math.abs(parseFloat(box.width) - layout.width) <= 1
    && Math.abs(parseFloat(box.height) - layout.height) <= 1;
}
function drawChartsOnce() {
  const plots = window.Plotly?.Plots;
  if (!plots || plots.resize.onlyWhereNeeded) return;
  const resize = plots.resize;
  plots.resize = (gd) => new Promise((done) => setTimeout(
    () => (fits(gd) || unseen.has(gd) ? done(gd) : resize(gd).then(done, done)), RESIZE_DEBOUNCE_MS));
  plots.resize.onlyWhereNeeded = true;
}

// A chart out of view (below the fold, or on a tab not shown) is drawn when it comes into view, with its latest
// update: the token panels and figures fill a laptop's screen, and drawing the charts below them was the browser's
// largest cost during a short run, for nothing the user saw (docs/page-cost.md). A chart in view is drawn at once.
const unseen = new Map();  // graph div -> the arguments of its latest Plotly.react, not drawn yet
function inView(gd) {
  const box = gd.getBoundingClientRect();
  return box.bottom > 0 && box.top < window.innerHeight && box.right > 0 && box.left < window.innerWidth;
}
function drawChartsWhenSeen() {
  const plotly = window.Plotly;
  if (!plotly || plotly.react.whenSeen) return;
  const react = plotly.react;
  const forget = (gd) => { unseen.delete(gd); seen.unobserve(gd); };
  const draw = (gd, ...rest) => { forget(gd); gd.style.minHeight = ''; return react(gd, ...rest); };
  const seen = new IntersectionObserver((entries) => {
    for (const entry of entries) {
      const args = entry.isIntersecting && unseen.get(entry.target);
      if (args) draw(...args);
    }
  });
  plotly.react = (gd, ...rest) => {
    for (const old of unseen.keys()) if (!old.isConnected) forget(old);
    if (!gd.isConnected || inView(gd)) return draw(gd, ...rest);
    unseen.set(gd, [gd, ...rest]);
    gd.style.minHeight = `${rest[1]?.height || 0}px`;  // its place kept: the page below does not jump when it draws
    seen.observe(gd);
    return Promise.resolve(gd);
  };
  plotly.react.whenSeen = true;
}

function apply() {
  drawChartsOnce();
  drawChartsWhenSeen();
  if (!props.value) return;
  const update = JSON.parse(props.value);
  for (const [engine, m] of Object.entries(update.panels)) {
    const root = document.querySelector('#' + engine + '-panel .live-panel');
    if (root) applyTo(root, m);
  }
  const run = update.run ?? Object.values(update.panels)[0]?.run;
  if (update.charts) { chartsRun = run; purgeLeftGraphs(); }
  for (const chart of document.querySelectorAll(CHARTS)) chart.classList.toggle('stale-chart', run !== chartsRun);
}

watch('value', apply);
apply();
