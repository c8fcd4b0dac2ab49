() => {
  // Presenter view: the layout for a projector (console.css, "presenter view"). Entered with ?view=present or the
  // "Presenter view" button, left the same way; it only switches a class on <body>, so a run goes on across switches.
  // In presenter view Enter runs and Escape stops (the prompt box is hidden there, so no key is taken from typing).
  const present = () => document.body.classList.contains('present');
  const show = (on) => {
    document.body.classList.toggle('present', on);
    const url = new URL(window.location.href);
    if (on) url.searchParams.set('view', 'present'); else url.searchParams.delete('view');
    window.history.replaceState(null, '', url);  // a reload (or a shared link) keeps the view
  };
  window.specconsolePresent = () => show(!present());
  show(new URLSearchParams(window.location.search).get('view') === 'present');
  document.addEventListener('keydown', (e) => {
    if (!present() || e.repeat || e.ctrlKey || e.metaKey || e.altKey) return;
    const button = e.key === 'Enter' ? '#run' : e.key === 'Escape' ? '#stop' : null;
    if (!button) return;
    e.preventDefault();
    document.querySelector(button)?.click();
  });
}
