// Runs before Gradio's own scripts (specconsole/frames.py puts it first in the page's <head>).
// Gradio's status tracker redraws an elapsed-time counter on every animation frame, also when nothing is pending:
// 60 frames a second cost the browser about 0.06 core of a 2-core machine, taken from the engines the page measures.
// Its frame callback (the one that reads performance.now() - start) runs at most once a second; every other frame
// callback runs as it would. Gradio keeps its own reference to requestAnimationFrame, hence "before".
(() => {
  const frame = window.requestAnimationFrame.bind(window);
  const elapsedCounter = (callback) => /performance\.now\(\)\s*-/.test(String(callback));
  window.requestAnimationFrame = (callback) =>
    elapsedCounter(callback) ? setTimeout(() => frame(callback), 1000) : frame(callback);
})();
