"""What each subcommand of launch.py does (specconsole.cli parses their options): the console in the browser, a
demo in the terminal, a prompt suite, a saved run's replay."""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path

from specconsole import cli
from specconsole.backends import backend_host

log = logging.getLogger("specconsole")


def demo(args) -> int:
    """One prompt on the baseline and the speculative engine (or, with --compare or a backend's extra servers, every
    variant), streamed to the terminal; then the figures and the checks (specconsole.terminal)."""
    from engine.limits import SettingsError
    from specconsole import terminal
    from specconsole.variants import choose, parse_compare

    cli.check_limits(args, args.prompt)
    host = backend_host(args).start()
    try:
        if not host.wait():
            log.error("%s", host.status())
            return 2
        backend = host.backend
        req = cli.build_request(args, args.prompt, host.method)
        if not (args.compare or backend.variants()):
            return terminal.pair(backend, req)
        if args.compare and backend.capabilities.fixed_variants:
            raise SettingsError("--compare sets drafting per run, which vLLM servers do not take: start one "
                                "speculative server per config with --vllm-compare ngram:k=2,ngram:k=6")
        return terminal.table(backend, req, choose(backend, req, lambda: parse_compare(args.compare, req)))
    finally:
        host.close()


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def exposure(host: str, share: bool) -> str | None:
    """Who besides this machine's user could reach the page ("on 0.0.0.0", "through a public share link"), or None."""
    if share:
        return "through a public share link"
    return None if host in LOOPBACK else f"on {host}"


def console(args) -> int:
    import atexit

    from specconsole.history import History, HistoryError

    auth = None
    credentials = os.environ.get(args.auth_env, "")
    if credentials:
        user, _, password = credentials.partition(":")
        if not user or not password:
            log.error("%s must hold user:password", args.auth_env)
            return 2
        auth = (user, password)
    reach = exposure(args.host, args.share)
    if reach and auth is None:
        log.error("refusing to serve %s without a login: set %s=user:password in the environment first", reach,
                  args.auth_env)
        return 2
    if not args.share and os.environ.get("GRADIO_SHARE", "").lower() == "true":
        log.warning("GRADIO_SHARE is ignored: a public link opens only with --share (and a login)")
    try:
        history = History(args.db)
    except HistoryError as e:
        log.error("%s", e)
        return 2
    host = backend_host(args).start()  # the page is up meanwhile
    from specconsole.app import launch  # gradio takes seconds to import: the models load meanwhile

    # Managed vLLM servers stop with the console however it ends: Ctrl-C ends launch(); SIGTERM and SIGHUP (whose
    # default would end the process without cleaning up) and exceptions end it through the finally; sys.exit
    # elsewhere through atexit. If the console is killed outright, each server's guard stops it (engine.vllm.server).
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _exit_on_signal)
    atexit.register(host.close)
    log.info("history in %s; open http://%s:%d", args.db, args.host, args.port)
    try:
        launch(host, history, args.host, args.port, auth, share=args.share)
    finally:
        host.close()
    return 0


def _exit_on_signal(signum, frame):
    log.info("%s: stopping", signal.Signals(signum).name)
    raise SystemExit(128 + signum)


def suite(args) -> int:
    from specconsole.history import History
    from specconsole.suite_job import SuiteJob, export_suite
    from specconsole.suites import categories, load_file, load_suite, suite_items
    from specconsole.workbench import check_plan

    values = args.values.split(",") if args.values else None
    check_plan(args.sweep, values, args.repeats, args.prompts)
    cli.check_limits(args, "each suite prompt brings its own")
    items = []
    try:
        for category in args.category or ([] if args.file or args.suite else categories()):
            items += load_suite(category)[: args.prompts]
        for name in args.suite or []:  # external suites: a seeded sample, spread over the suite's categories
            items += suite_items(name, args.prompts, args.sample_seed)
        if args.file:
            items += load_file(args.file)[: args.prompts]
    except ValueError as e:  # an unknown category, a bad file, an external suite's package not installed
        log.error("%s", e)
        return 2
    host = backend_host(args).start()
    try:
        if not host.wait():
            log.error("%s", host.status())
            return 2
        history = None if args.sweep == "concurrency" else History(args.db)  # the sweep is not saved as runs
        job = SuiteJob(host.backend, history, items, cli.build_request(args, "", host.method), args.mode, args.sweep,
                       values, args.repeats)
        try:
            job.check()
        except ValueError as e:
            log.error("%s", e)
            return 2
        job.run()
        exported = export_suite(history, host.backend, job.suite_id, Path(args.out),
                                Path(args.report) if args.report else None, host.label, job.concurrency)
        if job.concurrency is not None:
            sys.stdout.write(job.concurrency.to_string(index=False) + "\n")
            return 0
        agg = exported.aggregates
        sys.stdout.write(agg.drop(columns=["per_position", "prompt_speedups"]).to_string(index=False) + "\n\n")
        sys.stdout.write("\n\n".join(a.text() for a in exported.advice) + "\n")
        log.info("suite %s: runs saved in %s; CSV %s", job.suite_id, args.db, " and ".join(map(str, exported.paths)))
        return 0
    finally:
        host.close()


def replay(args) -> int:
    """Export one saved run as a self-contained HTML file that replays it (specconsole.replay)."""
    from specconsole.history import History, HistoryError
    from specconsole.replay import UnknownRun, write_replay

    if not Path(args.db).exists():  # History() would create an empty file there
        log.error("no history database at %s (pass the console's file with --db)", args.db)
        return 2
    try:
        write_replay(History(args.db), args.run_id, args.out)
    except (UnknownRun, HistoryError) as e:
        log.error("%s; the History tab lists the run ids", e)
        return 2
    return 0
