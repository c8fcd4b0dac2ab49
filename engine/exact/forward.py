"""One forward pass with a KV cache (engine.exact.kv_cache), and cache rollback. Both engines go through these
functions."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from engine.exact import decoder
from engine.exact.kv_cache import new_cache

__all__ = ["PassLayout", "forward", "move_position", "new_cache", "rollback"]  # new_cache: engine.exact.kv_cache's


@dataclass(frozen=True)
class PassLayout:
    """How the rows of one target pass are laid out, where that is not one run of consecutive tokens. `forward`
    makes it from its arguments and hands it to the model as the one keyword `pass_layout`; transformers passes it
    on to the attention function, engine.exact.optimize.rowwise_attention, its only reader (other attention functions
    ignore it). The default is a plain pass.

    prompt_rows  the first pass reads the prompt and the first drafts together: its first `prompt_rows` rows are the
                 prompt (attended as the prefill's), the rest as decoding steps at their positions; None: no prompt
    alt_rows     a token tree (engine.exact.tree): the last `alt_rows` rows are alternatives to pass row `alt_at`, each read
                 at that row's position as if it stood there instead; 0: no tree
    """

    prompt_rows: int | None = None
    alt_rows: int = 0
    alt_at: int = 1

    def positions(self, start: int, rows: int) -> list[int]:
        """Position ids of a pass of `rows` rows after `start` cached ones: consecutive, the alternatives' all that of
        row alt_at."""
        chain = rows - self.alt_rows
        return list(range(start, start + chain)) + [start + self.alt_at] * self.alt_rows


def rollback(cache: DynamicCache, length: int) -> None:
    """Crop the cache back to its first `length` positions (the committed prefix)."""
    drop = cache.get_seq_length() - length
    if drop > 0:
        cache.crop(-drop)


@torch.inference_mode()  # the cache's tensors were made in inference mode: only there may they change in place
def move_position(cache: DynamicCache, src: int, dst: int) -> None:
    """Copy the keys and values at position `src` to position `dst` in every layer: an accepted token-tree row takes
    the place of the draft it replaced (its keys were computed at that position)."""
    for layer in cache.layers:
        layer.keys[:, :, dst] = layer.keys[:, :, src]  # [B, H_kv, T, D]
        layer.values[:, :, dst] = layer.values[:, :, src]


@torch.inference_mode()
def forward(model, ids: list[int], cache: DynamicCache, keep: int, head=None, prompt_rows: int | None = None,
            tree: int = 0, tree_at: int = 1) -> torch.Tensor:
    """Feed `ids` after what the cache holds; return the logits of the last `keep` positions, [keep, V] float32.
    `head` (a draft's engine.exact.vocab.PrunedHead) replaces the model's output layer: [keep, N], and the full layer
    never runs. `prompt_rows`: the first pass reads the prompt and drafts after it; the prompt is its first
    `prompt_rows` ids. `tree`: the last `tree` ids are a token tree's alternatives to ids[tree_at] (engine.exact.tree).
    Both go to the target's attention as a PassLayout (the prompt_rows, alt_rows and alt_at it describes)."""
    x = torch.tensor([ids], dtype=torch.long, device=model.device)  # [1, T]
    layout = PassLayout(prompt_rows, tree, tree_at)
    if decoder.runs(model):
        hidden = decoder.run(model, x, cache, layout)[0, -keep:]  # [keep, H], normed
        return (model.lm_head if head is None else head)(hidden).float()
    if head is not None:
        hidden = model.model(input_ids=x, cache=cache, use_cache=True).last_hidden_state  # [1, T, H], normed
        return head(hidden[0, -keep:]).float()
    extra = {}
    if tree:
        positions = layout.positions(cache.get_seq_length(), len(ids))
        extra["position_ids"] = torch.tensor([positions], device=model.device)  # [1, T]
    out = model(input_ids=x, cache=cache, use_cache=True, logits_to_keep=keep, pass_layout=layout, **extra)
    return out.logits[0, -keep:].float()
