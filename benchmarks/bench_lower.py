"""lower() + simulate() of a large plan: pp=64, microbatches=256, chunks=2 (goal: under 2 s).

Usage: python benchmarks/bench_lower.py [--repeat N]
"""

from __future__ import annotations

import argparse
import statistics
import time

from ppdsl.dsl.check import check_text
from ppdsl.lowering.lower import lower
from ppdsl.core.schedules.simulate import simulate

SPEC = """ppspec 1
model m {
  source = python("ppdsl.models.decoder:build_decoder")
  config { vocab_size = 32000, dim = 4096, n_layers = 256, n_heads = 32, max_seq_len = 4096 }
}
mesh { tp = 8, pp = 64 }
pipeline { style = %s, chunks = 2, microbatches = 256 }
train { global_batch = 1024, seq_len = 4096 }
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    for style in ("interleaved", "zbv"):
        result = check_text(SPEC % style, "bench.ppspec", world=2048)
        assert result.ok, result.diagnostics
        times = []
        for _ in range(args.repeat):
            t = time.perf_counter()
            plan = lower(result.spec, 2048)
            sim = simulate(plan.schedule)
            times.append(time.perf_counter() - t)
        print(f"{style:12s} pp=64 m=256 v=2: lower+simulate median {statistics.median(times):.3f} s "
              f"(min {min(times):.3f} s), bubble {sim.bubble:.4f}, actions {sum(map(len, plan.schedule.ranks))}")


if __name__ == "__main__":
    main()
