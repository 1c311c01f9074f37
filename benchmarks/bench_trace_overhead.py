"""What `ppdsl run --trace` costs on specs/tiny_cpu.ppspec (4 CPU processes, gloo, one thread each).

Two measures:

1. in-process: the recorder's own work per record (one clock read and one tuple appended, as
   the executor does per interval), times the records per rank and step of a real trace,
   over the median traced step time;
2. end to end: one run of the spec's Trainer on 4 processes that turns tracing on and off
   step by step (order swapped every other pair, a barrier around each step), so that the
   load of a shared machine hits both alike; a step's time is its slowest rank's. Reported:
   the medians and the median of the per-pair ratios traced / untraced.

    OMP_NUM_THREADS=1 python benchmarks/bench_trace_overhead.py [--steps 30] [--warmup 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from _spawn import run_ranks

SPEC = Path(__file__).resolve().parent.parent / "specs" / "tiny_cpu.ppspec"
WORLD = 4


def ns_per_record(n: int = 200_000) -> float:
    """One `now()` and one 5-tuple appended: what a traced interval adds."""
    now = time.perf_counter_ns
    best = float("inf")
    for _ in range(5):
        events: list[tuple[str, int, int, int, int]] = []
        t = now()
        for i in range(n):
            t0 = now()
            events.append(("F", 1, i, t0, t0))
        best = min(best, (now() - t) / n)
    return best


def _measure(rank: int, world: int, steps: int, warmup: int) -> tuple[list[float], list[float], float]:
    from ppdsl.dsl.check import check_file
    from ppdsl.lowering.lower import lower
    from ppdsl.runtime.parallel.groups import build_process_groups, tie_pp_ranks_of
    from ppdsl.runtime.train.trace import Recorder
    from ppdsl.runtime.train.trainer import Trainer

    result = check_file(SPEC, world=world)
    plan = lower(result.spec, world, result.model_info)
    groups = build_process_groups(plan.mesh, "cpu", tie_pp_ranks_of(plan.schedule.stage_ranks))
    trainer = Trainer(plan, groups, torch.device("cpu"))
    recorder = Recorder(rank, plan.mesh.coords(rank), torch.device("cpu"))
    plain: list[float] = []
    traced: list[float] = []
    for i in range(warmup + 2 * steps):
        on = (i + i // 2) % 2 == 1  # off, on, on, off, off, on, ...
        trainer.recorder = trainer.executor.recorder = recorder if on else None
        dist.barrier()
        start = time.perf_counter()
        if on:
            recorder.begin_step(i + 1)
        trainer.step(i)
        if on:
            recorder.end_step()
        dist.barrier()
        if i >= warmup:
            (traced if on else plain).append(time.perf_counter() - start)
    records = sum(len(s.events) for s in recorder.steps) / len(recorder.steps)
    return plain, traced, records


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30, help="steps of each kind")
    ap.add_argument("--warmup", type=int, default=4)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    per_record = ns_per_record()
    got = run_ranks(WORLD, _measure, (args.steps, args.warmup))
    if got is None:
        return 1
    plain = [max(xs) for xs in zip(*(got[r][0] for r in range(WORLD)))]
    traced = [max(xs) for xs in zip(*(got[r][1] for r in range(WORLD)))]
    records = max(got[r][2] for r in range(WORLD))
    step_ms = statistics.median(traced) * 1000
    cost_us = per_record * records * 2 / 1000  # x2: bounds the clock reads that open an interval
    print(f"recorder: {per_record:.0f} ns per record x {records:.0f} records per rank and step: <= {cost_us:.0f} us "
          f"per step = {100 * cost_us / 1000 / step_ms:.3f} % of the median traced step ({step_ms:.1f} ms)")
    p, t = statistics.median(plain), statistics.median(traced)
    paired = statistics.median(b / a for a, b in zip(plain, traced))
    print(f"end to end: median step {p * 1000:.1f} ms untraced, {t * 1000:.1f} ms traced; median of the paired "
          f"ratios traced / untraced {paired:.4f} ({len(plain)} pairs, alternated in one run)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
