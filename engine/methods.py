"""The local engine's drafting methods, in one registry, and the command line's spelling of a drafting configuration.

PROPOSERS maps each method name (Drafting.method, `--method`, `--compare`) to its engine.exact.proposers.Proposer and
what it needs: Request validation, the local backend and the page's choices all read it. A new method is one Proposer
class (with a `build` classmethod), its line here, and its tests.

`method[:name=value][:flag]`, a comma list of them, is how `--compare`, `--vllm-compare` and `--llamacpp-compare`
spell configurations; parse_specs splits it, and each caller says which options it takes (Spec.values).

Torch-free: the proposers (engine.exact.proposers needs torch) are imported only when a run builds one.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.exact.proposers import Draft, Proposer
    from engine.request import Request


@dataclass(frozen=True)
class Method:
    label: str  # what the page and the N-way tables call it
    needs_draft: bool  # runs the draft model: its confidence, vocabulary (FR-Spec) and per-token stop apply
    proposer: str  # "module:Class" of its Proposer

    def proposer_class(self) -> type:
        module, _, name = self.proposer.partition(":")
        return getattr(importlib.import_module(module), name)

    def build(self, req: Request, draft: Draft | None = None) -> Proposer:
        """The proposer for one run of `req`; `draft` is the loaded draft model (needed where needs_draft)."""
        return self.proposer_class().build(req, draft)


PROPOSERS = {
    "draft": Method("draft", needs_draft=True, proposer="engine.exact.proposers:DraftModelProposer"),
    "ngram": Method("n-gram", needs_draft=False, proposer="engine.exact.proposers:NgramProposer"),
    # n-gram lookup where the text repeats, the draft model elsewhere
    "hybrid": Method("hybrid", needs_draft=True, proposer="engine.exact.proposers:HybridProposer"),
}
METHODS = tuple(PROPOSERS)  # the choices of the page and the command line


def needs_draft(method: str) -> bool:
    """Whether `method` runs the draft model (an unknown method does not; validation names it)."""
    return method in PROPOSERS and PROPOSERS[method].needs_draft


# --- the spelling: method[:name=value][:flag],... --------------------------------------------------------------------
Option = Callable[[str], object]  # an option's typed value -> its value; ValueError when it is not one


def digits(value: str) -> int:
    """A count such as k=N: digits only."""
    if not value.isdigit():
        raise ValueError(value)
    return int(value)


def flag(value: str) -> bool:
    """An option without a value (`:dynamic`)."""
    if value:
        raise ValueError(value)
    return True


def nonempty(value: str) -> str:
    """A string that must be given (`:draft=PATH`)."""
    if not value:
        raise ValueError(value)
    return value


@dataclass(frozen=True)
class Spec:
    """One configuration as typed: `draft:k=4:dynamic` -> method "draft", options ("k=4", "dynamic")."""

    text: str  # stripped, for messages
    method: str
    options: tuple[str, ...]

    def values(self, parsers: dict[str, Option], error: Callable[[str, str], Exception]) -> list[tuple[str, object]]:
        """(name, value) per option, in the order typed, each through its parser in `parsers`. An unknown option or
        a value its parser refuses raises error(the option as typed, self.text), which says what the caller takes."""
        out = []
        for option in self.options:
            name, _, value = option.partition("=")
            if name not in parsers:
                raise error(option, self.text)
            try:
                out.append((name, parsers[name](value)))
            except ValueError:
                raise error(option, self.text) from None
        return out


def parse_spec(text: str) -> Spec:
    method, *options = text.strip().split(":")
    return Spec(text.strip(), method, tuple(options))


def parse_specs(text: str) -> list[Spec]:
    """A comma list of configurations; empty entries are skipped."""
    return [parse_spec(part) for part in text.split(",") if part.strip()]
