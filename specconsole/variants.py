"""Extra speculative configurations for an N-way comparison: the baseline, the main speculative engine and up to
MAX_EXTRA more, each with its own drafting settings and a label ("n-gram", "draft K=4").

A variant changes only the drafting settings of the main request (engine.drafting.Drafting): prompt,
sampling and max new tokens stay the same, so every engine answers the same question. The page offers PRESETS;
`launch.py demo --compare draft,ngram:k=3` spells them on the command line (parse_compare). A backend whose
speculative engines are servers with a fixed config (vLLM) serves its own variants instead (served()).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from engine.backend import MAX_EXTRA
from engine.methods import PROPOSERS, digits, flag, needs_draft, parse_specs
from engine.request import Request
from engine.limits import SettingsError


@dataclass(frozen=True)
class Variant:
    """One more speculative engine: what the page and the terminal call it, and the request it serves. `server`:
    which of the backend's own speculative engines serves it (vLLM: "speculative-2", one server per config), or None
    where the request's drafting settings say how to draft (local)."""
    label: str
    request: Request
    server: str | None = None
    method: str | None = None  # what the server drafts with, where the request's method does not apply


def served(backend, base: Request, labels: list[str] | None = None) -> list[Variant]:
    """The extra speculative engines a backend serves itself (capabilities.fixed_variants: vLLM's extra servers),
    all of them or those whose labels are in `labels`; each answers the same request."""
    return [Variant(v["label"], base, engine, v["method"]) for engine, v in backend.variants().items()
            if labels is None or v["label"] in labels]


def choose(backend, base: Request, drafting: Callable[[], list[Variant]], labels: list[str] | None = None
           ) -> list[Variant]:
    """The speculative engines of a run, the main one first. A backend that serves fixed variants (vLLM's or
    llama.cpp's servers, each started with its drafting) runs its own: its speculative server, named after the method
    it runs, and the extra ones whose labels are in `labels` (None: all). Any other runs `drafting()` (the page's form
    and presets, `demo --compare`); more than one of them needs a backend that takes drafting settings per run."""
    if backend.capabilities.fixed_variants:
        described = backend.describe()  # the label of its speculative server: "vLLM ngram", "llamacpp-draft"
        main = Variant(described.get("label") or described["method"], base)
        return [main, *served(backend, base, labels)]
    variants = drafting()
    if len(variants) > 1 and not backend.capabilities.per_request_drafting:
        raise SettingsError("comparing drafting settings needs a backend that takes them per run (--backend local)")
    return variants


# The page's "Compare with" choices: label -> the drafting settings that differ from the main request.
PRESETS = {
    "n-gram": {"method": "ngram"},
    "n-gram K=2 fixed": {"method": "ngram", "k": 2, "dynamic_k": False},
    "draft K=4 fixed": {"method": "draft", "k": 4, "dynamic_k": False},
    "draft dynamic K": {"method": "draft", "dynamic_k": True},
    "hybrid": {"method": "hybrid"},
}


def variant(base: Request, label: str, **changes) -> Variant:
    """`base` with other drafting settings. The draft model's confidence and vocabulary mean nothing to n-gram
    drafting, so they are dropped there (as engine.request.build_request does)."""
    req = base.with_drafting(**changes)
    if not needs_draft(req.drafting.method):
        req = req.with_drafting(draft_confidence=0.0, draft_vocab=0)
    if req.drafting.dynamic_k:
        req = req.with_drafting(k_max=max(req.drafting.k_max, req.drafting.k))
    return Variant(label, req)


def from_presets(base: Request, names: list[str] | None) -> list[Variant]:
    """The page's chosen presets, in the order PRESETS lists them, at most MAX_EXTRA."""
    names = [n for n in PRESETS if n in (names or [])]
    if len(names) > MAX_EXTRA:
        raise SettingsError(f"compare with at most {MAX_EXTRA} more configurations, got {len(names)}")
    return [variant(base, name, **PRESETS[name]) for name in names]


def parse_compare(spec: str, base: Request) -> list[Variant]:
    """`draft,ngram,draft:k=4` -> one Variant each: a method, optionally `:k=N` (a fixed K) and `:dynamic`.
    The first becomes the main speculative engine; at most MAX_EXTRA + 1 in all."""
    variants = []
    for part in parse_specs(spec):
        if part.method not in PROPOSERS:
            raise SettingsError(f"--compare: unknown method {part.method!r} in {part.text!r}; methods: "
                                f"{', '.join(PROPOSERS)}")
        changes: dict = {"method": part.method}
        options = part.values({"k": digits, "dynamic": flag}, lambda option, text: SettingsError(
            f"--compare: unknown option {option!r} in {text!r} (use k=N or dynamic)"))
        for name, value in options:
            changes |= {"k": value, "dynamic_k": False} if name == "k" else {"dynamic_k": True}
        variants.append(variant(base, label_of(changes, part.text), **changes))
    if not variants:
        raise SettingsError("--compare needs at least one method, e.g. --compare draft,ngram")
    if len(variants) > MAX_EXTRA + 1:
        raise SettingsError(f"--compare takes at most {MAX_EXTRA + 1} configurations, got {len(variants)}")
    return variants


def label_of(changes: dict, fallback: str) -> str:
    """A short name: the method, and the K when it is fixed ("draft K=4")."""
    method = PROPOSERS.get(changes.get("method"))
    label = method.label if method else fallback
    if "k" in changes:
        label += f" K={changes['k']}"
    elif changes.get("dynamic_k"):
        label += " dynamic K"
    return label
