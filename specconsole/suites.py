"""Prompt suites per category, from assets/prompts/<category>.jsonl (one {"prompt", "temperature"} per line)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

PROMPTS_DIR = Path(__file__).resolve().parent.parent / "assets" / "prompts"


@dataclass(frozen=True)
class SuitePrompt:
    category: str
    prompt: str
    temperature: float = 0.0


def categories() -> list[str]:
    return sorted(p.stem for p in PROMPTS_DIR.glob("*.jsonl"))


def load_suite(category: str) -> list[SuitePrompt]:
    path = PROMPTS_DIR / f"{category}.jsonl"
    if not path.exists():
        raise ValueError(f"no prompt suite {category!r}; suites: {', '.join(categories())}")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [SuitePrompt(category, r["prompt"], float(r.get("temperature", 0.0))) for r in rows]
