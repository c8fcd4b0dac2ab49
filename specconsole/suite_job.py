"""One suite job: a suite (or the vLLM concurrency sweep) on a thread of its own, with its progress and its Stop,
and its export (the per-run and per-category CSV files and the HTML report). The Workbench tab and `launch.py suite`
both run suites through here, so that both save, aggregate and export them alike."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import pandas as pd

from engine.request import Request
from specconsole.advisor import Advice
from specconsole.export import EXPORTS, ExportFolder, file_id
from specconsole.history import History
from specconsole.report import write_csvs, write_html
from specconsole.suites import SuitePrompt
from specconsole.workbench import (SWEEPS, advice_for, aggregate, check_plan, concurrency_sweep, default_values,
                                   request_for, run_suite, runs_frame, server_drafting, sweep_methods)

log = logging.getLogger(__name__)


class SuiteJob:
    """start() runs the job on a thread (the page); run() runs it here (the CLI). Read done / total / what for the
    progress, set cancel to stop after the current comparison (the runs before it are kept)."""

    def __init__(self, backend, history: History | None, items: list[SuitePrompt], base: Request, mode: str = "fair",
                 variable: str = "none", values: list[str] | None = None, repeats: int = 1,
                 max_new_tokens: int | None = None):
        self.backend, self.history, self.items, self.base = backend, history, items, base
        self.mode, self.variable, self.repeats = mode, variable, int(repeats)
        # an unknown sweep is refused by check()
        self.values = values or (default_values(backend, variable) if variable in SWEEPS else [""])
        self.max_new_tokens = max_new_tokens or base.max_new_tokens
        self.cancel = threading.Event()
        runs_each = 1 if self.concurrency_sweep else len(self.values) * self.repeats
        self.done, self.total, self.what = 0, len(items) * runs_each, ""
        self.suite_id: str | None = None
        self.cancelled = False
        self.error: str | None = None  # set when a job started with start() failed
        self.concurrency: pd.DataFrame | None = None  # the concurrency sweep's table
        self._thread: threading.Thread | None = None

    @property
    def concurrency_sweep(self) -> bool:
        return self.variable == "concurrency"

    @property
    def sweep(self) -> str | None:
        return None if self.variable == "none" else self.variable

    def check(self) -> None:
        """Raise ValueError / SettingsError before anything runs: no prompts, a value over engine.limits (repeats,
        the sweep's values), or a request the backend refuses (a prompt too long for the model's context)."""
        if not self.items:
            raise ValueError("choose at least one suite or upload a JSONL / CSV file")
        caps = self.backend.capabilities
        check_plan(self.variable, self.values, self.repeats, methods=sweep_methods(self.backend),
                   k_range=caps.k_range)
        if self.variable in ("method", "k") and server_drafting(self.backend):
            if not caps.can_reconfigure:
                raise ValueError(f"a {self.variable} sweep restarts the speculative engine with each value: only "
                                 "engines the console started can be restarted (these were attached)")
            if "dynamic" in self.values:
                raise ValueError("this backend's speculative engine drafts a fixed K (restarted for each K of the "
                                 "sweep): dynamic K is the local backend's; sweep numbers")
        if self.concurrency_sweep:
            if not caps.concurrent_requests:
                raise ValueError("the concurrency sweep needs the vLLM backend (in-process engines serve one request)")
            base = replace(self.base, max_new_tokens=self.max_new_tokens)
            for item in self.items:
                self.backend.validate(request_for(base, item))
            return
        # every sweep value on the first prompt, and every prompt at each value that changes its length (context)
        # or else at the first value: what each request of the suite will be checked for, tokenizing each prompt
        # once or twice rather than once per value
        lengths = self.values if self.variable == "context" else self.values[:1]
        pairs = dict.fromkeys([(0, v) for v in self.values] + [(i, v) for i in range(len(self.items)) for v in lengths])
        for i, value in pairs:
            self.backend.validate(request_for(self.base, self.items[i], self.variable, value,
                                              self.variable != "temperature"))

    def _progress(self, done: int, total: int, what: str) -> None:
        self.done, self.total, self.what = done, total, what

    def run(self) -> "SuiteJob":
        if self.concurrency_sweep:
            self.suite_id = f"conc-{int(time.time())}"
            self.concurrency = concurrency_sweep(self.backend, self.items, [int(v) for v in self.values],
                                                 self.max_new_tokens, self._progress, self.cancel)
            self.cancelled = self.cancel.is_set()
            return self
        result = run_suite(self.backend, self.items, self.base, self.history, {}, self.mode, self.variable,
                           self.values, cancel=self.cancel, on_progress=self._progress, repeats=self.repeats)
        self.suite_id, self.cancelled = result.suite_id, result.cancelled
        return self

    def start(self) -> "SuiteJob":
        def work():
            try:
                self.run()
            except Exception as e:  # noqa: BLE001 - shown in the page
                log.exception("suite failed")
                self.error = f"{type(e).__name__}: {e}"

        self._thread = threading.Thread(target=work, daemon=True, name="specconsole-suite")
        self._thread.start()
        return self

    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> bool:
        """True once the job has ended."""
        if self._thread is not None:
            self._thread.join(timeout)
        return not self.running()

    @property
    def percent(self) -> float:
        return 100 * self.done / max(1, self.total)


@dataclass
class SuiteExport:
    paths: list[Path]
    aggregates: pd.DataFrame = field(default_factory=pd.DataFrame)
    advice: list[Advice] = field(default_factory=list)


def export_suite(history: History, backend, suite_id: str, runs_csv: Path, report: Path | None = None,
                 title_note: str = "", concurrency: pd.DataFrame | None = None) -> SuiteExport:
    """A stored suite as files: one row per run at runs_csv, one per category beside it (<stem>_categories.csv), and
    the HTML report if `report` is given. A concurrency sweep (not in the history) is its table at runs_csv.
    ValueError, before anything is written, for a suite with no runs in the history."""
    runs = runs_frame(history, suite_id) if concurrency is None else None
    if runs is not None and runs.empty:
        raise ValueError(f"no suite {suite_id[:80]!r} in the history {history.path}: nothing was exported")
    runs_csv.parent.mkdir(parents=True, exist_ok=True)
    if concurrency is not None:
        concurrency.to_csv(runs_csv, index=False)
        paths = [runs_csv]
        if report is not None:
            paths.append(write_html(pd.DataFrame(columns=["category", "sweep_value"]), [], report, suite_id,
                                    title_note, concurrency))
        return SuiteExport(paths)
    agg = aggregate(runs)
    variable = next((v for v in runs.get("sweep_variable", []) if v), None) if not runs.empty else None
    advice = advice_for(backend, agg, variable)
    paths = write_csvs(runs, agg, runs_csv)
    if report is not None:
        paths.append(write_html(agg, advice, report, suite_id, title_note))
    return SuiteExport(paths, agg, advice)


def export_suite_files(history: History, backend, suite_id: str, folder: ExportFolder = EXPORTS,
                       title_note: str = "", concurrency: dict[str, pd.DataFrame] | None = None) -> SuiteExport:
    """The page's export: a suite of the history, or a concurrency sweep of this console (`concurrency`: suite id ->
    its table), as suite_<id>.csv, suite_<id>_categories.csv and suite_<id>.html in the folder's "suite" subfolder.
    ValueError, before anything is written, for an id that is neither, or one that cannot name a file."""
    suite_id = (suite_id or "").strip()
    conc = (concurrency or {}).get(suite_id)
    if conc is None and (not suite_id or not history.runs(suite_id=suite_id, limit=1)):
        raise ValueError(f"no suite {suite_id[:80]!r} in the history or this console's sweeps: run one, or pick "
                         "one from the A/B lists")
    file_id(suite_id, "suite")
    out = folder.fresh("suite")
    runs_csv = out / (f"suite_{suite_id}_concurrency.csv" if conc is not None else f"suite_{suite_id}.csv")
    exported = export_suite(history, backend, suite_id, runs_csv, out / f"suite_{suite_id}.html", title_note, conc)
    log.info("suite %s exported to %s", suite_id, out)
    return exported
