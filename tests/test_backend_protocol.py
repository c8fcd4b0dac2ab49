"""The backends implement engine.backend.Backend with the protocol's own signatures, and say what they can do."""

import inspect
from dataclasses import fields, replace

import pytest

from engine.backend import Backend, Capabilities
from engine.drafting import Drafting
from engine.llamacpp.backend import LlamaCppBackend
from engine.llamacpp.server import EngineConfig, LlamaCppError, parse_method
from engine.exact.backend import LocalBackend
from engine.request import Request
from engine.limits import MAX_K, SettingsError
from engine.vllm.backend import VLLMBackend
from engine.vllm.config import METHODS as VLLM_METHODS
from engine.vllm.server import VLLMError

MEMBERS = [name for name, value in vars(Backend).items() if inspect.isfunction(value) and not name.startswith("_")]


def test_the_protocol_names_what_callers_use():
    assert {"validate", "ignored_settings", "baseline", "speculative", "variants", "score", "describe", "memory",
            "reconfigure", "throughput", "close"} <= set(MEMBERS)


@pytest.mark.parametrize("cls", [LocalBackend, VLLMBackend, LlamaCppBackend])
@pytest.mark.parametrize("member", MEMBERS)
def test_each_backend_implements_each_member_with_the_protocol_signature(cls, member):
    want = list(inspect.signature(getattr(Backend, member)).parameters)
    got = list(inspect.signature(getattr(cls, member)).parameters)
    assert got == want, f"{cls.__name__}.{member}{got} differs from Backend.{member}{want}"


def test_capabilities_say_which_drafting_and_which_k():
    assert {"methods", "sweep_methods", "k_range"} <= {f.name for f in fields(Capabilities)}
    assert Capabilities(False, False, False, False).k_range == (1, MAX_K)  # engine.limits' unless a backend says less


def test_one_drafting_type_crosses_the_seam():
    """A request's drafting (the local engines) and a server's (drafting(), reconfigure()) are one type."""
    hints = {name: inspect.signature(getattr(Backend, name)) for name in ("drafting", "reconfigure")}
    assert hints["drafting"].return_annotation == "Drafting | None"
    assert hints["reconfigure"].parameters["drafting"].annotation == "Drafting"
    assert {f.name: f.type for f in fields(Request)}["drafting"] == "Drafting"
    assert Request(prompt="x").with_drafting(k=7).drafting == Drafting(k=7)


def test_the_local_backend_names_a_servers_drafting_fields_it_ignores(backend):
    """The draft model is loaded with the local backend: a request's draft path and server options do not apply."""
    req = Request(prompt="x").with_drafting(draft="/m/draft", options=(("n_min", 2),))
    assert backend.ignored_settings(req) == ("draft", "options")


def test_capabilities_and_isinstance(backend):
    assert isinstance(backend, Backend)
    caps = backend.capabilities
    assert caps.knows_rejected and caps.per_request_drafting and not caps.can_reconfigure
    assert not caps.fixed_variants and backend.variants() == {}  # N-way extras are the request's drafting settings
    assert backend.ignored_settings(Request(prompt="x")) == ()
    assert backend.memory()["needed_gb"] > 0
    with pytest.raises(SettingsError, match="concurrency sweep needs vLLM"):
        backend.throughput("baseline", ["a"], 4)


def test_vllm_backend_says_which_settings_it_ignores():
    attached = VLLMBackend("http://127.0.0.1:9", "http://127.0.0.1:9", "m")
    assert isinstance(attached, Backend)
    assert attached.capabilities == Capabilities(knows_rejected=False, per_request_drafting=False,
                                                 can_reconfigure=False, concurrent_requests=True,
                                                 fair_strategy="sequential", fixed_variants=True,
                                                 methods=VLLM_METHODS, sweep_methods=("ngram",), k_range=(1, MAX_K))
    assert attached.drafting() is None  # attached without its config
    with pytest.raises(VLLMError, match="only vllm servers the console started can be reconfigured"):
        attached.reconfigure(Drafting("ngram", 2))  # nothing was stopped: there is nothing of ours to restart
    assert attached.variants() == {}  # two servers: no extra speculative engines
    assert set(attached.ignored_settings(Request(prompt="x"))) == {"method", "k", "dynamic_k", "fallback",
                                                                    "draft_confidence", "draft_vocab"}
    assert attached.memory() is None


def test_vllm_backend_serves_its_extra_servers_as_variants():
    """Each extra speculative server is an N-way engine named after its config; an unknown engine is refused."""
    from engine.vllm.config import speculative_config
    backend = VLLMBackend("http://127.0.0.1:9", "http://127.0.0.1:9", "m", speculative=speculative_config("ngram", 4),
                          extra=[("http://127.0.0.1:9", speculative_config("ngram", 2)), ("http://127.0.0.1:9", None)])
    assert backend.variants() == {"speculative-2": {"label": "vLLM ngram K=2", "method": "ngram"},
                                  "speculative-3": {"label": "vLLM (config not given)", "method": "vllm"}}
    with pytest.raises(VLLMError, match="no speculative-4 engine on this vllm backend"):
        list(backend.speculative(Request(prompt="x"), engine="speculative-4"))


def test_each_backend_says_the_k_it_drafts():
    """Every backend drafts 1 to engine.limits' K: ours per request; vLLM's num_speculative_tokens and llama.cpp's
    draft n_max / n-gram length go higher, and the console's limit caps them."""
    vllm = VLLMBackend("http://127.0.0.1:9", "http://127.0.0.1:9", "m")
    llama = LlamaCppBackend({"baseline": "http://127.0.0.1:9", "speculative": "http://127.0.0.1:9"},
                            {"baseline": None, "speculative": None})
    assert LocalBackend.capabilities.k_range == vllm.capabilities.k_range == llama.capabilities.k_range == (1, MAX_K)


def test_a_request_for_a_k_the_backend_does_not_draft_is_refused(backend, monkeypatch):
    monkeypatch.setattr(backend, "capabilities", replace(backend.capabilities, k_range=(1, 8)))
    backend.validate(Request(prompt="x", drafting=Drafting(k=8)))
    with pytest.raises(SettingsError, match="^K must be between 1 and 8, got 9: this backend drafts 1 to 8 tokens"):
        backend.validate(Request(prompt="x", drafting=Drafting(k=9)))


def test_a_server_is_not_restarted_with_a_k_it_does_not_draft():
    """The servers' K is their own (the request's is ignored): reconfigure() checks it, before stopping anything."""
    vllm = VLLMBackend("http://127.0.0.1:9", "http://127.0.0.1:9", "m")
    vllm.capabilities = replace(vllm.capabilities, k_range=(1, 8))
    vllm.validate(Request(prompt="x", drafting=Drafting(k=9)))  # not applied: nothing to refuse
    with pytest.raises(SettingsError, match="K must be between 1 and 8, got 9"):
        vllm.reconfigure(Drafting("ngram", 9))
    llama = LlamaCppBackend({"baseline": "http://127.0.0.1:9", "speculative": "http://127.0.0.1:9"},
                            {"baseline": None, "speculative": None})
    with pytest.raises(SettingsError, match=f"K must be between 1 and {MAX_K}, got {MAX_K + 1}"):
        llama.reconfigure(Drafting("draft", MAX_K + 1))
    # llama.cpp would take K = 0 (no drafting) or far more than the limit from the command line: refused there too
    for k in (0, MAX_K + 1):
        with pytest.raises(LlamaCppError, match=f"K must be between 1 and {MAX_K}, got {k}"):
            EngineConfig("speculative", "t.gguf", "draft", k=k)
        with pytest.raises(LlamaCppError, match="K must be between"):
            parse_method(f"ngram-simple:k={k}", EngineConfig("speculative", "t.gguf"))


@pytest.mark.parametrize("cores, strategy", [(2, "sequential"), (3, "parallel")])
def test_managed_engines_run_at_once_only_with_a_core_left_for_the_console(monkeypatch, cores, strategy):
    """Two vLLM servers on one core each, or two one-thread llama.cpp engines: on 2 cores the console and the page
    would share an engine's core, so fair mode takes turns; with a third core the engines run at once. GPU servers
    always run at once."""
    import os
    from types import SimpleNamespace

    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    on_cores = [SimpleNamespace(config=SimpleNamespace(gpu=False, cpu_core=i, threads=1)) for i in range(2)]
    vllm = VLLMBackend("http://127.0.0.1:9", "http://127.0.0.1:9", "m", servers=on_cores)
    llama = LlamaCppBackend({"baseline": "http://127.0.0.1:9", "speculative": "http://127.0.0.1:9"},
                            {"baseline": None, "speculative": None}, servers=on_cores)
    assert vllm.capabilities.fair_strategy == llama.capabilities.fair_strategy == strategy
    on_gpu = [SimpleNamespace(config=SimpleNamespace(gpu=True, cpu_core=None)) for _ in range(2)]
    assert VLLMBackend("http://127.0.0.1:9", "http://127.0.0.1:9", "m", servers=on_gpu).capabilities.fair_strategy \
        == "parallel"
