"""The speculative policy's cost model, measured once per machine and model pair and stored.

The policy (engine.exact.policy) decides how far to draft from three costs: a plain target step, a target pass over
m tokens for each m, and a draft token. Learned from the run's own timings, they made the plan depend on whatever
else the machine did meanwhile (the page's drawing shifted a pass by a few per cent, and with it the plan). Measured
once here, in a quiet moment, and stored, they make the same request draft the same plan in the page, in the
terminal and in a benchmark; "measure again" refreshes them.

The store is a JSON file per key under the cache (engine.loading.weights.cache_dir), the key naming what the costs
depend on: the CPU (model and instruction sets), torch's version and threads, the passes' code, the device,
and the two models as loaded (their names carry the target's precision). Costs measured while other processes took
the CPU are kept for that start only, not stored: one measured beside a test suite once put a draft token at 388 ms
instead of 25, and every later start drafted by it. The first passes after a load run slower, so each model runs a
few untimed passes first, and the curve is padded (a shorter pass never costs more than a longer one): a plain step
measured dearer than it is makes a draft token look cheap, and the policy drafts where plain decoding is faster
(docs/policy.md).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
import time
from pathlib import Path

import torch

from engine.exact.forward import forward, new_cache, rollback
from engine.exact.policy import Costs, PolicyConfig
from engine.cache import cache_dir
from engine.cpu import cpu

log = logging.getLogger(__name__)

CONTEXT = 128  # tokens in the cache while passes are timed: a typical prompt's length
REPEATS = 5  # timed passes per length, after one that warms up; the median is kept
WARM_UP = 3  # untimed passes of each model before any is timed: the first passes after a load run slower
# what the stored costs were measured by: a file from another method is measured again
METHOD = "warmed, padded curve"
OTHERS_MAX = 0.2  # cores other processes may take while the costs are measured, for them to be stored


def machine() -> dict:
    """What the costs depend on besides the models."""
    here = cpu()
    return {"cpu": here.model, "flags": hashlib.sha1(here.flags.encode()).hexdigest()[:12], "torch": torch.__version__,
            "threads": torch.get_num_threads(), "code": code_key()}


# the code that shapes what a pass costs: a change to any of them (a faster kernel, a leaner forward) changes it
COSTED = ("grouped_int8.cpp", "decoder_layer.cpp", "decoder.py", "forward.py", "kv_cache.py", "optimize.py")


def code_key() -> str:
    here = Path(__file__).parent
    return hashlib.sha1(b"".join((here / name).read_bytes() for name in COSTED)).hexdigest()[:12]


def key(models: dict) -> str:
    return hashlib.sha1(json.dumps(machine() | models | {"method": METHOD}, sort_keys=True).encode()).hexdigest()[:16]


def _median_ms(run, repeats: int, device: torch.device) -> float:
    """The median ms of `repeats` calls of run() after one that warms up (on a GPU: until its work is done)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    for _ in range(repeats + 1):
        t = time.perf_counter()
        run()
        sync()
        times.append(1000 * (time.perf_counter() - t))
    return statistics.median(times[1:])


@torch.inference_mode()
def _pass_ms(model, rows: int, repeats: int) -> float:
    """ms of one pass over `rows` tokens after CONTEXT cached ones."""
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    context = torch.randint(0, vocab, (CONTEXT,), generator=g).tolist()
    extra = torch.randint(0, vocab, (rows,), generator=g).tolist()
    cache = new_cache(model)
    forward(model, context, cache, keep=1)

    def one():
        forward(model, extra, cache, keep=rows)
        rollback(cache, CONTEXT)

    return _median_ms(one, repeats, model.device)


def measure(target, draft=None, k_max: int = PolicyConfig.k_max, repeats: int = REPEATS) -> Costs:
    """Time the target's passes over 1 .. k_max + 1 tokens and a draft token (`target`, `draft`: nn.Modules). A
    run with K above the default ceiling reads longer passes off the curve's mean slope (Costs.verify_ms_per_token)."""
    t = time.perf_counter()
    for model in (target, draft):
        if model is not None:
            _pass_ms(model, 1, WARM_UP - 1)  # WARM_UP passes in all: _median_ms runs one more than it times
    curve = padded({m: _pass_ms(target, m, repeats) for m in range(1, k_max + 2)})
    draft_ms = _pass_ms(draft, 1, repeats) if draft is not None else None
    log.info("calibrated the policy's costs in %.1f s: plain step %.1f ms, pass over %d tokens %.1f ms, draft token "
             "%s ms", time.perf_counter() - t, curve[1], k_max + 1, curve[k_max + 1],
             f"{draft_ms:.1f}" if draft_ms is not None else "-")
    return Costs(curve[1], curve, draft_ms)


def padded(curve: dict[int, float]) -> dict[int, float]:
    """A pass over m tokens costs at most what a pass over more costs (it could be padded to that many rows): a
    shorter pass measured dearer was disturbed, and would make the policy draft where plain decoding is faster."""
    out, cheapest = {}, float("inf")
    for m in sorted(curve, reverse=True):
        cheapest = out[m] = min(cheapest, curve[m])
    return dict(sorted(out.items()))


def as_dict(costs: Costs, about: dict) -> dict:
    return {**about, "target_step_ms": costs.target_step_ms,
            "verify_ms": {str(m): v for m, v in costs.verify_ms.items()}, "draft_ms_per_token": costs.draft_ms_per_token}


def from_dict(d: dict) -> Costs:
    return Costs(float(d["target_step_ms"]), {int(m): float(v) for m, v in d["verify_ms"].items()},
                 None if d.get("draft_ms_per_token") is None else float(d["draft_ms_per_token"]))


def stored(models: dict, target, draft, refresh: bool = False) -> tuple[Costs, dict]:
    """The stored costs for `models` (a description: names, device), measured and stored first where there are none
    (or with `refresh`). Returns the costs and what the page shows of them (when, where, the file)."""
    path = cache_dir() / "calibration" / f"{key(models)}.json"
    if not refresh:
        try:
            d = json.loads(path.read_text())
            # the costs as numbers (from_dict); of the rest only the date, as text: the file's key already names
            # this machine and these models
            about = {"measured_at": str(d.get("measured_at", "?"))[:40], "machine": machine(), "models": models,
                     "file": str(path)}
            return from_dict(d), about
        except (OSError, ValueError, KeyError, TypeError):
            pass  # none yet, or unreadable: measured again below
    busy, own, wall = _cpu_seconds()
    costs = measure(target, draft)
    others = _others_cores(busy, own, wall)
    d = as_dict(costs, {"measured_at": time.strftime("%Y-%m-%d %H:%M"), "machine": machine(), "models": models,
                        "file": str(path)})
    if others > OTHERS_MAX:
        log.warning("other processes took %.2f cores while the policy's costs were measured: they hold for this "
                    "start only, and the next start measures them again", others)
        return costs, d | {"file": None, "others_cores": others}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")  # two engine processes may store the same key at once
    tmp.write_text(json.dumps(d, indent=1))
    tmp.replace(path)  # a killed write leaves the old file or none, never half of one
    return costs, d


def _cpu_seconds() -> tuple[float, float, float]:
    """(CPU seconds the machine has been busy, of them this process's, a wall clock in seconds)."""
    import psutil

    t, own = psutil.cpu_times(), psutil.Process().cpu_times()
    busy = t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)
    return busy, own.user + own.system, time.monotonic()


def _others_cores(busy: float, own: float, wall: float) -> float:
    """Cores other processes took since _cpu_seconds() gave (busy, own, wall)."""
    busy_now, own_now, wall_now = _cpu_seconds()
    return max(0.0, (busy_now - busy) - (own_now - own)) / max(wall_now - wall, 1e-3)
