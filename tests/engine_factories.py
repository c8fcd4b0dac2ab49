"""Backends an engine process builds in the tests (engine.process): module-level, so that they pickle. Each builds
the same models as the fixtures of tests/conftest.py (the same seeds), so that the process serves what the test
process would."""

from __future__ import annotations

import os
import signal
import threading


def tiny_chat_backend(on_progress=None, hidden: int = 0, target_only: bool = False):
    """A LocalBackend over conftest's tiny_chat_pair: SmolLM2's tokenizer, random tiny models. `hidden`: wider
    models instead (passes of milliseconds rather than a fraction of one), built the same way. `target_only`: the
    target alone (the baseline's engine process with --local-memory)."""
    from transformers import AutoTokenizer

    from engine.exact.backend import LocalBackend
    from engine.exact.optimize import prepare_draft, prepare_target
    from engine.exact.models import LoadedModel
    from engine.loading.weights import dequantized_dir
    from tests.conftest import CPU, perturbed, tiny_llama

    tokenizer = AutoTokenizer.from_pretrained(dequantized_dir("smollm2-135m-instruct"))
    if on_progress:
        on_progress("building the tiny models", 0, 1)
    target = tiny_llama(len(tokenizer), seed=3, **({"hidden": hidden} if hidden else {}))
    draft = perturbed(target, 0.6, seed=4)
    target, draft = prepare_target(target, CPU), prepare_draft(draft, CPU, int8=False)
    backend = LocalBackend(LoadedModel("tiny", target, tokenizer, CPU),
                           None if target_only else LoadedModel("tiny-draft", draft, tokenizer, CPU))
    if not target_only:
        backend.calibrate()  # now, as a preset's backend does at its start: not in a run's first pass
    return backend


def failing_backend(on_progress=None):
    """A backend whose models cannot load."""
    from engine.exact.models import ModelError

    raise ModelError("no such model: planted by the test")


def dying_backend(on_progress=None):
    """A process that dies while it loads (as one killed by the kernel's OOM killer would)."""
    os.kill(os.getpid(), signal.SIGKILL)


class _ThreadsSeen:
    """A backend that notes which thread built it and which thread computed each event of its engines' streams;
    memory() returns the notes, (what, thread id) pairs."""

    def __init__(self, inner):
        self.inner, self.seen = inner, [("build", threading.get_ident())]

    def _watch(self, what, stream):
        for event in stream:
            self.seen.append((what, threading.get_ident()))
            yield event

    def baseline(self, req, cancel=None, clock=None):
        return self._watch("baseline", self.inner.baseline(req, cancel, clock))

    def speculative(self, req, cancel=None, clock=None, engine="speculative"):
        return self._watch("speculative", self.inner.speculative(req, cancel, clock, engine=engine))

    def memory(self):
        return {"threads": list(self.seen)}

    def __getattr__(self, name):
        return getattr(self.inner, name)


def threads_seen_backend(on_progress=None):
    """tiny_chat_backend, noting the threads that build it and compute its passes (_ThreadsSeen)."""
    return _ThreadsSeen(tiny_chat_backend(on_progress))
