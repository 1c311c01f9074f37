"""What `ppdsl run --trace` costs on specs/tiny_cpu.ppspec (4 CPU processes, one thread each).

Two measures, because a shared machine makes the first noisy:

1. in-process: the recorder's own work per record (one clock read and one tuple appended, as
   the executor does per interval), times the records per rank and step of a real trace,
   over that trace's median step time;
2. end to end: `ppdsl run` with and without --trace, alternated `--repeats` times, median of
   the steps' `step_time_s` (step 1, the warm-up, left out).

    OMP_NUM_THREADS=1 python benchmarks/bench_trace_overhead.py [--steps 20] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "specs" / "tiny_cpu.ppspec"


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


def run(out: Path, steps: int, trace: bool) -> list[float]:
    cmd = [sys.executable, "-m", "ppdsl", "run", str(SPEC), "--nproc", "4", "--out", str(out),
           "--set", f"train.steps={steps}", "--set", "train.save_final=false"] + (["--trace"] if trace else [])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, check=True, capture_output=True, env=env, cwd=ROOT)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["step_time_s"] for r in records[1:]]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    per_record = ns_per_record()
    plain: list[float] = []
    traced: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            plain += run(Path(tmp) / f"plain{i}", args.steps, False)
            traced += run(Path(tmp) / f"traced{i}", args.steps, True)
        trace = json.loads((Path(tmp) / f"traced{args.repeats - 1}" / "trace.json").read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["name"] != "pipeline" and e["tid"] != 2]
    ranks = {e["pid"] for e in events}
    steps = {e["args"]["step"] for e in events}
    records = len(events) / (len(ranks) * len(steps))
    # each record is about one clock read + one append; the interval's other clock read is shared
    step_ms = statistics.median(traced) * 1000
    cost_ms = per_record * records * 2 / 1e6  # x2: the clock reads that open an interval
    print(f"recorder: {per_record:.0f} ns per record, {records:.0f} records per rank and step, "
          f"<= {cost_ms * 1000:.0f} us per step = {100 * cost_ms / step_ms:.3f} % of the median traced step "
          f"({step_ms:.1f} ms)")
    p, t = statistics.median(plain), statistics.median(traced)
    print(f"end to end: median step {p * 1000:.1f} ms without --trace, {t * 1000:.1f} ms with "
          f"({100 * (t / p - 1):+.1f} %), {len(plain)} steps each over {args.repeats} alternated runs")


if __name__ == "__main__":
    main()
