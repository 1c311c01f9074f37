"""DualPipeV against 1F1B and zbv: measured pipeline bubble, and the bubble the simulator predicts
for the same action lists under the costs measured in the same run.

Each case trains the generic decoder (python factory) with `ppdsl run --trace` on CPU, one process
per pipeline rank, and reads `trace.json`: per step, the measured bubble (idle / (ranks x
makespan) of the representative rank of each pp rank, `ppdsl.views.trace.measured_sim`), and the
simulated one: `simulate` over the plan's action lists with each (op, stage)'s mean measured
duration and no latency. Steps 1-2 (warm-up) are left out; the medians are printed.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_dualpipev.py [--pp 2 4] [--steps 8] [--dim 256]

The machine's cores bound what is measured: with more ranks than cores the ranks share cores,
and every style's measured bubble grows by the time a rank waits for a core, which no schedule
simulator sees.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PPDSL = str(Path(sys.executable).with_name("ppdsl"))

SPEC = """ppspec 1
model m {{
  source = python("ppdsl.models.decoder:build_decoder")
  config {{ vocab_size = 256, dim = {dim}, n_layers = {layers}, n_heads = 4, max_seq_len = {seq} }}
}}
mesh {{ pp = {pp} }}
pipeline {{ style = {style}, chunks = {chunks}, microbatches = {m} }}
train {{
  global_batch = {m}
  seq_len = {seq}
  steps = {steps}
  optimizer = sgd(lr = 0.01)
  data = synthetic(seed = 0)
}}
"""


def run_case(style: str, pp: int, m: int, steps: int, dim: int, seq: int, work: Path) -> dict[str, float]:
    from ppdsl.core.schedules import STYLES, generate
    from ppdsl.core.schedules.ir import Action
    from ppdsl.core.schedules.simulate import simulate
    from ppdsl.views.trace import measured_actions, measured_sim

    chunks = 1 if STYLES[style].chunks == "== 1" else 2
    spec = work / f"{style}_pp{pp}.ppspec"
    spec.write_text(SPEC.format(dim=dim, layers=2 * pp, seq=seq, pp=pp, style=style, chunks=chunks, m=m,
                                steps=steps))
    out = work / f"run_{style}_pp{pp}"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run([PPDSL, "run", str(spec), "--nproc", str(pp), "--trace", "--out", str(out)],
                   check=True, env=env, stdout=subprocess.DEVNULL)
    trace = json.loads((out / "trace.json").read_text())
    schedule = generate(style, pp, m, chunks)
    measured, durations = [], defaultdict(list)
    by_step = measured_actions(trace)
    for step in sorted(by_step)[2:]:
        measured.append(measured_sim(trace, schedule, step).bubble)
        for acts in by_step[step].values():
            for a in acts:
                durations[(a.action.op, a.action.stage)].append(a.end_us - a.start_us)
    mean = {k: statistics.fmean(v) for k, v in durations.items()}
    simulated = simulate(schedule, lambda a: mean[(a.op, a.stage)] if isinstance(a, Action) else 0.0).bubble
    return {"measured": statistics.median(measured), "simulated": simulated, "unit": simulate(schedule).bubble}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--styles", nargs="+", default=["1f1b", "zbv", "dualpipev"])
    args = ap.parse_args()
    print(f"cores: {os.cpu_count()}; decoder dim {args.dim}, 2 blocks per pp rank, seq {args.seq}, "
          f"microbatches 2 * pp of 1 sample, steps 3-{args.steps}")
    print("| style | pp | m | bubble, unit costs | simulated (measured costs) | measured (median) | measured / simulated |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        for pp in args.pp:
            m = 2 * pp
            for style in args.styles:
                r = run_case(style, pp, m, args.steps, args.dim, args.seq, Path(tmp))
                print(f"| {style} | {pp} | {m} | {r['unit']:.4f} | {r['simulated']:.4f} | {r['measured']:.4f} | "
                      f"{r['measured'] / r['simulated'] if r['simulated'] else float('nan'):.2f} |", flush=True)


if __name__ == "__main__":
    main()
