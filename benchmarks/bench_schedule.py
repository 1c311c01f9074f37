"""generate(), validate() and simulate() of large schedules: pp=64, microbatches=256, chunks=2.

``ppdsl check`` runs generate + validate; ``lower`` + reports run generate + simulate.
Styles with one chunk per rank (zbh1, 1f1b, gpipe) run with chunks=1.

Usage: python benchmarks/bench_schedule.py [--repeat N] [--styles interleaved,zbv,...]
"""

from __future__ import annotations

import argparse
import statistics
import time

from ppdsl.core.schedules import STYLES, generate
from ppdsl.core.schedules.simulate import simulate, validate

PP, MICROBATCHES, CHUNKS = 64, 256, 2


def bench(style: str, repeat: int) -> None:
    chunks = 1 if STYLES[style].chunks == "== 1" else CHUNKS
    gen_times, val_times, sim_times = [], [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        schedule = generate(style, PP, MICROBATCHES, chunks)
        t1 = time.perf_counter()
        problems = validate(schedule)
        t2 = time.perf_counter()
        sim = simulate(schedule)
        t3 = time.perf_counter()
        assert not problems and sim.ok, (problems[:3], sim.problems[:3])
        gen_times.append(t1 - t0)
        val_times.append(t2 - t1)
        sim_times.append(t3 - t2)
    check = [g + v for g, v in zip(gen_times, val_times)]
    total = [g + s for g, s in zip(gen_times, sim_times)]
    actions = sum(len(a) for a in schedule.ranks)
    med = statistics.median
    print(
        f"{style:14s} pp={PP} m={MICROBATCHES} v={chunks}: generate+simulate median {med(total):.3f} s "
        f"(min {min(total):.3f} s), generate+validate median {med(check):.3f} s (min {min(check):.3f} s); "
        f"generate {med(gen_times):.3f} s, validate {med(val_times):.3f} s, simulate {med(sim_times):.3f} s; "
        f"{actions} actions, bubble {sim.bubble:.4f}, peak {max(sim.peak_activations)}"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--styles", default="interleaved,zbv,interleaved_zb,zbh1")
    args = ap.parse_args()
    for style in args.styles.split(","):
        bench(style, args.repeat)


if __name__ == "__main__":
    main()
