"""One forward pass with a KV cache, and cache rollback. Both engines go through these functions."""

from __future__ import annotations

import torch
from transformers import DynamicCache


def new_cache(model) -> DynamicCache:
    return DynamicCache(config=model.config)


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
    `head` (a draft's engine.vocab.PrunedHead) replaces the model's output layer: [keep, N], and the full layer
    never runs. `prompt_rows`: the first pass reads the prompt and drafts after it; the prompt is its first
    `prompt_rows` ids (the target's rowwise attention then treats the two parts as their own passes would).
    `tree`: the last `tree` ids are alternatives to ids[tree_at] (a token tree with one branching): each is read at
    that position, seeing the cache, ids[:tree_at] and itself, as if it stood there instead of ids[tree_at]."""
    x = torch.tensor([ids], dtype=torch.long, device=model.device)  # [1, T]
    if head is not None:
        hidden = model.model(input_ids=x, cache=cache, use_cache=True).last_hidden_state  # [1, T, H], normed
        return head(hidden[0, -keep:]).float()
    extra = {} if prompt_rows is None else {"prompt_rows": prompt_rows}
    if tree:
        start, chain = cache.get_seq_length(), len(ids) - tree
        positions = list(range(start, start + chain)) + [start + tree_at] * tree
        extra.update(position_ids=torch.tensor([positions], device=model.device), tree_rows=tree, tree_at=tree_at)
    out = model(input_ids=x, cache=cache, use_cache=True, logits_to_keep=keep, **extra)
    return out.logits[0, -keep:].float()
