"""How a run samples its tokens: temperature, top-k, top-p and seed. Torch-free, so that any backend, the page and
the history can use it; engine.exact.sampling warps logits with it."""

from __future__ import annotations

from dataclasses import dataclass

from engine.limits import MAX_TEMPERATURE, SettingsError, check_range


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 means off
    top_p: float = 1.0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        check_range("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        if self.top_k < 0:
            raise SettingsError(f"top-k must be 0 (off) or positive, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise SettingsError(f"top-p must be in (0, 1], got {self.top_p}")
