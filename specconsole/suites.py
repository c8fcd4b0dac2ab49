"""Prompt suites per category: assets/prompts/<category>.jsonl, or a user's own JSONL / CSV file.

A JSONL line: {"prompt": "...", "category": "...", "temperature": 0.7, "earlier_turns": [["user", "..."], ...]};
only "prompt" is required. A CSV needs a `prompt` column; `category` and `temperature` are optional.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

PROMPTS_DIR = Path(__file__).resolve().parent.parent / "assets" / "prompts"


@dataclass(frozen=True)
class SuitePrompt:
    category: str
    prompt: str
    temperature: float = 0.0
    earlier_turns: tuple[tuple[str, str], ...] = ()


def categories() -> list[str]:
    return sorted(p.stem for p in PROMPTS_DIR.glob("*.jsonl"))


def _item(row: dict, category: str) -> SuitePrompt:
    prompt = row.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(f"every suite entry needs a non-empty 'prompt'; got {row!r:.120}")
    temperature = row.get("temperature")
    turns = tuple((str(r), str(c)) for r, c in row.get("earlier_turns") or ())
    own = row.get("category")  # a CSV's empty cell reads as NaN
    return SuitePrompt(own if isinstance(own, str) and own.strip() else category, prompt,
                       0.0 if temperature is None or pd.isna(temperature) else float(temperature), turns)


def load_suite(category: str) -> list[SuitePrompt]:
    path = PROMPTS_DIR / f"{category}.jsonl"
    if not path.exists():
        raise ValueError(f"no prompt suite {category!r}; suites: {', '.join(categories())}")
    return load_file(path, category)


def load_file(path: str | Path, category: str | None = None) -> list[SuitePrompt]:
    """A user's suite: JSONL or CSV. Entries without a category get the file's name as their category."""
    path = Path(path)
    category = category or path.stem
    if path.suffix.lower() == ".csv":
        rows = pd.read_csv(path).to_dict("records")
    else:
        try:
            rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        except json.JSONDecodeError as e:
            raise ValueError(f"{path.name} is not valid JSONL: {e}") from e
    if not rows:
        raise ValueError(f"{path.name} holds no prompts")
    return [_item(row, category) for row in rows]
