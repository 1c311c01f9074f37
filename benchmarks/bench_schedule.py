"""generate() + simulate() of large schedules: pp=64, microbatches=256, chunks=2.

Usage: python benchmarks/bench_schedule.py [--repeat N] [--styles interleaved,zbv]
"""

from __future__ import annotations

import argparse
import statistics
import time

from ppdsl.lowering.schedules import generate
from ppdsl.lowering.simulate import simulate

PP, MICROBATCHES, CHUNKS = 64, 256, 2


def bench(style: str, repeat: int) -> None:
    gen_times, sim_times = [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        schedule = generate(style, PP, MICROBATCHES, CHUNKS)
        t1 = time.perf_counter()
        sim = simulate(schedule)
        t2 = time.perf_counter()
        assert sim.ok, sim.problems[:3]
        gen_times.append(t1 - t0)
        sim_times.append(t2 - t1)
    total = [g + s for g, s in zip(gen_times, sim_times)]
    actions = sum(len(a) for a in schedule.ranks)
    print(
        f"{style:12s} pp={PP} m={MICROBATCHES} v={CHUNKS}: generate+simulate median "
        f"{statistics.median(total):.3f} s (generate {statistics.median(gen_times):.3f} s, "
        f"simulate {statistics.median(sim_times):.3f} s, min total {min(total):.3f} s), "
        f"{actions} actions, bubble {sim.bubble:.4f}, peak {max(sim.peak_activations)}"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--styles", default="interleaved,zbv")
    args = ap.parse_args()
    for style in args.styles.split(","):
        bench(style, args.repeat)


if __name__ == "__main__":
    main()
