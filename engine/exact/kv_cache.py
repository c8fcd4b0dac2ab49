"""The engines' KV cache: transformers' DynamicCache whose full-attention layers write each pass's keys and values in
place, into a buffer with room to spare.

transformers' DynamicLayer appends a pass's keys and values with torch.cat, which copies the layer's whole cache: a
decoding step copies every layer's keys and values once, a cost that grows with the context. Here a pass writes only
its own rows, and a layer's `keys` and `values` are views of its buffer's first positions; a rollback only shortens
the views, and the next pass overwrites what lies past them. The attention reads the same numbers in the same order
(tests/test_kv_cache.py: the same logits bit for bit as DynamicCache's).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

SPARE = 256  # positions a buffer holds beyond what it was grown for: a run's decoding steps rarely grow it again


class GrowingLayer(DynamicLayer):
    """A DynamicLayer whose keys and values [B, H_kv, T, D] are views of buffers [B, H_kv, capacity, D]."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.buffers: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self.get_seq_length()
        end = start + key_states.shape[-2]
        if not self._in_buffers() or end > self.buffers[0].shape[-2]:
            self.buffers = tuple(_grown(old, new, start, end + SPARE)
                                 for old, new in zip((self.keys, self.values), (key_states, value_states)))
        keys, values = self.buffers
        keys[:, :, start:end].copy_(key_states)
        values[:, :, start:end].copy_(value_states)
        self.keys, self.values = keys[:, :, :end], values[:, :, :end]
        return self.keys, self.values

    def reset(self) -> None:
        super().reset()
        self.buffers = None

    def _in_buffers(self) -> bool:
        """Whether keys and values are still views of the buffers: transformers' own reorder, batch selection and
        offload give the layer new tensors, which the next update copies into new buffers."""
        return self.buffers is not None and all(
            t.data_ptr() == b.data_ptr() and t.shape[:2] == b.shape[:2] and t.device == b.device
            for t, b in zip((self.keys, self.values), self.buffers))


def _grown(old: torch.Tensor, new: torch.Tensor, length: int, capacity: int) -> torch.Tensor:
    """A buffer of `capacity` positions shaped like `new`, holding the first `length` positions of `old`."""
    buffer = new.new_empty(*new.shape[:-2], capacity, new.shape[-1])
    if length:
        buffer[:, :, :length].copy_(old[:, :, :length])
    return buffer


def new_cache(model) -> DynamicCache:
    """An empty cache for `model`: GrowingLayers where transformers would use DynamicLayers (a sliding-window
    layer keeps its own kind)."""
    cache = DynamicCache(config=model.config)
    cache.layers = [GrowingLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache
