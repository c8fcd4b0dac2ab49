"""The Run tab's form as one value: what the page's inputs say, the Request they make and the engines they ask for."""

from __future__ import annotations

from dataclasses import dataclass

from engine.request import Request, build_request
from specconsole.variants import Variant, choose, from_presets, label_of


@dataclass
class RunForm:
    """The values of the Run tab's inputs (run_layout.RunControls.inputs() lists those controls in this order, by
    these names)."""
    prompt: str
    category: str
    method: str
    k: float
    dynamic_k: bool
    confidence: float
    draft_vocab: float | None
    fallback: bool
    temperature: float
    top_p: float
    max_new: float
    seed: float | None
    mode: str
    show_rejected: bool
    compare_with: list[str] | None

    def request(self) -> Request:
        return build_request(self.prompt, max_new_tokens=self.max_new, temperature=self.temperature,
                             top_p=self.top_p, seed=self.seed, method=self.method, k=self.k,
                             dynamic_k=self.dynamic_k, draft_confidence=self.confidence, fallback=self.fallback,
                             draft_vocab=self.draft_vocab)

    def engines(self, backend) -> tuple[Request, Variant, list[Variant]]:
        """The run's request and its speculative configurations (the main one, then the extra ones), checked by
        `backend`; raises SettingsError, ModelError or ValueError with the reason."""
        req = self.request()
        backend.validate(req)  # before anything runs or is saved
        # vLLM, llama.cpp: "Compare with" lists the backend's own extra servers; local: the drafting presets
        drafting = {"method": self.method} | ({"dynamic_k": True} if self.dynamic_k else {"k": int(self.k)})
        label = label_of(drafting, self.method)
        speculative, *extra = choose(backend, req, lambda: [Variant(label, req), *from_presets(req, self.compare_with)],
                                     self.compare_with or [])
        for v in extra:
            backend.validate(v.request)
        return req, speculative, extra
