"""Measured costs against parameter counts and unit costs, on one machine, in one run.

Three layouts of a spec at one world size, each trained for a few steps by `ppdsl run`
(subprocesses, one thread each), in interleaved rounds (A B C A B C ...) so that the load of a
shared machine hits all alike:

  A  the spec's own layout with `balance = cost` (blocks split on parameter counts; the
     schedule chosen by hand, ordered for unit costs);
  B  the same mesh (tp, pp, dp), with the stage split and the schedule (style, chunks,
     microbatches) `ppdsl tune` picks on the measured cost profile;
  C  the best layout `ppdsl tune` predicts for the world.

Reported: each layout's predicted and measured median step time and the ratios to A.

    OMP_NUM_THREADS=1 python benchmarks/bench_tune.py [SPEC] [--world 4] [--rounds 2] [--steps 6]
        [--profile runs/tiny_cpu/profile.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from ppdsl.dsl.check import check_text
from ppdsl.lowering.costs import Layout, predict
from ppdsl.lowering.lower import lower
from ppdsl.tune import calibrate, candidate_layouts, global_batch_of, load_average, measure_layout, obtain_profile, valid_layouts

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("spec", nargs="?", default=str(ROOT / "specs" / "tiny_cpu.ppspec"))
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--profile", type=Path, default=None)
    args = ap.parse_args()
    text = Path(args.spec).read_text(encoding="utf-8")
    world = args.world
    gb = global_batch_of(text, args.spec, world)
    profile, target = obtain_profile(args.spec, text, [], gb, args.profile)
    result = check_text(text, args.spec, world, ["pipeline.balance=cost"], model=True)
    assert result.ok, [d.message for d in result.diagnostics]
    plan = lower(result.spec, world, result.model_info)
    m = plan.mesh
    own = Layout(m.tp, m.pp, m.dp, plan.schedule.style, plan.schedule.chunks, plan.schedule.microbatches,
                 plan.train.activation_checkpointing, plan.sequence_parallel)
    cost_split = tuple((s.block_start, s.block_stop) for s in plan.stages)
    valid, _ = valid_layouts(text, args.spec, world, list(candidate_layouts(world, gb)))
    preds = sorted((predict(profile, v, gb, world) for v in valid), key=lambda p: p.step_s)
    if world not in profile.contention:
        profile = calibrate(args.spec, world, profile, next(p for p in preds if p.layout.tp == 1), gb, [], target)
        preds = sorted((predict(profile, v, gb, world) for v in valid), key=lambda p: p.step_s)
    same_mesh = next(p for p in preds if (p.layout.tp, p.layout.pp, p.layout.dp) == (m.tp, m.pp, m.dp))
    contenders = {
        "A spec + balance=cost": (own, predict(profile, own, gb, world, split=cost_split), ["pipeline.balance=cost"]),
        "B same mesh, tuned": (same_mesh.layout, same_mesh, []),
        "C tuned": (preds[0].layout, preds[0], []),
    }
    times: dict[str, list[float]] = {k: [] for k in contenders}
    print(f"{args.spec} at world {world}; load {load_average()}", flush=True)
    for r in range(args.rounds):
        for name, (layout, _, extra) in contenders.items():
            times[name].append(measure_layout(args.spec, world, layout, args.steps, extra))
            print(f"  round {r + 1} {name}: {times[name][-1] * 1e3:.1f} ms", flush=True)
    base = statistics.median(times["A spec + balance=cost"])
    print(f"\nload {load_average()}")
    print(f"{'':24} {'layout':32} {'split':12} {'predicted':>10} {'measured':>10} {'vs A':>6}")
    for name, (layout, pred, _) in contenders.items():
        med = statistics.median(times[name])
        split = " ".join(f"{a}-{b - 1}" for a, b in pred.split)
        print(f"{name:24} {layout.label():32} {split:12} {pred.step_s * 1e3:8.1f} ms {med * 1e3:8.1f} ms "
              f"{med / base:6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
