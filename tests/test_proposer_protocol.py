"""Every registered drafting method's proposer implements engine.exact.proposers.Proposer with the protocol's own
signatures, and the registry (engine.methods.PROPOSERS) is all that a new method needs: validation, the local
backend and `--compare` take it from there."""

import inspect

import pytest
import torch

from engine.methods import METHODS, PROPOSERS, Method, needs_draft
from engine.exact.proposers import Draft, Proposal, Proposer
from engine.drafting import Drafting
from engine.request import Request
from engine.limits import SettingsError
from specconsole.variants import parse_compare

MEMBERS = [name for name, value in vars(Proposer).items() if inspect.isfunction(value) and not name.startswith("_")]


def test_the_protocol_names_what_the_engine_uses():
    assert MEMBERS == ["propose"]
    assert {"method", "generator"} <= set(Proposer.__annotations__)


def test_the_user_facing_names_and_labels():
    assert METHODS == ("draft", "ngram", "hybrid")
    assert {name: (m.label, m.needs_draft) for name, m in PROPOSERS.items()} == {
        "draft": ("draft", True), "ngram": ("n-gram", False), "hybrid": ("hybrid", True)}


@pytest.mark.parametrize("name", list(PROPOSERS))
@pytest.mark.parametrize("member", MEMBERS)
def test_each_proposer_implements_each_member_with_the_protocol_signature(name, member):
    cls = PROPOSERS[name].proposer_class()
    want = list(inspect.signature(getattr(Proposer, member)).parameters)
    got = list(inspect.signature(getattr(cls, member)).parameters)
    assert got == want, f"{cls.__name__}.{member}{got} differs from Proposer.{member}{want}"


@pytest.mark.parametrize("name", list(PROPOSERS))
def test_each_registered_method_builds_a_proposer_saved_under_its_name(name, tiny_pair):
    target, draft = tiny_pair
    method = PROPOSERS[name]
    lent = Draft(draft, target.config.vocab_size) if method.needs_draft else None  # a lookup is built without one
    assert list(inspect.signature(method.proposer_class().build).parameters) == ["req", "draft"]
    proposer = method.build(Request(prompt="x", drafting=Drafting(method=name)), lent)
    assert isinstance(proposer, Proposer) and proposer.method == name
    proposer.generator = torch.Generator()
    proposal = proposer.propose([5, 6, 7, 5, 6], 2)
    assert 0 < len(proposal.ids) <= 2 and proposal.drafter in PROPOSERS


class Echo:
    """A made-up method: drafts the last committed token k times."""

    method = "echo"
    generator = None

    @classmethod
    def build(cls, req: Request, draft: Draft | None) -> "Echo":
        return cls()

    def propose(self, ids: list[int], k: int, stop=None) -> Proposal:
        return Proposal([ids[-1]] * k, None, self.method)


def test_a_new_method_is_a_class_and_its_registry_line(backend, monkeypatch):
    """Registered, a proposer is accepted by Request validation, `--compare` and the local backend, with no draft
    model lent to it, and its greedy output is the baseline's."""
    with pytest.raises(SettingsError, match="method must be one of draft, ngram, hybrid, got 'echo'"):
        Request(prompt="x", drafting=Drafting(method="echo")).validate()
    monkeypatch.setitem(PROPOSERS, "echo", Method("echo", needs_draft=False, proposer=f"{__name__}:Echo"))
    [v] = parse_compare("echo:k=2", Request(prompt="Name a colour.", max_new_tokens=12,
                                            drafting=Drafting(draft_confidence=0.4)))
    assert v.label == "echo K=2" and v.request.drafting.draft_confidence == 0.0 and not needs_draft("echo")
    spec = list(backend.speculative(v.request))[-1]
    base = list(backend.baseline(v.request))[-1]
    assert spec.error is None and spec.method == "echo" and {s.drafter for s in spec.steps if s.drafted} == {"echo"}
    assert spec.output_ids == base.output_ids


def test_a_method_that_needs_the_draft_model_is_refused_without_one(backend):
    from engine.exact.backend import LocalBackend

    alone = LocalBackend(backend.target, None)
    with pytest.raises(SettingsError, match="no draft model, which hybrid drafting needs"):
        alone.validate(Request(prompt="x", drafting=Drafting(method="hybrid")))
    alone.validate(Request(prompt="x", drafting=Drafting(method="ngram")))
