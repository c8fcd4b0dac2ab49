"""Which llama.cpp target pass produced each streamed token, from the timings every chunk carries
(engine.llamacpp.client): predicted_n counts the tokens so far, draft_n / draft_n_accepted count the drafts so far,
and predicted_ms is set once per pass of the server's loop (every token a pass commits streams with the same value).

llama.cpp streams one chunk per token, except where a token ends inside a UTF-8 character: that token has no chunk
of its own, and the next chunk brings it along (predicted_n then rises by more than one). A pass's tokens all stream
before the next pass runs, and its drafts are counted before its first token streams. So a chunk is placed exactly
when its tokens leave one reading only:
- predicted_ms unchanged: the tokens are the current pass's next ones;
- predicted_ms changed: first the rest of the current pass (its accepted drafts + 1 token, all but those already
  seen), then new passes: without new drafts each commits one token (a plain step); with new drafts, one token of
  one new pass, whose drafted / accepted counts are the counters' increase.
Each token's kind follows from its place: the first `accepted` tokens of a pass are accepted drafts, the next is the
target's own (bonus when every draft was kept, recovered otherwise), a pass without drafts gives a baseline token.
A chunk that brings two or more tokens of new passes with drafts (a multi-byte character across passes) has several
readings: its tokens are `pending`, never guessed, and the count of the current pass is lost until a chunk of a
single token opens a new pass, which places it again. Rejected drafts are counted, never streamed: their text is not
known.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.events import TokenKind
from engine.serving.http_safety import number

Placement = tuple[TokenKind, int, int] | None  # (kind, step, position in the step), None: pending


@dataclass
class Pass:
    step: int
    drafted: int
    accepted: int
    emitted: int = 0  # tokens of this pass streamed so far
    ms: float | None = None  # llama.cpp's predicted_ms when the pass committed its tokens
    time_s: float = 0.0  # when its last token arrived, seconds since the run started

    @property
    def left(self) -> int:
        return self.accepted + 1 - self.emitted

    def kind(self, position: int) -> TokenKind:
        if self.drafted == 0:
            return TokenKind.BASELINE
        if position < self.accepted:
            return TokenKind.ACCEPTED
        return TokenKind.BONUS if self.accepted == self.drafted else TokenKind.RECOVERED


class StepTracker:
    """Feed each chunk's timings in stream order; get the placement of the chunk's new tokens."""

    def __init__(self, speculative: bool):
        self.speculative = speculative
        self.n = 0  # tokens so far
        self.drafted = self.accepted = 0  # the server's running counts
        self.ms: float | None = None
        # step 0 reads the prompt and commits one token; the baseline's passes are one token each
        self.passes = [Pass(0, 0, 0)] if speculative else []
        self.in_sync = True  # the current pass, and how many of its tokens streamed, are known
        self.pending = 0  # tokens streamed as pending
        self.why: str | None = None  # why some are
        self.counted = True  # every chunk had the counts (a server without timings_per_token has none)

    def feed(self, timings: dict | None, ids: int, now: float, warned: set | None = None) -> list[Placement]:
        """Placements of the tokens a chunk adds. `ids`: how many token ids it brought (the count where the server
        sent no timings)."""
        t = timings or {}
        n = number(t.get("predicted_n"), "predicted_n", integer=True, warned=warned)
        if n is None:
            self.counted = False
            n = self.n + ids
        drafted = number(t.get("draft_n", 0), "draft_n", integer=True, warned=warned)
        accepted = number(t.get("draft_n_accepted", 0), "draft_n_accepted", integer=True, warned=warned)
        ms = number(t.get("predicted_ms"), "predicted_ms", warned=warned)
        added = n - self.n
        broken = added < 0 or drafted is None or accepted is None or drafted < self.drafted \
            or accepted < self.accepted or accepted - self.accepted > drafted - self.drafted
        d, a = (drafted or 0) - self.drafted, (accepted or 0) - self.accepted
        new_pass = ms is None or self.ms is None or ms != self.ms
        self.n = max(n, self.n)
        self.drafted, self.accepted = max(drafted or 0, self.drafted), max(accepted or 0, self.accepted)
        self.ms = ms if ms is not None else self.ms
        if broken:
            self.counted = False
            return self._lose(max(added, ids, 0), "the server's counts went backwards or did not add up")
        if added == 0:
            return []
        if not self.speculative:
            out = []
            for _ in range(added):
                self.passes.append(Pass(len(self.passes), 0, 0, 1, ms, now))
                out.append((TokenKind.BASELINE, len(self.passes) - 1, 0))
            return out
        if not self.in_sync:
            if new_pass and added == 1:  # the first token of a new pass: placed again
                self.in_sync = True
                return self._open(d, a, 1, ms, now)
            return self._lose(added, None)
        current = self.passes[-1]
        if not new_pass:
            if d or a or added > current.left:
                return self._lose(added, "a pass streamed more tokens than its counts allow")
            return self._take(current, added, now)
        rest = current.left
        out = self._take(current, min(rest, added), now)
        more = added - min(rest, added)
        if more == 0:
            if d or a:
                return out + self._lose(0, "new drafts were counted without a token of theirs")
            return out
        if d == 0:
            for _ in range(more):
                out += self._open(0, 0, 1, ms, now)
            return out
        if more == 1:
            return out + self._open(d, a, 1, ms, now)
        return out + self._lose(more, "a multi-byte character streamed across target passes")

    def _take(self, p: Pass, count: int, now: float) -> list[Placement]:
        out = [(p.kind(i), p.step, i) for i in range(p.emitted, p.emitted + count)]
        p.emitted += count
        p.time_s = now if count else p.time_s
        return out

    def _open(self, drafted: int, accepted: int, count: int, ms: float | None, now: float) -> list[Placement]:
        self.passes.append(Pass(len(self.passes), drafted, accepted, 0, ms))
        return self._take(self.passes[-1], count, now)

    def _lose(self, count: int, why: str | None) -> list[Placement]:
        self.in_sync = False
        self.pending += count
        self.why = self.why or why
        if count:  # a pass of unknown size stands for what could not be placed: new passes get numbers after it
            self.passes.append(Pass(len(self.passes), 0, 0, count))
        return [None] * count

    @property
    def exact(self) -> bool:
        """Every token was placed (and so every pass is known)."""
        return self.pending == 0 and self.counted
