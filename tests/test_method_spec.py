"""One parser of the `method[:name=value][:flag],...` spelling (engine.methods) behind `--compare`, `--vllm-compare`
and `--llamacpp-compare`: each caller says which options it takes, and its messages name the entry as typed."""

import pytest

from engine.llamacpp.server import EngineConfig, LlamaCppError, parse_method
from engine.methods import digits, flag, nonempty, parse_spec, parse_specs
from engine.drafting import Drafting
from engine.request import Request
from engine.limits import SettingsError
from engine.vllm.config import parse_configs
from engine.vllm.server import VLLMError
from specconsole.variants import parse_compare

OPTIONS = {"k": digits, "dynamic": flag, "draft": nonempty}


def error(option, text):
    return SettingsError(f"{option} in {text}")


def test_a_comma_list_of_methods_with_options_in_the_order_typed():
    specs = parse_specs(" draft:k=4:dynamic, ,ngram,draft_model:draft=/m:k=2,")
    assert [(s.text, s.method, s.options) for s in specs] == [
        ("draft:k=4:dynamic", "draft", ("k=4", "dynamic")), ("ngram", "ngram", ()),
        ("draft_model:draft=/m:k=2", "draft_model", ("draft=/m", "k=2"))]
    assert specs[0].values(OPTIONS, error) == [("k", 4), ("dynamic", True)]
    assert specs[2].values(OPTIONS, error) == [("draft", "/m"), ("k", 2)]
    assert parse_specs(" , ") == []


@pytest.mark.parametrize("typed, option", [("draft:k=x", "k=x"), ("draft:k=", "k="), ("draft:k=-1", "k=-1"),
                                           ("draft:dynamic=1", "dynamic=1"), ("draft:draft=", "draft="),
                                           ("draft:q=1", "q=1"), ("draft:k=2:", "")])
def test_an_unknown_option_or_a_refused_value_names_the_option_and_the_entry(typed, option):
    with pytest.raises(SettingsError) as e:
        parse_spec(f" {typed} ").values(OPTIONS, error)
    assert str(e.value) == f"{option} in {typed}"


def test_each_caller_keeps_its_options_and_messages():
    base = Request(prompt="x", drafting=Drafting(k=5, dynamic_k=True))
    variants = parse_compare("draft:k=3:dynamic,ngram:dynamic:k=3", base)
    assert [(v.request.drafting.k, v.request.drafting.dynamic_k) for v in variants] == [(3, True), (3, False)]
    with pytest.raises(SettingsError, match=r"^--compare: unknown option 'draft=/m' in 'draft:draft=/m' \(use k=N or"):
        parse_compare("draft:draft=/m", base)
    with pytest.raises(SettingsError, match=r"^--compare: unknown method 'eagle' in 'eagle:k=2'; methods: draft, "):
        parse_compare("eagle:k=2", base)
    assert [c["num_speculative_tokens"] for c in parse_configs("ngram:k=2:k=6,ngram", 3)] == [6, 3]
    with pytest.raises(VLLMError, match=r"^--vllm-compare: unknown option 'dynamic' in 'ngram:dynamic' \(use k=N"):
        parse_configs("ngram:dynamic")
    config = parse_method("ngram-simple:k=4:n=3:p_min=0.5", EngineConfig("speculative", "m"))
    assert (config.method, config.k, config.ngram_n, config.p_min) == ("ngram-simple", 4, 3, 0.5)
    with pytest.raises(LlamaCppError, match=r"^'draft:k=x': k must be a number, got 'x'$"):
        parse_method("draft:k=x", EngineConfig("speculative", "m"))
    with pytest.raises(LlamaCppError, match=r"^'draft:k=': options are k=N, n_min=N, p_min=X and n=N"):
        parse_method("draft:k=", EngineConfig("speculative", "m"))
