"""Model presets: a target, its draft (or n-gram drafting) and the drafting method runs start with. No torch: the
HTTP backends and the command line read them too."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Preset:
    name: str
    target: str  # a name in engine.loading.weights.SOURCES, a transformers model directory, or a .gguf file
    draft: str | None  # None: n-gram prompt lookup drafts
    method: str  # the drafting method runs start with: "draft" | "ngram" | "hybrid"
    description: str
    int8_draft: bool = True


PRESETS = {
    "qwen-coder": Preset(
        "qwen-coder",
        "qwen2.5-coder-1.5b-instruct",
        "qwen2.5-coder-0.5b-instruct",
        "hybrid",  # prompt lookup where the text repeats, the draft model elsewhere: ahead of "draft" on unseen prompts
        "Qwen2.5-Coder-1.5B-Instruct target, Qwen2.5-Coder-0.5B-Instruct draft (int8 on CPU), hybrid drafting",
    ),
    "smollm2-ngram": Preset(
        "smollm2-ngram",
        "smollm2-135m-instruct",
        None,
        "ngram",
        "SmolLM2-135M-Instruct target with n-gram prompt-lookup drafts (small and quick)",
    ),
}
DEFAULT_PRESET = "qwen-coder"


def custom_preset(base: str, target: str | None, draft: str | None, int8_draft: bool = True) -> Preset:
    """A preset with its target and/or draft replaced by a model directory, a .gguf file or a known model name."""
    p = PRESETS[base]
    if target is None and draft is None:
        return p
    target = target or p.target
    draft = draft if draft is not None else (p.draft if target == p.target else None)
    method = "draft" if draft else "ngram"
    return Preset("custom", target, draft, method, f"{target} with {draft or 'n-gram drafts'}", int8_draft)
