"""The speculative methods a vLLM server serves, and the `--speculative-config` for one of them."""

from __future__ import annotations

from engine.drafting import Drafting
from engine.limits import MAX_K
from engine.methods import digits, nonempty, parse_specs
from engine.vllm.server import VLLMError

METHODS = ("ngram", "draft_model", "eagle", "eagle3", "medusa", "mtp", "suffix")
# num_speculative_tokens: vLLM takes any positive count; engine.limits caps it as for every backend
K_RANGE = (1, MAX_K)


def speculative_config(method: str, k: int, draft: str | None = None, ngram_min: int = 1, ngram_max: int = 4) -> dict:
    """The --speculative-config for a method and K."""
    if method not in METHODS:
        raise VLLMError(f"unknown speculative method {method!r}; vLLM serves {', '.join(METHODS)}")
    if not K_RANGE[0] <= k <= K_RANGE[1]:
        raise VLLMError(f"K must be between {K_RANGE[0]} and {K_RANGE[1]}, got {k}")
    config = {"method": method, "num_speculative_tokens": k}
    if method == "ngram":
        config |= {"prompt_lookup_min": ngram_min, "prompt_lookup_max": ngram_max}
    elif method in ("draft_model", "eagle", "eagle3", "medusa"):
        if not draft:
            raise VLLMError(f"method {method!r} needs a draft model path")
        config["model"] = draft
    elif draft:  # mtp and suffix use the target's own heads / no model; a path is passed through when given
        config["model"] = draft
    return config


def parse_configs(spec: str, default_k: int = 4) -> list[dict]:
    """`ngram:k=2,draft_model:k=4:draft=/models/d` (launch.py --vllm-compare) -> one --speculative-config each: a
    method, optionally `:k=N` (else `default_k`) and `:draft=PATH`."""
    configs = []
    for part in parse_specs(spec):
        options = dict(part.values({"k": digits, "draft": nonempty}, lambda option, text: VLLMError(
            f"--vllm-compare: unknown option {option!r} in {text!r} (use k=N or draft=PATH)")))
        configs.append(speculative_config(part.method, options.get("k", default_k), options.get("draft")))
    return configs


def server_label(config: dict | None) -> str:
    """What the page calls a speculative server: its method and K ("vLLM ngram K=2"), as far as it is known."""
    if not config:
        return "vLLM (config not given)"
    k = config.get("num_speculative_tokens")
    return f"vLLM {config.get('method', '?')}" + (f" K={k}" if k else "")


def drafting_of(config: dict) -> Drafting | None:
    """A --speculative-config as the console's Drafting (None where the config is not known)."""
    if not config:
        return None
    options = tuple((key, value) for key, value in config.items()
                    if key not in ("method", "num_speculative_tokens", "model"))
    return Drafting(config["method"], config["num_speculative_tokens"], config.get("model"), options)


def config_of(drafting: Drafting, draft: str | None = None) -> dict:
    """The --speculative-config for a Drafting; `draft`: the draft model where the Drafting names none."""
    return speculative_config(drafting.method, drafting.k, drafting.draft or draft) | dict(drafting.options)
