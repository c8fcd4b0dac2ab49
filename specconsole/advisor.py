"""Is speculative decoding worth it for this workload? Verdicts per category from measured figures only.

The checklist: how predictable is the output (acceptance), does it pay end to end (measured speedup), is there
memory for a second model, how much of the time is prefill (which speculation cannot shorten), and up to which
concurrency it still pays. Every reason quotes the number it came from.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd

ENABLE_AT = 1.2  # measured median speedup from which we say "enable"
WORTH_AT = 1.05  # below this the gain is lost in noise and the extra model's cost
LOW_ACCEPTANCE = 0.4
PREFILL_HEAVY = 0.5
BETTER_BY = 1.1  # a sweep value must beat the default by 10 % to be recommended


@dataclass
class Advice:
    category: str
    verdict: str  # "enable" | "enable with these settings" | "don't"
    expected_speedup: float | None
    reasons: list[str] = field(default_factory=list)
    settings: dict = field(default_factory=dict)

    def details(self) -> str:
        """What follows "category: verdict" in a headline: the expected speedup and the settings."""
        out = "" if self.expected_speedup is None else f" (expected {self.expected_speedup:.2f}x)"
        if self.settings:
            out += " with " + ", ".join(f"{k} = {v}" for k, v in self.settings.items())
        return out

    def markdown(self) -> str:
        return f"**{self.category}: {self.verdict}**{self.details()}\n" + "\n".join(f"- {r}" for r in self.reasons)


def advise(aggregate: pd.DataFrame, sweep_variable: str | None = None, default_value: str = "",
           memory: dict | None = None, concurrency: pd.DataFrame | None = None) -> list[Advice]:
    """aggregate: workbench.aggregate rows; memory: {"needed_gb", "available_gb", "draft_gb"} for a draft model;
    concurrency: workbench.concurrency_sweep rows."""
    out = []
    for category, rows in aggregate.groupby("category", sort=True):
        rows = rows.dropna(subset=["speedup"])
        if rows.empty:
            continue
        base = rows[rows["sweep_value"] == default_value]
        base = (base if not base.empty else rows).iloc[0]
        best = rows.loc[rows["speedup"].idxmax()]
        speedup, acceptance = float(base["speedup"]), base["acceptance"]
        reasons, settings = [], {}
        label = f" at {sweep_variable} = {base['sweep_value']}" if sweep_variable and base["sweep_value"] else ""
        reasons.append(f"measured median speedup {speedup:.2f}x over {int(base['runs'])} runs{label} "
                       f"(spread {base['speedup_min']:.2f}x to {base['speedup_max']:.2f}x)")
        if acceptance is not None and acceptance == acceptance:
            reasons.append(f"acceptance {acceptance:.2f}, mean accepted length {base['mean_accepted_length']:.2f} "
                           "tokens per target pass")
        verdict = None
        if memory and memory["needed_gb"] > memory["available_gb"]:
            verdict = "don't"
            reasons.append(f"the draft needs {memory['draft_gb']:.1f} GB more; target and draft together need "
                           f"{memory['needed_gb']:.1f} GB but {memory['available_gb']:.1f} GB are available")
        elif memory and memory["draft_gb"]:
            reasons.append(f"memory: target {memory['needed_gb'] - memory['draft_gb']:.1f} GB + draft "
                           f"{memory['draft_gb']:.1f} GB fit in {memory['available_gb']:.1f} GB")
        elif memory:
            reasons.append("n-gram drafting needs no second model in memory")
        expected = speedup
        if verdict is None and sweep_variable and best["sweep_value"] != base["sweep_value"] \
                and best["speedup"] >= BETTER_BY * speedup and best["speedup"] >= WORTH_AT:
            verdict, expected = "enable with these settings", float(best["speedup"])
            settings[sweep_variable] = best["sweep_value"]
            reasons.append(f"{sweep_variable} = {best['sweep_value']} measured {best['speedup']:.2f}x against "
                           f"{speedup:.2f}x")
        low = acceptance is not None and acceptance == acceptance and acceptance < LOW_ACCEPTANCE
        if verdict is None:
            if speedup >= ENABLE_AT:
                verdict = "enable"
                if low:
                    reasons.append(f"acceptance {acceptance:.2f} is low, but the drafts cost little enough that the "
                                   "measured gain stands")
            elif speedup < WORTH_AT or low:
                verdict = "don't"
                if speedup < WORTH_AT:
                    reasons.append(f"{speedup:.2f}x is below the {WORTH_AT:.2f}x that pays for running a second model")
                if low:
                    reasons.append(f"acceptance {acceptance:.2f} is below {LOW_ACCEPTANCE}: the draft rarely "
                                   "predicts the target's output")
            else:
                verdict = "enable with these settings"
                settings["K"] = "small (2-3) or dynamic"
                reasons.append(f"{speedup:.2f}x is a modest gain (below {ENABLE_AT:.1f}x): keep drafts short so "
                               "that rejected drafts cost little")
        share = base.get("prefill_share")
        if share is not None and share == share and share > PREFILL_HEAVY:
            reasons.append(f"prefill takes {100 * share:.0f}% of the time, which speculation cannot shorten: the "
                           "end-to-end gain stays small")
        if concurrency is not None and not concurrency.empty:
            paying = concurrency[concurrency["speedup"] >= WORTH_AT]
            if paying.empty:
                reasons.append(f"at concurrency {int(concurrency['concurrency'].min())} already only "
                               f"{concurrency['speedup'].iloc[0]:.2f}x")
            else:
                top = paying.loc[paying["concurrency"].idxmax()]
                reasons.append(f"pays up to {int(top['concurrency'])} concurrent requests ({top['speedup']:.2f}x)")
                worse = concurrency[concurrency["concurrency"] > top["concurrency"]]
                if not worse.empty:
                    w = worse.iloc[0]
                    reasons.append(f"at {int(w['concurrency'])} concurrent requests it gives {w['speedup']:.2f}x")
        out.append(Advice(category, verdict, None if verdict == "don't" else expected, reasons, settings))
    return out
