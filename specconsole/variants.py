"""Extra speculative configurations for an N-way comparison: the baseline, the main speculative engine and up to
MAX_EXTRA more, each with its own drafting settings and a label ("n-gram", "draft K=4").

A variant changes only the drafting settings of the main request (engine.backend.DRAFTING_SETTINGS): prompt,
sampling and max new tokens stay the same, so every engine answers the same question. The page offers PRESETS;
`launch.py demo --compare draft,ngram:k=3` spells them on the command line (parse_compare). A backend whose
speculative engines are servers with a fixed config (vLLM) serves its own variants instead (served()).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from engine.backend import MAX_EXTRA
from engine.request import METHODS, MODEL_METHODS, Request
from engine.sampling import SettingsError

METHOD_LABELS = {"draft": "draft", "ngram": "n-gram", "hybrid": "hybrid"}


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
    req = replace(base, **changes)
    if req.method not in MODEL_METHODS:
        req = replace(req, draft_confidence=0.0, draft_vocab=0)
    if req.dynamic_k:
        req = replace(req, k_max=max(req.k_max, req.k))
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
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        method, *options = part.split(":")
        if method not in METHODS:
            raise SettingsError(f"--compare: unknown method {method!r} in {part!r}; methods: {', '.join(METHODS)}")
        changes: dict = {"method": method}
        for option in options:
            name, _, value = option.partition("=")
            if name == "k" and value.isdigit():
                changes |= {"k": int(value), "dynamic_k": False}
            elif name == "dynamic" and not value:
                changes["dynamic_k"] = True
            else:
                raise SettingsError(f"--compare: unknown option {option!r} in {part!r} (use k=N or dynamic)")
        variants.append(variant(base, label_of(changes, part), **changes))
    if not variants:
        raise SettingsError("--compare needs at least one method, e.g. --compare draft,ngram")
    if len(variants) > MAX_EXTRA + 1:
        raise SettingsError(f"--compare takes at most {MAX_EXTRA + 1} configurations, got {len(variants)}")
    return variants


def label_of(changes: dict, fallback: str) -> str:
    """A short name: the method, and the K when it is fixed ("draft K=4")."""
    label = METHOD_LABELS.get(changes.get("method"), fallback)
    if "k" in changes:
        label += f" K={changes['k']}"
    elif changes.get("dynamic_k"):
        label += " dynamic K"
    return label
