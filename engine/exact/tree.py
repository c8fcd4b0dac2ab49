"""The token tree: one branching in a greedy verify pass, in the rows the pass has free.

A target pass over fewer than `tree_rows` tokens costs as much as `tree_rows` (engine.exact.optimize pads short passes
to MIN_ROWS). Greedy, in every pass but the one that reads the prompt, the speculative engine (engine.exact.decode) fills
those free rows with the draft's next-best tokens (alternatives) for the draft where it was least sure, d_at:

    pass rows   [last committed, d_0 .. d_{K-1}, a_0 .. a_{A-1}]    A <= tree_rows - K - 1
    a_j         read at d_at's position, seeing the cache, the rows before d_at and itself: a plain step's view

When the target refuses the chain exactly at d_at and its own token there is one of the alternatives, that
alternative is accepted in d_at's place, and its row's logits already give the target's next token (the bonus):
one token more than the chain alone commits. Its keys and values then move to d_at's cache slot.

In the order a step uses them: how many alternatives a drafter names (`width`) and which (`runners_up`), which of
them a pass verifies (`Tree.plan`), how their rows attend (`attend`; their positions: engine.exact.forward.PassLayout),
and accepting one, which moves its cache slot (`Tree.accept`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.exact.forward import PassLayout, move_position


def width(tree_rows: int) -> int:
    """How many alternatives a drafter names for passes of up to `tree_rows` rows: every row but the last committed
    token's and one draft's."""
    return max(0, tree_rows - 2)


def runners_up(logits: torch.Tensor, choice: int, n: int) -> list[int]:
    """The n rows of a draft's logits [V] ranked next after its own `choice`, best first."""
    top = logits.topk(n + 1).indices.tolist()
    return [j for j in top if j != choice][:n]


@dataclass(frozen=True)
class Tree:
    """The alternatives one pass verifies; none (an empty tree) in most passes."""

    at: int = 0  # the draft they stand in for: d_at
    alternatives: list[int] = field(default_factory=list)  # [A] their ids, best first: the pass's last A rows

    @classmethod
    def plan(cls, proposal, K: int, tree_rows: int, greedy: bool, prompt_pass: bool) -> Tree:
        """The tree of a pass over the last committed token and K drafts (`proposal` names the alternatives): greedy
        only (sampled verification has none), not in the pass that reads the prompt, only where d_at is among the K
        drafts, and only as many as the rows the pass leaves free below `tree_rows`."""
        at = proposal.branch_at
        if not greedy or prompt_pass or at >= K:
            return cls(at)
        return cls(at, proposal.alternatives[: max(0, tree_rows - K - 1)])

    @property
    def row(self) -> int:
        """The pass row of d_at (PassLayout.alt_at): row 0 is the last committed token."""
        return self.at + 1

    def accept(self, drafts: list[int], n: int, token: int, logits: torch.Tensor, cache,
               committed: int) -> tuple[list[int], int, int]:
        """Greedy verification of the chain accepted n of the K `drafts` and the target chose `token` at position n;
        returns (the accepted ids, the target's token after them, the first refused draft). When the chain was
        refused exactly at d_at and `token` is one of the alternatives, that alternative is accepted in d_at's place,
        the target's token after it (its row's argmax) is the bonus, and its keys and values move to d_at's slot in
        the cache (which holds `committed` tokens before the pass's drafts). logits [K+1+A, V]: the chain's rows,
        then the alternatives'."""
        if n != self.at or token not in self.alternatives:
            return drafts[:n], token, n
        j = self.alternatives.index(token)
        K = len(drafts)
        move_position(cache, committed + K + j, committed + self.at)
        return drafts[: self.at] + [token], int(logits[K + 1 + j].argmax()), self.at


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: PassLayout, scaling,
           gqa: bool) -> torch.Tensor:
    """The attention of a pass's alternative rows (engine.exact.optimize.rowwise_attention, after the chain's rows).
    query [B, H, Q, D]; key, value [B, H_kv, T, D] (the cache's own tensors) with the Q pass rows last -> [B, H, A, D],
    A = layout.alt_rows. `gqa`: H_kv < H, grouped-query attention."""
    Q, T = query.shape[2], key.shape[2]
    seen = T - Q + layout.alt_at  # the cache and the pass's rows before the row the alternatives stand in for
    key, value = key.clone(), value.clone()  # written below: the cache must not change
    out = []
    for j in range(T - layout.alt_rows, T):
        # the alternative's key and value take the place of that row (whose query is done): no copy of the context,
        # and the call is the one a plain step makes at that position (engine.exact.optimize._attend with one query)
        key[:, :, seen], value[:, :, seen] = key[:, :, j], value[:, :, j]
        row = query[:, :, Q - T + j : Q - T + j + 1]
        out.append(F.scaled_dot_product_attention(row, key[:, :, : seen + 1], value[:, :, : seen + 1], scale=scaling,
                                                  enable_gqa=gqa))
    return torch.cat(out, dim=2)
