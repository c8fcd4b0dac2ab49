"""Incremental detokenization and stop conditions, shared by both engines so that they stop at the same token."""

from __future__ import annotations

from dataclasses import dataclass, field


class Detokenizer:
    """Turns committed token ids into text pieces. A piece is "" while a multi-byte character is incomplete; the
    next piece then carries the whole character."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""
        self.incomplete = False  # the ids end inside a multi-byte character

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        self.incomplete = text.endswith("\ufffd")
        if self.incomplete:
            return ""
        piece = text[len(self.text) :]
        self.text = text
        return piece

    def fork(self) -> Detokenizer:
        """A copy that reads on from this text, for tokens that are not committed (a step's rejected drafts)."""
        other = Detokenizer(self.tokenizer)
        other.ids, other.text, other.incomplete = list(self.ids), self.text, self.incomplete
        return other


@dataclass
class StopConditions:
    max_new_tokens: int
    eos_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False

    def check(self, token_id: int, text: str, piece: str, n_out: int) -> str | None:
        """Called after each committed token: the finish reason, or None to go on."""
        if not self.ignore_eos and token_id in self.eos_ids:
            return "eos"
        if piece and self.stop_strings:
            window = text[-(max(map(len, self.stop_strings)) + len(piece)) :]
            if any(s in window for s in self.stop_strings):
                return "stop"
        if n_out >= self.max_new_tokens:
            return "length"
        return None


@dataclass
class Transcript:
    """What has been committed so far; `commit` applies the stop conditions token by token."""

    detok: Detokenizer
    stops: StopConditions
    ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None

    def commit(self, token_id: int) -> str:
        piece = self.detok.push(token_id)
        self.ids.append(token_id)
        self.finish_reason = self.stops.check(token_id, self.detok.text, piece, len(self.ids))
        return piece

    @property
    def remaining(self) -> int:
        return self.stops.max_new_tokens - len(self.ids)
