// SpecConsole replay: plays a saved run back at its recorded timing (inlined by specconsole/replay.py).
//
// Everything on screen is a pure function of one number, `now` (seconds into the run): render(now) shows the tokens
// whose recorded time is <= now, the figures as they stood then, and the charts up to then. Playing advances `now`
// each animation frame by the elapsed time times the speed; scrubbing and the arrow keys set it. Model text is
// only ever put in the page with textContent.
(function () {
  'use strict';

  const data = JSON.parse(document.getElementById('replay-data').textContent);
  const F = Object.fromEntries(data.token_fields.map((name, i) => [name, i]));  // token column -> index
  // Okabe-Ito, as in specconsole/charts.py: baseline grey, then the speculative engines
  const COLOURS = ['#777777', '#CC79A7', '#0072B2', '#E69F00', '#009E73', '#D55E00'];
  const SVG = 'http://www.w3.org/2000/svg';  // a namespace name, not something fetched
  const duration = data.duration || 0;
  const $ = (id) => document.getElementById(id);

  function div(className, parent) {
    const d = document.createElement('div');
    d.className = className;
    if (parent) parent.appendChild(d);
    return d;
  }

  // How many of the sorted `times` are <= t (binary search: seeking stays fast on long runs).
  function countUpTo(times, t) {
    let lo = 0, hi = times.length;
    while (lo < hi) {
      const mid = (lo + hi) >> 1;
      if (times[mid] <= t) lo = mid + 1; else hi = mid;
    }
    return lo;
  }

  function running(values) {  // prefix sums: running(v)[k] = v[0] + ... + v[k-1]
    const out = [0];
    for (const v of values) out.push(out[out.length - 1] + v);
    return out;
  }

  // --- the run's header ---------------------------------------------------------------------------------------
  const run = data.run;
  $('run-info').textContent = [
    `run ${run.id}`, run.created_at, run.status, run.category, run.method && `method ${run.method}`,
    run.mode && `mode ${run.mode}`, run.target_model && `target ${run.target_model}`,
    run.draft_model && `draft ${run.draft_model}`, run.error && `error: ${run.error}`,
  ].filter(Boolean).join(' · ');
  $('prompt').textContent = run.prompt || '';

  // --- one panel per engine, and what render() needs precomputed ------------------------------------------------
  const engines = data.engines.map((e, i) => {
    const panel = div('panel', $('panels'));
    const title = document.createElement('h2');
    title.textContent = e.name + (e.method && e.method !== 'none' ? ` (${e.method})` : '');
    title.style.color = COLOURS[i % COLOURS.length];
    panel.appendChild(title);
    const box = div('tokens', panel);
    box.dataset.engine = e.name;
    const errorBox = div('panel-error', panel);
    errorBox.hidden = true;
    // steps ([step, drafted, accepted, t, draft_ms, verify_ms]) that verified drafts
    const spec = e.steps.filter((s) => s[1] > 0);
    const out = e.tokens.filter((t) => t[F.kind] !== 'rejected');
    return {
      ...e, box, errorBox, statusBox: div('panel-status', panel), colour: COLOURS[i % COLOURS.length], shown: 0,
      times: e.tokens.map((t) => t[F.t]),
      outTimes: out.map((t) => t[F.t]),
      stepTimes: e.steps.map((s) => s[3]),
      spec, specTimes: spec.map((s) => s[3]),
      drafted: running(spec.map((s) => s[1])), accepted: running(spec.map((s) => s[2])),
      passes: passTimes(e.steps),
    };
  });
  const speculative = engines.slice(1);

  // Each target pass as {step, start, end, ms: [drafting, target pass, other]}, as specconsole/charts.pass_times: it
  // starts where the previous step ended, `other` is the rest of that span (at least 0). null where no step carries
  // a timing (servers): the split is unknown there.
  function passTimes(steps) {
    if (steps.length && !steps.some((s) => s[4] || s[5])) return null;
    let start = 0;
    return steps.map((s) => {
      const other = Math.max(0, 1000 * (s[3] - start) - s[4] - s[5]);
      const pass = { step: s[0], start, end: s[3], ms: [s[4], s[5], other] };
      start = s[3];
      return pass;
    });
  }

  function tokenNode(tok) {
    const text = tok[F.text];
    const node = document.createElement(tok[F.kind] === 'rejected' ? 'del' : 'span');
    node.className = 'tok ' + tok[F.kind];
    node.title = tok[F.title];
    if (tok[F.isolate]) node.style.unicodeBidi = 'isolate';  // bidi controls act on this token's text only
    node.textContent = text || '\u200b';  // an empty piece (half a character) keeps its place and tooltip
    if (!text) node.dataset.empty = '';
    return node;
  }

  function renderPanel(e, now) {
    const n = countUpTo(e.times, now);
    if (n === e.shown) return;
    if (n > e.shown) {
      const add = document.createDocumentFragment();
      for (let i = e.shown; i < n; i++) add.appendChild(tokenNode(e.tokens[i]));
      e.box.appendChild(add);
      e.box.scrollTop = e.box.scrollHeight;
    } else {
      while (e.box.childNodes.length > n) e.box.lastChild.remove();  // seeking back
    }
    e.shown = n;
    e.box.dataset.shown = String(n);
  }

  // --- figures: as the console showed them while the run went on, the stored ones once an engine ended ---------
  function live(e, now) {
    const finished = now >= e.end;
    const out = countUpTo(e.outTimes, now);
    const last = Math.max(out ? e.outTimes[out - 1] : 0, e.stepTimes[countUpTo(e.stepTimes, now) - 1] || 0);
    const k = countUpTo(e.specTimes, now);
    const drafted = e.drafted[k], accepted = e.accepted[k];
    return {
      finished, out,
      tps: finished ? e.final.tokens_per_s : (last > 0 ? out / last : null),
      acceptance: finished ? e.final.acceptance_rate : (drafted ? accepted / drafted : null),
      meanLength: finished ? e.final.mean_accepted_length : (k ? 1 + accepted / k : null),
      histogram: histogram(e.spec.slice(0, k)),
    };
  }

  // speculative steps by drafts accepted (engine.metrics' acceptance_histogram), as far as the replay has got
  function histogram(steps) {
    if (!steps.length) return '–';
    const counts = Array(Math.max(...steps.map((s) => s[1])) + 1).fill(0);
    steps.forEach((s) => { counts[s[2]] += 1; });
    return counts.map((n, i) => `${i}: ${n}`).join(' · ');
  }

  const fmt = (v, digits, suffix = '') => (v === null || v === undefined || !isFinite(v) ? '–' : v.toFixed(digits) + suffix);
  const names = (list) => list.map((e) => e.name).join(' | ');
  const label = (base) => (speculative.length > 1 ? `${base} (${names(speculative)})` : base);
  const FIGURES = [
    [`tokens/s (${names(engines)})`, (s) => s.map((x) => fmt(x.tps, 2)).join(' | ')],
    [label('speedup'), (s) => speculative.map((e, i) => {
      const x = s[i + 1], b = s[0];
      const value = x.finished && b.finished ? e.final.speedup : (x.tps && b.tps ? x.tps / b.tps : null);
      return fmt(value, 2, '×');
    }).join(' | ')],
    [label('acceptance'), (s) => s.slice(1).map((x) => fmt(x.acceptance, 2)).join(' | ')],
    [label('mean accepted length'), (s) => s.slice(1).map((x) => fmt(x.meanLength, 2)).join(' | ')],
    [label('drafts accepted per step'), (s) => s.slice(1).map((x) => x.histogram).join(' | ')],
  ];
  const figures = $('figures');
  const grid = div('figures', figures);
  const figureValues = FIGURES.map(([name]) => {
    const fig = div('fig', grid);
    div('fig-label', fig).textContent = name;
    return div('fig-value', fig);
  });
  const exactness = div('exactness', figures);

  function renderFigures(now) {
    const states = engines.map((e) => live(e, now));
    FIGURES.forEach(([, value], i) => {
      const text = value(states);
      if (figureValues[i].textContent !== text) figureValues[i].textContent = text;
    });
    exactness.textContent = '';
    if (now >= duration && data.identical !== null && data.identical !== undefined) {
      const span = document.createElement('span');
      span.className = data.identical ? 'exact ok' : 'exact diverged';
      span.textContent = data.identical ? '✔ identical to the baseline'
        : `✖ first divergence at token ${data.first_divergence}`;
      exactness.appendChild(span);
      if (!data.identical && data.near_tie) {
        const why = document.createElement('span');
        why.className = 'why near-tie';
        why.textContent = ` ${data.near_tie}`;
        exactness.appendChild(why);
      }
    }
    engines.forEach((e, i) => {
      e.statusBox.textContent = `${states[i].finished ? run.status : 'running…'} · ${states[i].out} tokens`;
      e.errorBox.hidden = !(states[i].finished && e.error);  // an engine's error shows once the replay reaches its end
      e.errorBox.textContent = e.errorBox.hidden ? '' : e.error;
    });
  }

  // --- charts: SVG with fixed axes (the whole run), so that the lines and bars grow into them -----------------
  const W = 480, H = 240, M = { l: 44, r: 12, t: 22, b: 30 };
  const x = (t) => M.l + (duration > 0 ? t / duration : 0) * (W - M.l - M.r);

  function svg(tag, attrs, parent) {
    const node = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
    if (parent) parent.appendChild(node);
    return node;
  }

  function axes(chart, yMax, yTitle) {
    svg('line', { x1: M.l, y1: H - M.b, x2: W - M.r, y2: H - M.b, class: 'axis' }, chart);
    svg('line', { x1: M.l, y1: M.t, x2: M.l, y2: H - M.b, class: 'axis' }, chart);
    const text = (s, attrs) => { svg('text', attrs, chart).textContent = s; };
    text('0', { x: M.l - 4, y: H - M.b, 'text-anchor': 'end' });
    text(String(yMax), { x: M.l - 4, y: M.t + 8, 'text-anchor': 'end' });
    text(`${duration.toFixed(2)} s`, { x: W - M.r, y: H - 8, 'text-anchor': 'end' });
    text('seconds', { x: (M.l + W - M.r) / 2, y: H - 8, 'text-anchor': 'middle' });
    text(yTitle, { x: 12, y: (M.t + H - M.b) / 2, transform: `rotate(-90 12 ${(M.t + H - M.b) / 2})`, 'text-anchor': 'middle' });
    return (v) => H - M.b - (v / yMax) * (H - M.t - M.b);
  }

  function key(chart, list) {  // which colour is which engine
    list.forEach((e, i) => {
      const t = svg('text', { x: M.l + 8 + i * 120, y: 14, fill: e.colour, 'font-weight': 600 }, chart);
      t.textContent = e.name;
    });
  }

  const tokensChart = $('chart-tokens');
  const yTokens = axes(tokensChart, Math.max(1, ...engines.map((e) => e.outTimes.length)), 'output tokens');
  key(tokensChart, engines);
  engines.forEach((e, i) => {
    e.line = svg('polyline', { fill: 'none', stroke: e.colour, 'stroke-width': 2,
      'stroke-dasharray': i === 0 ? '3 3' : 'none' }, tokensChart);
  });

  const stepsChart = $('chart-steps');
  const yDrafts = axes(stepsChart, Math.max(1, ...speculative.flatMap((e) => e.spec.map((s) => s[1]))), 'tokens');
  key(stepsChart, speculative);
  const most = Math.max(1, ...speculative.map((e) => e.spec.length));
  // bars stand at their step's time, so steps close in time overlap: keep them thin
  const barWidth = Math.max(1.5, Math.min(8, (0.5 * (W - M.l - M.r)) / most)) / Math.max(1, speculative.length);
  speculative.forEach((e) => { e.bars = svg('g', {}, stepsChart); e.barsShown = 0; });

  // where the time went: a band per engine on the run's time axis, a stacked bar per target pass spanning its time
  // (drafting, the pass, other), as the console's chart. One ms scale for all bands, the passes' after each engine's
  // first: that one reads the prompt, often many decoding passes long, and is cut at the top (its band says so).
  const SPLIT = [['drafting', '#E69F00'], ['target pass', '#0072B2'], ['other', '#999999']];
  const timeChart = $('chart-time');
  const total = (p) => p.ms[0] + p.ms[1] + p.ms[2];
  const tops = engines.flatMap((e) => (e.passes || []).slice(1).map(total));
  const msMax = Math.max(0.1, ...(tops.length ? tops : engines.flatMap((e) => (e.passes || []).map(total))));
  const band = (H - M.t - M.b) / engines.length;
  const chartText = (s, attrs) => { svg('text', attrs, timeChart).textContent = s; };
  SPLIT.forEach(([name, colour], i) => {
    chartText(name, { x: M.l + 8 + i * 90, y: 14, fill: colour, 'font-weight': 600 });
  });
  chartText(msMax.toFixed(msMax < 10 ? 1 : 0), { x: M.l - 4, y: M.t + 8, 'text-anchor': 'end' });
  const middle = (M.t + H - M.b) / 2;
  chartText('ms per pass', { x: 12, y: middle, transform: `rotate(-90 12 ${middle})`, 'text-anchor': 'middle' });
  chartText(`${duration.toFixed(2)} s`, { x: W - M.r, y: H - 8, 'text-anchor': 'end' });
  chartText('seconds', { x: (M.l + W - M.r) / 2, y: H - 8, 'text-anchor': 'middle' });
  svg('line', { x1: M.l, y1: M.t, x2: M.l, y2: H - M.b, class: 'axis' }, timeChart);
  engines.forEach((e, i) => {
    const bottom = M.t + (i + 1) * band;
    e.msY = (ms) => bottom - (Math.min(ms, msMax) / msMax) * (band - 14);  // the band's top 14 px hold its name
    svg('line', { x1: M.l, y1: bottom, x2: W - M.r, y2: bottom, class: 'axis' }, timeChart);
    const first = e.passes && e.passes.length ? total(e.passes[0]) : 0;
    const cut = first > msMax ? ` · first pass (the prompt) ${first.toFixed(0)} ms, cut at the top` : '';
    chartText(e.passes ? e.name + cut : `${e.name}: split unknown (not timed by this engine)`,
      { x: M.l + 4, y: bottom - band + 11, fill: e.colour, 'font-weight': 600 });
    e.timeBars = svg('g', { 'data-engine': e.name }, timeChart);
    e.timeShown = 0;
  });

  function renderTime(e, now) {
    const k = e.passes ? countUpTo(e.stepTimes, now) : 0;
    while (e.timeShown > k) { e.timeBars.lastChild.remove(); e.timeShown--; }
    for (; e.timeShown < k; e.timeShown++) {
      const p = e.passes[e.timeShown];
      const bar = svg('g', {}, e.timeBars);
      let below = 0;
      p.ms.forEach((ms, j) => {
        if (ms >= 0.001) {  // not a rounding's remainder
          svg('rect', { x: x(p.start), y: e.msY(below + ms), width: Math.max(0.5, x(p.end) - x(p.start)),
            height: e.msY(below) - e.msY(below + ms), fill: SPLIT[j][1] }, bar);
        }
        below += ms;
      });
      const split = SPLIT.map(([name], j) => `${name} ${p.ms[j].toFixed(1)} ms`);
      svg('title', {}, bar).textContent = `step ${p.step}: ${split.join(', ')}`;
    }
  }

  function renderCharts(now) {
    for (const e of engines) {  // a step line: each output token raises the count at its time
      const n = countUpTo(e.outTimes, now);
      const points = [`${x(0)},${yTokens(0)}`];
      for (let i = 0; i < n; i++) points.push(`${x(e.outTimes[i])},${yTokens(i)}`, `${x(e.outTimes[i])},${yTokens(i + 1)}`);
      points.push(`${x(Math.min(now, e.end))},${yTokens(n)}`);
      e.line.setAttribute('points', points.join(' '));
    }
    speculative.forEach((e, j) => {  // per verified step: drafted (pale) behind accepted (solid)
      const k = countUpTo(e.specTimes, now);
      while (e.barsShown > k) { e.bars.lastChild.remove(); e.barsShown--; }
      for (; e.barsShown < k; e.barsShown++) {
        const [, drafted, accepted, t] = e.spec[e.barsShown];
        const left = x(t) - (barWidth * speculative.length) / 2 + j * barWidth;
        const bar = svg('g', {}, e.bars);
        svg('rect', { x: left, y: yDrafts(drafted), width: barWidth, height: yDrafts(0) - yDrafts(drafted),
          fill: e.colour, 'fill-opacity': 0.25 }, bar);
        svg('rect', { x: left, y: yDrafts(accepted), width: barWidth, height: yDrafts(0) - yDrafts(accepted),
          fill: e.colour }, bar);
        svg('title', {}, bar).textContent = `step ${e.spec[e.barsShown][0]}: ${accepted} of ${drafted} accepted`;
      }
    });
    engines.forEach((e) => renderTime(e, now));
  }

  // --- the player -------------------------------------------------------------------------------------------
  let now = 0, playing = false, speed = 1, lastFrame = null;
  const scrub = $('scrub'), playButton = $('play');

  function render() {
    engines.forEach((e) => renderPanel(e, now));
    renderFigures(now);
    renderCharts(now);
    if (document.activeElement !== scrub) scrub.value = String(duration > 0 ? Math.round((now / duration) * 1000) : 1000);
    $('clock').textContent = `${now.toFixed(2)} s / ${duration.toFixed(2)} s · ${speed}×`;
    document.body.dataset.time = String(now);  // lets a test see where the replay stands (exactly: no rounding)
  }

  function setState() {
    document.body.dataset.state = playing ? 'playing' : (now >= duration ? 'ended' : 'paused');
    playButton.textContent = playing ? 'Pause' : 'Play';
  }

  function frame(ts) {
    if (!playing) return;
    if (lastFrame !== null) now = Math.min(duration, now + ((ts - lastFrame) / 1000) * speed);
    lastFrame = ts;
    render();
    if (now >= duration) { playing = false; setState(); return; }
    requestAnimationFrame(frame);
  }

  function play(on) {
    if (on && now >= duration) now = 0;  // Play at the end plays it again
    playing = on;
    lastFrame = null;
    setState();
    render();
    if (on) requestAnimationFrame(frame);
  }

  function seek(t) {
    now = Math.min(duration, Math.max(0, t));
    lastFrame = null;  // the next frame advances from here
    render();
    if (playing && now >= duration) playing = false;
    setState();
  }

  function restart() { seek(0); play(true); }

  playButton.addEventListener('click', () => play(!playing));
  $('restart').addEventListener('click', restart);
  $('speed').addEventListener('change', (ev) => { speed = Number(ev.target.value); render(); });
  scrub.addEventListener('input', () => seek((Number(scrub.value) / 1000) * duration));
  $('show-rejected').addEventListener('change', (ev) => document.body.classList.toggle('hide-rejected', !ev.target.checked));

  document.addEventListener('keydown', (ev) => {
    if (ev.target.tagName === 'SELECT' || ev.altKey || ev.ctrlKey || ev.metaKey) return;
    const step = duration / 20;  // an arrow seeks a twentieth of the run
    if (ev.key === ' ') play(!playing);
    else if (ev.key === 'ArrowLeft') seek(now - step);
    else if (ev.key === 'ArrowRight') seek(now + step);
    else if (ev.key === 'Home') restart();
    else return;
    ev.preventDefault();  // no page scroll, and the focused slider or button does not act on the key too
  });
  // some browsers click a focused button or checkbox on the space key's keyup; space already toggled playing
  document.addEventListener('keyup', (ev) => { if (ev.key === ' ') ev.preventDefault(); });

  render();
  setState();
})();
