// A token panel that grows in place. The server sends one small JSON message per update (props.value):
//   {run, start, tokens: [span html...], total, status, error, reset, final_html, ack, charts}
// New token spans are appended; spans already shown are never re-created. `reset` (a re-classification) and a
// missed message (start beyond what is shown, repaired by the last message's final_html) re-render once.
const root = element.querySelector('.live-panel');
const CHART_RESIZE_MS = 150;
let run = null, shown = 0;

function fresh() {
  root.innerHTML = '<div class="tokens"><span class="placeholder">waiting for tokens…</span></div>'
    + '<div class="panel-error" hidden></div><div class="panel-status"></div>';
  shown = 0;
}

function apply() {
  if (!props.value) return;
  const m = JSON.parse(props.value);
  if (m.run !== run || m.reset) { fresh(); run = m.run; }
  const box = root.querySelector('.tokens');
  if (m.start <= shown) {
    const add = m.tokens.slice(shown - m.start);
    if (add.length) {
      if (shown === 0) box.textContent = '';
      box.insertAdjacentHTML('beforeend', add.join(''));
      shown = m.start + m.tokens.length;
    }
  }
  if (m.final_html !== undefined && shown !== m.total) { box.innerHTML = m.final_html; shown = m.total; }
  const error = root.querySelector('.panel-error');
  error.hidden = !m.error;
  error.textContent = m.error || '';
  root.querySelector('.panel-status').textContent = m.status || '';
  if (m.start + m.tokens.length > 0) box.scrollTop = box.scrollHeight;
  root.dataset.run = m.run;  // lets a test or benchmark see which run the panel shows, and whether it ended
  root.dataset.final = m.final_html !== undefined ? 'yes' : 'no';
  // `ack`: the next timed pass waits until this update is drawn (specconsole/page_drawn.py): once the page has no
  // work left (the charts draw after the panels, in later tasks), then after its next paint (a frame callback runs
  // before the paint, a task queued from it after). `charts`: the update also redraws the charts, and plotly draws
  // each one a second time CHART_RESIZE_MS after (Gradio calls Plots.resize, which waits 100 ms): wait for that too.
  if (m.ack !== undefined) {
    const word = m.run + ':' + m.ack;
    root.dataset.asked = word;  // for tests and benchmarks: the last word asked for, and (below) the last one said
    const idle = (then) => window.requestIdleCallback ? requestIdleCallback(then, {timeout: 500}) : then();
    // a beacon: the browser has nothing to handle when it is answered (a Gradio server function's reply arrived just
    // as the next timed pass started, and its handling fell in that pass)
    const say = () => { root.dataset.said = word; navigator.sendBeacon(new URL('page_drawn', document.baseURI), word); };
    const painted = () => requestAnimationFrame(() => setTimeout(say, 0));
    if (m.charts) idle(() => setTimeout(() => idle(painted), CHART_RESIZE_MS)); else idle(painted);
  }
}

fresh();
watch('value', apply);
apply();
