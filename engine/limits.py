"""The most that one request may ask for, in one table. The page, `launch.py suite` / `demo` and the Workbench check
every value a user can type against it before anything runs (and before the engines' lock is taken), so that one
typed number cannot exhaust the machine (2 cores, 24 GiB) or hold the engines for days. Each limit lies far above
what a measurement needs; the reason is beside it."""

from __future__ import annotations


class SettingsError(ValueError):
    """An impossible setting; the message says which and what is allowed."""


MAX_K = 32  # drafts per step: acceptance that deep is nil, and each draft token costs a draft pass
DYNAMIC_K_MAX = 16  # dynamic K's ceiling unless K itself is higher
MAX_NEW_TOKENS = 4096  # new tokens per run: a long answer; each is a target pass, so a CPU run stays under an hour
MAX_TEMPERATURE = 5.0  # beyond it sampling is near-uniform noise: nothing left to measure
MAX_CONCURRENCY = 64  # parallel requests in one burst: a CPU server saturates at a few, a GPU one well before 64
MAX_SWEEP_VALUES = 12  # points of one sweep: a chart stays readable, and each value multiplies the suite's runs
MAX_REPEATS = 20  # runs per prompt: the noise estimate settles after a handful; each repeat doubles the work
MAX_PROMPTS_PER_SUITE = 500  # above HumanEval's 164 and MT-Bench's 118; every prompt is checked before the suite
MAX_UPLOAD_BYTES = 5 * 1024 * 1024  # a suite file is read whole into memory: 500 prompts of 10 kB fit
MAX_QUEUED_RUNS = 8  # Run tab: runs waiting behind the current one, each holding a worker thread of the page


def check_range(what: str, value, low, high, advice: str = "") -> None:
    """SettingsError unless low <= value <= high; the message names the value, the limits and what to do."""
    if not low <= value <= high:
        raise SettingsError(f"{what} must be between {low} and {high}, got {value}" + (f": {advice}" if advice else ""))


def number(what: str, value: str, kind=int):
    """A typed value as an int (or float); SettingsError naming it if it is not one."""
    try:
        return kind(str(value).strip())
    except ValueError:
        noun = "a whole number" if kind is int else "a number"
        raise SettingsError(f"{what} must be {noun}, got {value!r}") from None


def check_upload(name: str, size: int) -> None:
    """A suite file's size in bytes, before it is read."""
    if size > MAX_UPLOAD_BYTES:
        mb = 1024 * 1024
        raise SettingsError(f"{name} is {size / mb:.1f} MB, over the limit of {MAX_UPLOAD_BYTES / mb:.1f} MB for a "
                            f"suite file: split it, or keep at most {MAX_PROMPTS_PER_SUITE} prompts in it")
