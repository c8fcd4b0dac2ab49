"""How many tokens to draft next (K), and whether speculating pays at all. The maths: docs/policy.md.

Dynamic K picks, before each step, the K that maximises the expected tokens per millisecond of Leviathan et al.'s
model with this machine's measured costs:

    goodput(K) = E(alpha, K) / (c*K + v(K)),   E = (1 - alpha^(K+1)) / (1 - alpha)

alpha is the per-token acceptance probability over the last few steps, c the cost of one draft token and v(K) the
cost of verifying K+1 tokens, both in units of one plain target step.

Per-token stopping (`per_token`, for a draft model, which knows how sure it is of each token): the draft keeps going
while one more token is expected to raise tokens per millisecond; K (= k_max) is only the ceiling. It looks only at
the draft's own state and at measured costs, so the rejection sampler stays exact. verify(m), one target pass over
m tokens, is measured per m, not assumed linear; an m not seen yet is extrapolated from the longest shorter pass.

Fallback: when the last few speculative steps deliver fewer tokens per second than plain decoding, speculation is off
for `cooldown` plain steps, twice as many after each fallback in a row (a prompt where speculation cannot pay, such as
prose with a draft that costs 0.4 target steps a token, then spends ever less of its run finding that out again).
Draft-length cap: the next draft is limited to twice the furthest any of the last few drafts got before its first
rejection (SpecPolicy.draft_cap). Every decision is returned as a PolicyEvent.

Costs: with a calibration (engine.exact.calibration: the passes' costs measured once per machine and model, and
stored), every decision reads those costs and nothing timed during the run, so the same request drafts the same
plan whatever else the machine does meanwhile; only acceptance, which the tokens decide, moves it. Without one (a
policy built alone, as in its unit tests) the costs are learned from the run's own steps.

PolicyConfig is what the user asked for (frozen); SpecPolicy holds one run's state: the current K, the costs, the
recent steps and the cooldown counter.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

from engine.drafting import Drafting
from engine.events import PolicyAction, PolicyEvent, StepRecord
from engine.metrics import acceptance_alpha, expected_tokens_per_pass
from engine.limits import DYNAMIC_K_MAX, MAX_K, SettingsError
from engine.methods import needs_draft


def _ema(old: float | None, new: float, weight: float = 0.3) -> float:
    return new if old is None else (1 - weight) * old + weight * new


@dataclass(frozen=True)
class PolicyConfig:
    """What the user asked for; fixed for the run (the running state is SpecPolicy's)."""

    k: int = 4  # the fixed K, or the first K of a dynamic run
    dynamic: bool = False
    k_min: int = 1
    k_max: int = DYNAMIC_K_MAX
    per_token: bool = True  # with dynamic K, a draft model stops by DraftStop; K is then k_max, the ceiling
    fallback: bool = False
    window: int = 8  # speculative steps that the acceptance estimate looks at
    fallback_window: int = 4  # speculative steps the fallback judges speculation by (at most `window`)
    cooldown: int = 16  # plain steps before speculation is tried again; doubled after each fallback in a row
    max_cooldown: int = 256
    cap_steps: int = 4  # dynamic K: the draft-length cap looks this many speculative steps back (0: no cap)
    verify_curve: bool = True  # DraftStop reads verify(m) measured per m (False: linear in m)

    @classmethod
    def of(cls, drafting: Drafting) -> "PolicyConfig":
        """The policy a request's drafting asks for."""
        d = drafting
        k_max = max(d.k_max, d.k) if d.dynamic_k else d.k
        return cls(k=d.k, dynamic=d.dynamic_k, k_max=k_max, fallback=d.fallback,
                   per_token=d.per_token and needs_draft(d.method), verify_curve=d.verify_curve)

    def validate(self) -> None:
        if not 1 <= self.k_min <= self.k_max <= MAX_K:
            raise SettingsError(f"K bounds need 1 <= k_min <= k_max <= {MAX_K}, got {self.k_min}..{self.k_max}")
        if not self.k_min <= self.k <= self.k_max:
            raise SettingsError(f"K must be between {self.k_min} and {self.k_max}, got {self.k}")
        if not 1 <= self.fallback_window <= self.window:
            raise SettingsError(f"the fallback's window needs 1 <= steps <= {self.window}, got {self.fallback_window}")
        if self.cap_steps < 0:
            raise SettingsError(f"the draft-length cap needs cap_steps >= 0 (0 = off), got {self.cap_steps}")


@dataclass(frozen=True)
class Costs:
    """What the passes cost on this machine, measured once (engine.exact.calibration): the policy's cost model."""

    target_step_ms: float  # one plain decoding step: a target pass over one token
    verify_ms: dict[int, float]  # a target pass over m tokens (m = drafts + 1) -> ms, for m = 1 .. the longest
    draft_ms_per_token: float | None  # one draft-model token (None: no draft model)

    @property
    def verify_ms_per_token(self) -> float:
        """What each token more costs a pass, on average over the curve (beta * target_step_ms)."""
        longest = max(self.verify_ms)
        return max(0.0, self.verify_ms[longest] - self.target_step_ms) / max(longest - 1, 1)


class SpecPolicy:
    """One run's policy: its PolicyConfig, its costs and what the run has decided so far."""

    def __init__(self, config: PolicyConfig, target_step_ms: float | None = None,
                 verify_ms: dict[int, float] | None = None, costs: Costs | None = None):
        self.config = config
        self.current_k = config.k
        self.fixed = costs is not None  # a calibration's costs: never changed by what the run times
        self.target_step_ms = costs.target_step_ms if costs else target_step_ms  # one plain decoding step
        self.draft_ms_per_token: float | None = costs.draft_ms_per_token if costs else None
        self.verify_ms_per_token: float | None = costs.verify_ms_per_token if costs else None  # beta * step
        # one target pass over m tokens (m = drafts + 1) -> ms
        self.verify_ms = dict(costs.verify_ms) if costs else {} if verify_ms is None else verify_ms
        self.recent: deque[StepRecord] = deque(maxlen=config.window)  # the last speculative steps
        self.plain_left = 0  # plain steps left before speculation resumes
        self.cooldown = config.cooldown  # the next fallback's plain steps: doubled by each fallback in a row
        self.rested = 0  # the last fallback's plain steps
        self.seen_first = False

    def next_k(self) -> int:
        """K for the next step; 0 means a plain decoding step."""
        cfg = self.config
        if self.plain_left:
            return 0
        if (cfg.dynamic or cfg.fallback) and self.target_step_ms is None:
            return 0  # measure one plain step first: both decisions compare against it
        return min(self.current_k, self.draft_cap()) if cfg.dynamic else self.current_k

    def draft_cap(self) -> int:
        """The longest draft worth proposing now: twice as far as the furthest of the last `cap_steps` drafts got
        (its accepted tokens + 1). A draft that is sure of itself but wrong (a benchmark saw 14 tokens drafted and
        none accepted under per-token stopping) then wastes at most a few tokens; full acceptances double the cap
        back towards k_max. It reads only finished steps, so the target's verification keeps the output exact."""
        cfg = self.config
        recent = list(self.recent)[-cfg.cap_steps:] if cfg.cap_steps else []
        if not recent:
            return cfg.k_max
        reach = max(s.accepted for s in recent) + 1
        return max(cfg.k_min, min(cfg.k_max, 2 * reach))

    @property
    def stops_per_token(self) -> bool:
        """The per-token rule is in charge once the costs it needs are measured."""
        cfg = self.config
        return bool(cfg.per_token and cfg.dynamic and self.draft_ms_per_token and self.target_step_ms)

    def draft_stop(self) -> "DraftStop | None":
        """A fresh per-token stopping rule for the next step (None while K decides)."""
        if not self.stops_per_token:
            return None
        return DraftStop(acceptance_alpha(self.recent), self.draft_ms_per_token, self.verify_cost)

    def verify_cost(self, m: int) -> float:
        """ms of one target pass over m tokens: measured for this m; else beta per token more than the longest
        shorter pass measured, or (with verify_curve off, or none measured) than one plain step. Anchoring at the
        nearest measurement lets the rule try a length it has not seen where the curve dips (m = 4-6 here)."""
        beta = self.verify_ms_per_token or 0.0
        if self.config.verify_curve:
            if m in self.verify_ms:
                return self.verify_ms[m]
            shorter = [n for n in self.verify_ms if n < m]
            if shorter:
                n = max(shorter)
                return self.verify_ms[n] + beta * (m - n)
        return self.target_step_ms + beta * (m - 1)

    def goodput(self, k: int, alpha: float) -> float:
        """Expected tokens per plain-step time at draft length k (1.0 = plain decoding)."""
        c = self.draft_ms_per_token / self.target_step_ms
        v = 1 + self.verify_ms_per_token * k / self.target_step_ms
        return expected_tokens_per_pass(alpha, k) / (c * k + v)

    def observe(self, step: StepRecord) -> list[PolicyEvent]:
        """Learn from one finished step; returns the decisions it led to."""
        if step.step == 0 and step.drafted == 0:
            return []  # the prefill alone: not what a decoding step costs
        if step.drafted == 0:
            return self._observe_plain(step)
        cfg = self.config
        self.recent.append(step)
        if not self.seen_first:  # the first draft pass also prefilled the prompt (step 0: the target's too)
            self.seen_first = True
            return []
        if not self.fixed:
            self.draft_ms_per_token = _ema(self.draft_ms_per_token, step.draft_ms / step.drafted)
            self.verify_ms[step.drafted + 1] = _ema(self.verify_ms.get(step.drafted + 1), step.verify_ms)
        decisions = []
        if self.target_step_ms:
            if not self.fixed:
                extra = max(0.0, step.verify_ms - self.target_step_ms) / step.drafted
                self.verify_ms_per_token = _ema(self.verify_ms_per_token, extra)
            if cfg.dynamic and not cfg.per_token:
                decisions += self._choose_k(step)
            elif self.stops_per_token and self.current_k != cfg.k_max:
                self.current_k = cfg.k_max
                c = self.draft_ms_per_token / self.target_step_ms
                why = f"a draft token costs {c:.2f} target steps; the draft stops when one more token would not pay"
                decisions.append(_event(step, PolicyAction.K_CHANGE, self.current_k,
                                        f"per-token stop from now on, K at most {self.current_k}: {why}"))
            if cfg.fallback:
                decisions += self._check_fallback(step)
        return decisions

    def _observe_plain(self, step: StepRecord) -> list[PolicyEvent]:
        if not self.fixed:
            self.target_step_ms = _ema(self.target_step_ms, step.verify_ms)
        if self.plain_left:
            self.plain_left -= 1
            if self.plain_left == 0:
                why = f"trying speculation again after {self.rested} plain steps"
                return [_event(step, PolicyAction.RESUME, self.current_k, why)]
        return []

    def step_ms(self, step: StepRecord) -> float:
        """What `step` cost: as timed, or, with a calibration's costs, as those costs say it costs (a draft model's
        tokens at its per-token cost, n-gram drafts free, the pass from the verify curve)."""
        if not self.fixed:
            return step.draft_ms + step.verify_ms
        drafting = step.drafted * (self.draft_ms_per_token or 0.0) if step.drafter == "draft" else 0.0
        return drafting + self.verify_cost(step.drafted + 1)

    def _choose_k(self, step: StepRecord) -> list[PolicyEvent]:
        alpha = acceptance_alpha(self.recent)
        best = max(range(self.config.k_min, self.config.k_max + 1), key=lambda k: self.goodput(k, alpha))
        if best == self.current_k:
            return []
        old, self.current_k = self.current_k, best
        why = f"acceptance {alpha:.2f}, expected {self.goodput(best, alpha):.2f}x plain decoding"
        return [_event(step, PolicyAction.K_CHANGE, best, f"K {old} -> {best}: {why}")]

    def _check_fallback(self, step: StepRecord) -> list[PolicyEvent]:
        n = self.config.fallback_window
        if len(self.recent) < n:
            return []
        steps = [s for s in list(self.recent)[-n:] if s.step > 0]  # step 0's passes also read the prompt
        tokens = sum(s.emitted for s in steps)
        ms = sum(self.step_ms(s) for s in steps)
        spec_rate, plain_rate = 1000 * tokens / ms, 1000 / self.target_step_ms
        if spec_rate >= plain_rate:
            self.cooldown = self.config.cooldown  # it paid: a later fallback starts short again
            return []
        self.plain_left = self.rested = self.cooldown
        self.cooldown = min(2 * self.cooldown, self.config.max_cooldown)
        self.recent.clear()
        reason = (
            f"speculation gave {spec_rate:.1f} tok/s over the last {n} steps, plain decoding {plain_rate:.1f} tok/s: "
            f"{self.plain_left} plain steps"
        )
        return [_event(step, PolicyAction.FALLBACK, 0, reason)]


def _event(step: StepRecord, action: PolicyAction, k: int, reason: str) -> PolicyEvent:
    """A decision taken after `step`, stamped with its step and time."""
    return PolicyEvent(step.step, action, k, reason, step.time_s)


class DraftStop:
    """One step's per-token stopping rule (see the module docstring): `more(a)` after each draft token."""

    def __init__(self, alpha: float, draft_ms: float, verify_ms: Callable[[int], float]):
        self.alpha = alpha  # acceptance of a token not drafted yet: the recent per-token rate
        self.draft_ms = draft_ms  # drafting one more token
        self.verify_ms = verify_ms  # m -> one target pass over m tokens (m = drafts + 1)
        self.drafted = 0
        self.survive = 1.0  # probability that every draft so far is accepted
        self.tokens = 1.0  # expected tokens committed if drafting stops now (the target's own token included)

    def cost(self, n: int) -> float:
        """Expected ms of the step with n drafts."""
        return n * self.draft_ms + self.verify_ms(n + 1)

    def more(self, confidence: float) -> bool:
        """Account for a draft token the draft gave `confidence`; True if drafting another one pays. A confidence of
        0 (a token below the draft's confidence floor) adds nothing: one more draft then pays only if it makes the
        step cheaper, where a longer pass verifies faster."""
        self.drafted += 1
        self.survive *= confidence
        self.tokens += self.survive
        gain = self.survive * self.alpha
        n = self.drafted
        return (self.tokens + gain) / self.cost(n + 1) > self.tokens / self.cost(n)
