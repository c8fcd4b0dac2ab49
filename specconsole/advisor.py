"""Is speculative decoding worth it for this workload? Verdicts per category from the measured interval only.

The verdict comes from the 95 % bootstrap interval of the category's median speedup over prompts (engine/analysis/stats.py):
- enable: the interval's lower bound is at least 1.05x;
- don't: its upper bound is below 1.00x (speculation is measurably slower);
- undecided: anything between, and always with fewer than 3 prompts. The advice then says how many prompts the
  spread seen between prompts needs for a decision, or that the measured gain lies in the 1.00-1.05x band, where
  more prompts will not decide it.
A sweep recommends another setting ("enable with these settings") only when that setting's interval lies wholly
above the default's and itself clears 1.05x; where every value swept is measurably slower, the advice stays "don't"
and names the value that loses least (the highest median speedup). Acceptance, memory, prefill share, concurrency,
the machine's noise and how often the greedy output stayed the baseline's explain the figure; they never override it.
Every reason quotes the number it came from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from statistics import median

import pandas as pd

from engine.analysis.stats import log_spread, prompts_needed
from specconsole.markup import md

ENABLE_AT = 1.05  # the interval's lower bound must clear this: a smaller gain is not worth a second engine path
SLOWER_BELOW = 1.0  # an upper bound below this: measurably slower than the baseline
MIN_PROMPTS = 3  # fewer prompts say nothing about a workload, whatever their interval
LOW_ACCEPTANCE = 0.4
PREFILL_HEAVY = 0.5
NOISY_CV = 0.10  # the baseline's tok/s varying more than this between repeats of one prompt: a busy machine
MODEL_FREE = ("ngram", "suffix")  # drafting methods that look drafts up instead of running a draft model


@dataclass
class Advice:
    category: str
    verdict: str  # "enable" | "enable with these settings" | "don't" | "undecided"
    expected_speedup: float | None  # only when the verdict enables
    reasons: list[str] = field(default_factory=list)
    settings: dict = field(default_factory=dict)
    interval: tuple[float, float, float] | None = None  # (median, low, high) of the speedup the verdict rests on
    least_loss: dict = field(default_factory=dict)  # every value swept loses: the one that loses least
    least_loss_speedup: float | None = None  # and its median speedup

    def details(self) -> str:
        """What follows "category: verdict" in a headline: the speedup with its interval, and the settings."""
        out = ""
        if self.interval is not None:
            point, low, high = self.interval
            word = "measured" if self.expected_speedup is None else "expected"
            out = f" ({word} {point:.2f}x, 95 % CI {low:.2f}x to {high:.2f}x)"
        if self.settings:
            out += " with " + ", ".join(f"{k} = {v}" for k, v in self.settings.items())
        if self.least_loss:
            out += "; loses least with " + ", ".join(f"{k} = {v}" for k, v in self.least_loss.items())
            out += f" ({self.least_loss_speedup:.2f}x)" if self.least_loss_speedup is not None else ""
        return out

    def markdown(self) -> str:
        """For the page: the category, settings and reasons quote suite files and the history, so they are text."""
        return (f"**{md(self.category)}: {md(self.verdict)}**{md(self.details())}\n"
                + "\n".join(f"- {md(r)}" for r in self.reasons))

    def text(self) -> str:
        """For the terminal: the same lines, plain."""
        return f"{self.category}: {self.verdict}{self.details()}\n" + "\n".join(f"- {r}" for r in self.reasons)


def _known(value) -> bool:
    return value is not None and value == value  # value == value drops NaN


def _interval(row) -> tuple[float, float, float]:
    return float(row["speedup"]), float(row["speedup_low"]), float(row["speedup_high"])


def _ci(row) -> str:
    return f"{row['speedup']:.2f}x (95 % CI {row['speedup_low']:.2f}x to {row['speedup_high']:.2f}x)"


def _against(value: float, threshold: float) -> str:
    """A bound, with a third decimal where two would print it equal to the threshold it is compared with."""
    return f"{value:.3f}x" if round(value, 2) == threshold else f"{value:.2f}x"


def _more_prompts(speedups: list[float], prompts: int) -> str:
    """How many prompts would decide it, at the spread seen so far."""
    if len(speedups) < 2:
        return f"{prompts} prompt shows no spread between prompts to size the suite from: run at least {MIN_PROMPTS}"
    needed = prompts_needed(speedups, ENABLE_AT, SLOWER_BELOW)
    if needed is None:
        return (f"the measured {median(speedups):.2f}x lies in the {SLOWER_BELOW:.2f}x-{ENABLE_AT:.2f}x "
                "band, where more prompts will not decide it: the gain, if any, is too small to act on")
    needed = max(needed, MIN_PROMPTS, prompts + 1)
    return (f"at the spread seen between prompts (standard deviation of the log speedup {log_spread(speedups):.2f}), "
            f"about {needed} prompts would decide it ({needed - prompts} more)")


def _verdict(row) -> tuple[str, list[str]]:
    """The verdict from the interval alone, and the reasons that quote it."""
    _, low, high = _interval(row)
    prompts = int(row["prompts"])
    speedups = list(row["prompt_speedups"])
    if prompts < MIN_PROMPTS:
        plural = "prompt" if prompts == 1 else "prompts"
        return "undecided", [f"{prompts} {plural} cannot decide for a workload, whatever the figure: a verdict needs "
                             f"at least {MIN_PROMPTS}", _more_prompts(speedups, prompts)]
    if low >= ENABLE_AT:
        return "enable", [f"the interval's lower bound {_against(low, ENABLE_AT)} clears {ENABLE_AT:.2f}x"]
    if high < SLOWER_BELOW:
        return "don't", [f"the interval's upper bound {_against(high, SLOWER_BELOW)} is below {SLOWER_BELOW:.2f}x: "
                         "speculation is measurably slower than the baseline here"]
    return "undecided", [f"the interval {low:.2f}x to {high:.2f}x neither clears {ENABLE_AT:.2f}x nor lies below "
                         f"{SLOWER_BELOW:.2f}x", _more_prompts(speedups, prompts)]


def _better_setting(rows: pd.DataFrame, base, sweep_variable: str) -> tuple[pd.Series | None, str | None]:
    """The sweep value whose interval lies wholly above the default's and clears ENABLE_AT (the highest such), or
    None with a sentence on the best-looking value when none does."""
    others = rows[rows["sweep_value"] != base["sweep_value"]]
    if others.empty:
        return None, None
    clear = others[(others["prompts"] >= MIN_PROMPTS) & (others["speedup_low"] > base["speedup_high"])
                   & (others["speedup_low"] >= ENABLE_AT)]
    if not clear.empty:
        return clear.loc[clear["speedup"].idxmax()], None
    best = others.loc[others["speedup"].idxmax()]
    if best["speedup"] <= base["speedup"]:
        return None, None
    return None, (f"{sweep_variable} = {best['sweep_value']} measured {_ci(best)}, but its interval does not lie "
                  f"clear above the default's {_ci(base)} (and clear of {ENABLE_AT:.2f}x): not a measured improvement")


def _least_loss(rows: pd.DataFrame, sweep_variable: str) -> tuple[pd.Series | None, str | None]:
    """Where every value swept is measurably slower (each on enough prompts): the one with the highest median
    speedup and a sentence naming it; (None, None) otherwise."""
    slower = rows[(rows["prompts"] >= MIN_PROMPTS) & (rows["speedup_high"] < SLOWER_BELOW)]
    if len(rows) < 2 or len(slower) < len(rows):
        return None, None
    best = rows.loc[rows["speedup"].idxmax()]
    return best, (f"every {sweep_variable} swept is measurably slower than the baseline ({len(rows)} values): "
                  f"{sweep_variable} = {best['sweep_value']} loses least: {_ci(best)}")


def _identity(row) -> list[str]:
    """How often the greedy output stayed the baseline's ("k/n" of the aggregate), and the backend's reason where
    it did not."""
    identical = row.get("identical")
    if not isinstance(identical, str) or "/" not in identical:
        return []
    same, runs = (int(part) for part in identical.split("/"))
    if not runs:
        return []
    note, margin = row.get("divergence_note"), row.get("divergence_margin")
    why = f"; {note}" if same < runs and isinstance(note, str) and note else ""
    if same < runs and isinstance(margin, float) and _known(margin):
        why += f"; where it parted, the plain pass's best token led its runner-up by {margin:.3g} logits (median)"
    return [f"greedy output identical to the baseline's in {same} of {runs} runs{why}"]


def _explanations(row, memory: dict | None, verdict: str) -> list[str]:
    """What explains the figure: drafts, memory, prefill and noise. Never a verdict."""
    out = []
    acceptance, length = row.get("acceptance"), row.get("mean_accepted_length")
    if _known(acceptance):
        tail = f", mean accepted length {length:.2f} tokens per target pass" if _known(length) else ""
        out.append(f"acceptance {acceptance:.2f}{tail}")
        if acceptance < LOW_ACCEPTANCE:
            out.append(f"acceptance {acceptance:.2f} is low, but the drafts cost little enough that the measured gain "
                       "stands" if verdict.startswith("enable") else
                       f"acceptance {acceptance:.2f} is below {LOW_ACCEPTANCE}: the drafter rarely predicts the "
                       "target's output, which keeps the gain small")
    method = row.get("method")
    if method in MODEL_FREE:
        weights = f" (the target's {memory['needed_gb'] - memory['draft_gb']:.1f} GB alone)" if memory else ""
        out.append(f"{method} drafting looks its drafts up in the text so far: no draft weights to hold or run{weights}")
    elif memory and memory.get("draft_gb"):
        target = memory["needed_gb"] - memory["draft_gb"]
        if memory["needed_gb"] > memory["available_gb"]:
            out.append(f"memory: target {target:.1f} GB + draft {memory['draft_gb']:.1f} GB = {memory['needed_gb']:.1f} "
                       f"GB exceed the {memory['available_gb']:.1f} GB available: the runs above include any swapping")
        else:
            out.append(f"memory: target {target:.1f} GB + draft {memory['draft_gb']:.1f} GB fit in "
                       f"{memory['available_gb']:.1f} GB")
    share = row.get("prefill_share")
    if _known(share) and share > PREFILL_HEAVY:
        out.append(f"prefill takes {100 * share:.0f}% of the time, which speculation cannot shorten: the end-to-end "
                   "gain stays small")
    noise = row.get("noise_cv")
    if not _known(noise):
        out.append(f"the machine's noise is unmeasured: {int(row['runs'])} runs over {int(row['prompts'])} prompts, "
                   "no prompt repeated (use 2 or more repeats)")
    elif noise > NOISY_CV:
        out.append(f"warning: the machine is noisy: the baseline's tokens/s varied by {100 * noise:.0f}% between "
                   f"repeats of the same prompt (above {100 * NOISY_CV:.0f}%): quiet the machine, or add prompts")
    else:
        out.append(f"the machine's noise: the baseline's tokens/s varied by {100 * noise:.1f}% between repeats of "
                   "the same prompt")
    return out


def _concurrency(concurrency: pd.DataFrame) -> list[str]:
    paying = concurrency[concurrency["speedup"] >= ENABLE_AT]
    if paying.empty:
        return [f"at concurrency {int(concurrency['concurrency'].min())} already only "
                f"{concurrency['speedup'].iloc[0]:.2f}x"]
    top = paying.loc[paying["concurrency"].idxmax()]
    out = [f"pays up to {int(top['concurrency'])} concurrent requests ({top['speedup']:.2f}x)"]
    worse = concurrency[concurrency["concurrency"] > top["concurrency"]]
    if not worse.empty:
        w = worse.iloc[0]
        out.append(f"at {int(w['concurrency'])} concurrent requests it gives {w['speedup']:.2f}x")
    return out


def advise(aggregate: pd.DataFrame, sweep_variable: str | None = None, default_value: str = "",
           memory: dict | None = None, concurrency: pd.DataFrame | None = None) -> list[Advice]:
    """aggregate: workbench.aggregate rows; memory: {"needed_gb", "available_gb", "draft_gb"} of the backend;
    concurrency: workbench.concurrency_sweep rows."""
    out = []
    for category, rows in aggregate.groupby("category", sort=True):
        rows = rows.dropna(subset=["speedup"])
        if rows.empty:
            continue
        base = rows[rows["sweep_value"] == default_value]
        base = (base if not base.empty else rows).iloc[0]
        label = f" at {sweep_variable} = {base['sweep_value']}" if sweep_variable and base["sweep_value"] else ""
        reasons = [f"median speedup {base['speedup']:.2f}x over {int(base['prompts'])} prompts "
                   f"({int(base['runs'])} runs){label}, 95 % CI {base['speedup_low']:.2f}x to "
                   f"{base['speedup_high']:.2f}x"]
        verdict, why = _verdict(base)
        reasons += why
        chosen, settings, least_loss = base, {}, {}
        if sweep_variable:
            better, note = _better_setting(rows, base, sweep_variable)
            least, loss = _least_loss(rows, sweep_variable)
            if least is not None and verdict == "don't":
                least_loss = {sweep_variable: least["sweep_value"]}
                reasons.append(loss)  # says more than the "not a measured improvement" note
            elif better is not None:
                verdict, chosen = "enable with these settings", better
                settings[sweep_variable] = better["sweep_value"]
                reasons.append(f"{sweep_variable} = {better['sweep_value']} measured {_ci(better)}, clear above the "
                               f"default's {_ci(base)}")
            elif note:
                reasons.append(note)
        reasons += _explanations(chosen, memory, verdict) + _identity(chosen)
        if concurrency is not None and not concurrency.empty:
            reasons += _concurrency(concurrency)
        expected = float(chosen["speedup"]) if verdict.startswith("enable") else None
        out.append(Advice(category, verdict, expected, reasons, settings, _interval(chosen), least_loss,
                          float(least["speedup"]) if least_loss else None))
    return out


def ab_conclusion(ratio: float, low: float, high: float, prompts: int) -> str:
    """One line on suite B against suite A from the ratio B/A of their speedups and its 95 % interval."""
    if prompts < MIN_PROMPTS:
        return (f"too few prompts to tell ({prompts}; at least {MIN_PROMPTS}): ratio {ratio:.2f} "
                f"({low:.2f} to {high:.2f})")
    if low > 1:
        return (f"B is faster than A by {100 * (ratio - 1):.0f} % "
                f"(95 % CI {100 * (low - 1):.0f} % to {100 * (high - 1):.0f} %)")
    if high < 1:
        return (f"B is slower than A by {100 * (1 - ratio):.0f} % "
                f"(95 % CI {100 * (1 - high):.0f} % to {100 * (1 - low):.0f} %)")
    return f"the suites cannot be told apart: ratio {ratio:.2f} ({low:.2f} to {high:.2f})"
