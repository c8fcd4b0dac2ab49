"""The ModelHost (specconsole.host) of each backend that `--backend` names, built from launch.py's options: the local
engine on a preset's models, llama.cpp engines and vLLM servers, managed or attached. Their options are checked here,
before anything loads; a wrong one ends the command with its message (SystemExit)."""

from __future__ import annotations

import os

from specconsole.host import ModelHost


def preset_of(args):
    from engine.presets import custom_preset

    return custom_preset(args.preset, args.target, args.draft)


def backend_host(args) -> ModelHost:
    """The ModelHost of --backend."""
    return {"vllm": vllm_host, "llamacpp": llamacpp_host}.get(args.backend, local_host)(args)


def local_factory(args, target_only: bool = False):
    """What builds our engines from the options (a picklable call of on_progress): run in the engine process.
    `target_only`: the preset's target alone (the baseline's engine process, --local-memory)."""
    from dataclasses import replace
    from functools import partial

    from engine.exact.backend import LocalBackend

    preset = replace(preset_of(args), draft=None, method="ngram") if target_only else preset_of(args)
    return partial(LocalBackend.from_preset, preset, args.device, args.min_rows, precision=args.precision,
                   calibrate=not target_only)


def local_host(args) -> ModelHost:
    """Our engines, in an engine process of their own (engine.process): the console holds no model."""
    from engine.limits import SettingsError
    from engine.process.client import EngineProcess
    from engine.process.split import SplitEngines, parse_shares

    preset = preset_of(args)
    try:
        shares = parse_shares(args.local_memory) if args.local_memory else None
    except SettingsError as e:
        raise SystemExit(str(e)) from e

    def label(target: str, draft: str | None, note: str = "") -> str:
        return f"local: target {target}, draft {draft or 'n-gram prompt lookup'}{note}"

    def factory(progress):
        if shares:  # one engine process per engine, each held to its share of the device's memory
            backend = SplitEngines.start(local_factory(args, target_only=True), local_factory(args), shares, progress)
        else:
            backend = EngineProcess(local_factory(args), "engine process").start(progress)
        # the status line names what runs: the target's precision ("auto" chose it), and why not int4
        try:
            why, served = backend.why_float32(), backend.describe()
        except Exception:
            backend.close()  # the host never holds it: nobody else would
            raise
        note = (f" (float32: {why})" if why else "") + (
            f"; baseline and speculative engine in two processes, memory shares {shares[0]:g} / {shares[1]:g}"
            if shares else "")
        host.label = label(served["target_model"], served["draft_model"], note)
        return backend

    host = ModelHost(label(preset.target, preset.draft), factory, preset.method)
    return host


def llamacpp_host(args) -> ModelHost:
    """llama.cpp engines: attached (--llamacpp-attach) or started on the preset's GGUF files. The installed build's
    option names are checked here, before anything loads."""
    from dataclasses import replace

    from engine.backend import MAX_EXTRA
    from engine.serving.http_safety import redact
    from engine.llamacpp.backend import LlamaCppBackend
    from engine.llamacpp.server import (DRAFT_MODEL_METHODS, EngineConfig, LlamaCppError, check_build, choose_build,
                                        parse_method)
    from engine.loading.weights import SOURCES, gguf_model

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
            if args.llamacpp_server == "wheel":  # a llama-server binary checks its own options as it starts
                check_build(config)
            if config.method in DRAFT_MODEL_METHODS and not preset.draft:
                raise LlamaCppError(f"llama.cpp {config.method} drafting needs a draft GGUF: pass --draft")
    except LlamaCppError as e:
        raise SystemExit(str(e)) from e
    for spec in filter(None, (preset.target, preset.draft)):
        if spec not in SOURCES and not spec.endswith(".gguf"):
            raise SystemExit(f"llama.cpp loads GGUF files: {spec!r} is neither a known model nor a .gguf file")

    own = None  # a binary of the user's own: checked (and its version read) now, before anything loads
    if args.llamacpp_server not in ("auto", "wheel"):
        try:
            own = choose_build(args.llamacpp_server)
        except LlamaCppError as e:
            raise SystemExit(str(e)) from e

    def factory(progress):
        target = str(gguf_model(preset.target, on_progress=progress)[0])
        draft = str(gguf_model(preset.draft, on_progress=progress)[0]) if preset.draft else None
        build = own or choose_build(args.llamacpp_server, on_progress=progress, model=target)
        host.label = f"{title}; {build.description}"
        configs = [replace(c, model=target, draft=draft if c.method in DRAFT_MODEL_METHODS else None)
                   for c in (base, *extra)]
        return LlamaCppBackend.managed(configs[0], configs[1:], on_progress=progress, build=build)

    labels = ", ".join(c.label() for c in (base, *extra))
    title = f"llama.cpp (managed, {args.llamacpp_threads} threads each): {labels}"
    host = ModelHost(title, factory)
    return host


def vllm_host(args) -> ModelHost:
    """vLLM servers: attached (--vllm-attach) or started on the preset's target, one per speculative config."""
    from engine.backend import MAX_EXTRA
    from engine.serving.http_safety import redact
    from engine.exact.models import resolve
    from engine.vllm.backend import VLLMBackend
    from engine.vllm.config import parse_configs, speculative_config
    from engine.vllm.server import VLLMError, has_gpu, memory_shares

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
    try:
        split = memory_shares(n, tuple(float(x) for x in args.vllm_memory.split(",")) if args.vllm_memory else None)
    except VLLMError as e:
        raise SystemExit(f"--vllm-memory: {e}") from e
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
        placement = "GPU memory " + "/".join(f"{x:.2f}" for x in split)
    else:  # more servers than cores: VLLMBackend.managed wraps the cores around, and fair mode takes turns
        cores = os.cpu_count() or 1
        placement = "one CPU core each" + (f" (cores wrap around: {n} servers on {cores} cores)" if n > cores else "")
    configs = f"speculative config {spec}" + "".join(f", {c}" for c in extra)
    return ModelHost(f"vLLM (managed: {placement}), {configs}", factory, "draft")
