"""`ppdsl tune`: enumerate the layouts `check` proves valid, rank them on measured costs,
optionally run the best few, and write the winner as a spec that differs only in layout keys.

The cost model is ``lowering.costs``; the profile is measured by ``runtime.train.profile`` (torch is
imported only there). docs/tune.md describes both and their limits.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs

from ppdsl.dsl import ast
from ppdsl.dsl.check import check_text
from ppdsl.dsl.model_check import context_refusal
from ppdsl.dsl.parse import parse
from ppdsl.lowering.costs import CostProfile, Layout, Prediction, calibration_factor, divisors, predict, style_chunks
from ppdsl.lowering.lower import lower
from ppdsl.core.schedules import STYLES, style_problem

LAYOUT_KEYS = (("mesh", "tp"), ("mesh", "pp"), ("mesh", "dp"), ("pipeline", "style"), ("pipeline", "chunks"),
               ("pipeline", "microbatches"), ("pipeline", "split"), ("train", "activation_checkpointing"),
               ("tensor_parallel", "sequence_parallel"), ("mesh", "cp"), ("mesh", "ep"))


def layout_overrides(layout: Layout) -> list[str]:
    """`--set` arguments that give a spec this layout."""
    out = [f"mesh.tp={layout.tp}", f"mesh.pp={layout.pp}", f"mesh.dp={layout.dp}",
           f"pipeline.style={layout.style}", f"pipeline.chunks={layout.chunks}",
           f"pipeline.microbatches={layout.microbatches}",
           f"train.activation_checkpointing={str(layout.activation_checkpointing).lower()}"]
    if layout.tp > 1 or layout.sequence_parallel:
        out.append(f"tensor_parallel.sequence_parallel={str(layout.sequence_parallel).lower()}")
    if layout.split is not None:
        out.append("pipeline.split=[" + ", ".join(f"{a}:{b}" for a, b in layout.split) + "]")
    out += [f"mesh.cp={layout.cp}", f"mesh.ep={layout.ep}"]
    return out


def layout_values(layout: Layout) -> dict[tuple[str, str], str]:
    return {tuple(o.split("=", 1)[0].split(".")): o.split("=", 1)[1] for o in layout_overrides(layout)}  # type: ignore[misc]


def candidate_layouts(world: int, global_batch: int, styles: Sequence[str] = tuple(STYLES),
                      activation_checkpointing: bool = True, zero: int = 0,
                      reshard_after_forward: bool = False, cp_sizes: Sequence[int] = (1,),
                      ep_sizes: Sequence[int] = (1,)) -> Iterator[Layout]:
    """Every (tp, pp, cp, dp, ep, style, chunks, microbatches, ac, sp) the schedule rules allow;
    `check` decides the rest. pp = 1 gets one style (1f1b): the schedules are all the same there.
    `zero`, `reshard_after_forward`: the spec's, which every candidate keeps (not a choice of tune).
    `cp_sizes`, `ep_sizes`: the context- and expert-parallel sizes to try (`search_axes`)."""
    for tp in divisors(world):
        for pp in divisors(world // tp):
            for cp in (c for c in cp_sizes if (world // (tp * pp)) % c == 0):
                dp = world // (tp * pp * cp)
                if global_batch % dp:
                    continue
                for ep in (e for e in ep_sizes if dp % e == 0):
                    for style in (styles if pp > 1 else ("1f1b",)):
                        for chunks in style_chunks(style, pp):
                            for m in divisors(global_batch // dp):
                                if style_problem(style, pp, m, chunks) is not None:
                                    continue
                                for ac in (False, True) if activation_checkpointing else (False,):
                                    for sp in (False, True) if tp > 1 else (False,):
                                        yield Layout(tp, pp, dp, style, chunks, m, ac, sp, zero=zero,
                                                     reshard_after_forward=reshard_after_forward, cp=cp, ep=ep)


def search_axes(text: str, file: str, world: int, overrides: Sequence[str] = ()) -> tuple[list[int], list[int]]:
    """The cp and ep sizes worth trying: cp where check accepts context parallelism for the model
    (no model-level reason against cp = 2: a causal LM whose attention it can split), each size
    dividing the world and seq_len / 2; ep for a model with experts, each size dividing the world and the experts."""
    spec = _spec_of(text, file, overrides)
    seq = spec.train.seq_len if isinstance(spec.train.seq_len, int) else None
    cps, eps = [1], [1]
    probe = check_text(text, file, None, [*overrides, "mesh.cp=2", "mesh.ep=1", "train.zero=0"], model=True)
    if seq and probe.spec is not None and probe.model_info is not None \
            and context_refusal(probe.spec, probe.model_info) is None:
        cps += [c for c in divisors(world) if c > 1 and seq % (2 * c) == 0]
    experts = spec.model.dims.get("experts")
    if isinstance(experts, int) and experts > 1:
        eps += [e for e in divisors(world) if e > 1 and experts % e == 0]
    return cps, eps


def valid_layouts(text: str, file: str, world: int, layouts: Sequence[Layout],
                  overrides: Sequence[str] = (), model: bool = True,
                  checked: dict[Layout, tuple[Any, Any]] | None = None) -> tuple[list[Layout], int]:
    """The layouts `check` accepts at `world` (structural check for each, the model-level check
    once per (tp, pp, cp, ep, chunks, sequence parallelism)); also the number refused. `checked`: filled with each accepted
    layout's (checked spec, model facts; None with `model` off), what `layout_memory` lowers."""
    ok: list[Layout] = []
    model_ok: dict[tuple[int, ...], tuple[bool, Any]] = {}
    for layout in layouts:
        sets = [*overrides, *layout_overrides(layout)]
        result = check_text(text, file, world, sets, model=False)
        if not result.ok:
            continue
        # what the model-level rules read: the mesh, the virtual stages (E0308: blocks to fill them),
        # sequence parallelism (E0423: not for the own forward)
        key = (layout.tp, layout.pp, layout.cp, layout.ep, layout.chunks, int(layout.sequence_parallel))
        if key not in model_ok:
            with_model = check_text(text, file, world, sets, model=True) if model else None
            model_ok[key] = (True, None) if with_model is None else (with_model.ok, with_model.model_info)
        if model_ok[key][0]:
            ok.append(layout)
            if checked is not None:
                checked[layout] = (result.spec, model_ok[key][1])
    return ok, len(layouts) - len(ok)


def layout_memory(spec: Any, info: Any, world: int, split: Sequence[tuple[int, int]]) -> int | None:
    """The largest rank's predicted peak of a candidate (its checked spec, the model facts, the
    split tune predicts for it): its lowered plan's `memory` (lowering/rank_memory.py), the figure
    `ppdsl plan` prints and check proves. None without the model."""
    if info is None:
        return None
    from ppdsl.dsl.own_check import with_inferred_layout  # the structural check's spec lacks the traced layout

    memory = lower(with_inferred_layout(spec, info), world, info, split=split).memory
    return None if memory is None else memory.largest


def with_memory(preds: Sequence[Prediction], layouts: Sequence[Layout], checked: dict[Layout, tuple[Any, Any]],
                world: int, cache: dict[tuple[Layout, tuple[tuple[int, int], ...]], int | None]) -> list[Prediction]:
    """`preds` (of `layouts`, in order) with each one's `layout_memory`; `cache` by layout and split."""
    out = []
    for layout, p in zip(layouts, preds):
        key = (layout, p.split)
        if key not in cache:
            spec, info = checked.get(layout, (None, None))
            cache[key] = None if spec is None else layout_memory(spec, info, world, p.split)
        out.append(attrs.evolve(p, memory_bytes=cache[key]))
    return out


def _spec_of(text: str, file: str, overrides: Sequence[str] = ()):
    result = check_text(text, file, None, overrides, model=False)
    if result.spec is None:
        raise ValueError(f"{file} does not resolve: run `ppdsl check {file}`")
    return result.spec


def global_batch_of(text: str, file: str, world: int, overrides: Sequence[str] = ()) -> int:
    from ppdsl.dsl.spec import WORLD

    gb = _spec_of(text, file, overrides).train.global_batch
    return int(gb.subs(WORLD, world)) if hasattr(gb, "subs") else int(gb)


def model_state_of(text: str, file: str, overrides: Sequence[str] = ()) -> tuple[int, int]:
    """The spec's ZeRO stage and its optimizer's fp32 state tensors per parameter: what the
    memory prediction of every candidate keeps (``lowering.memory``)."""
    from ppdsl.lowering.memory import optimizer_slots

    train = _spec_of(text, file, overrides).train
    return train.zero, optimizer_slots(train.optimizer.name, train.optimizer.momentum)


# ---- the ranked table ------------------------------------------------------------------------


def _gib(n: float | None) -> str:
    if n is None:
        return "?"
    return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


def why(best: Prediction, other: Prediction) -> str:
    """The largest component of the gap between two predictions, in words."""
    parts = {
        "pipeline": other.pipeline_s - best.pipeline_s,
        "data-parallel gradient all-reduce": other.dp_sync_s - best.dp_sync_s,
        "optimizer step": other.optimizer_s - best.optimizer_s,
    }
    name, gap = max(parts.items(), key=lambda kv: kv[1])
    if name == "pipeline":
        return (f"shorter pipeline ({best.pipeline_s * 1e3:.1f} vs {other.pipeline_s * 1e3:.1f} ms; "
                f"bubble {best.bubble:.2f} vs {other.bubble:.2f}, slowest stage "
                f"{max(best.stage_s) * 1e3:.2f} vs {max(other.stage_s) * 1e3:.2f} ms per microbatch)")
    return f"less {name} ({gap * 1e3:.1f} ms)"


def _error(predicted: float | None, measured: float | None) -> str:
    if predicted is None or not measured:
        return ""
    return f"{(predicted - measured) / measured:+.0%}"


def render_table(preds: Sequence[Prediction], top: int, measured: dict[Layout, float] | None = None,
                 measured_memory: dict[Layout, int | None] | None = None) -> str:
    """The ranked table; with `measured` (step seconds) and `measured_memory` (the largest
    rank's measured peak, bytes) the columns of `--measure`."""
    head = ["#", "layout", "split", "predicted", "bubble", "memory"] + (["measured", "error"] if measured else []) + \
        (["memory measured", "error"] if measured_memory else [])
    rows = [head]
    for i, p in enumerate(preds[:top], 1):
        row = [str(i), p.layout.label(), " ".join(f"{a}-{b - 1}" for a, b in p.split),
               f"{p.step_s * 1e3:.1f} ms", f"{p.bubble:.3f}", _gib(p.memory_bytes)]
        if measured:
            m = measured.get(p.layout)
            row += ["" if m is None else f"{m * 1e3:.1f} ms", _error(p.step_s, m)]
        if measured_memory:
            mem = measured_memory.get(p.layout)
            row += ["" if mem is None else _gib(mem), _error(p.memory_bytes, mem)]
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


# ---- writing the best spec -------------------------------------------------------------------


def rewrite_layout(text: str, file: str, values: dict[tuple[str, str], str]) -> str:
    """`text` with each (block, key) set to its value: replaced in place where the spec has it,
    added at the end of the block where it does not (a missing block is added at the end). The
    rest of the text, comments and formatting included, is kept byte for byte."""
    doc = parse(text, file)
    lines = text.splitlines(keepends=True)
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))

    def offset(line: int, column: int) -> int:
        return starts[line - 1] + column - 1

    edits: list[tuple[int, int, str]] = []  # (start, end, replacement)
    missing_blocks: dict[str, list[str]] = {}
    blocks = {b.kind: b for b in doc.items if isinstance(b, ast.Block)}
    for (block, key), value in values.items():
        b = blocks.get(block)
        if b is None:
            missing_blocks.setdefault(block, []).append(f"  {key} = {value}\n")
            continue
        assign = next((e for e in b.entries if isinstance(e, ast.Assign) and e.key == key), None)
        if assign is not None:
            v = assign.value.span
            edits.append((offset(v.line, v.column), offset(v.end_line, v.end_column), value))
        else:
            close = offset(b.span.end_line, b.span.end_column) - 1  # the block's `}`
            assert text[close] == "}", (block, text[close])
            if b.span.line == b.span.end_line:  # `mesh { tp = 2 }`: `, key = value` after the last entry
                at = close
                while text[at - 1] in " \t":
                    at -= 1
                edits.append((at, at, f" {key} = {value}" if text[at - 1] == "{" else f", {key} = {value}"))
            else:
                indent = re.match(r"[ \t]*", lines[b.span.end_line - 1]).group(0)  # type: ignore[union-attr]
                edits.append((close, close, f"  {key} = {value}\n{indent}"))
    out = text
    # from the end, so offsets stay right; insertions at one place keep the order they were made in
    for _, (start, end, new) in sorted(enumerate(edits), key=lambda e: (e[1][0], e[0]), reverse=True):
        out = out[:start] + new + out[end:]
    for block, entries in missing_blocks.items():
        out += f"\n{block} {{\n{''.join(entries)}}}\n"
    return out


def best_spec_text(text: str, file: str, layout: Layout) -> str:
    values = layout_values(layout)
    if layout.tp == 1 and not layout.sequence_parallel:
        values.pop(("tensor_parallel", "sequence_parallel"), None)
    written = {e.key for b in parse(text, file).items if isinstance(b, ast.Block) and b.kind == "mesh"
               for e in b.entries if isinstance(e, ast.Assign)}
    for key in ("cp", "ep"):  # the default size 1 is written only over a size the spec gives
        if values.get(("mesh", key)) == "1" and key not in written:
            values.pop(("mesh", key))
    return rewrite_layout(text, file, values)


# ---- measuring -------------------------------------------------------------------------------


WARM_UP = 2  # steps of each measured run left out of its step time (their memory is measured)


@attrs.frozen
class LayoutRun:
    times: list[float]  # step seconds, the warm-up steps left out
    trace: dict | None  # the run's trace.json (`trace`)
    memory: dict | None  # the run's memory.json (`memory`: runtime.train.memory_report)

    @property
    def memory_peak(self) -> int | None:
        """The largest rank's measured peak (bytes)."""
        if self.memory is None:
            return None
        return max(r["measured_bytes"] for r in self.memory["ranks"])


def run_layout(spec: str, world: int, layout: Layout, steps: int, overrides: Sequence[str] = (),
               trace: bool = False, timeout_s: float = 900.0, memory: bool = False) -> LayoutRun:
    """`ppdsl run` with this layout for `WARM_UP` steps and `steps` more: the step times
    (warm-up left out), with `trace` the run's trace.json, with `memory` each rank's peak of
    live tensor bytes over the warm-up steps (`ppdsl run --memory-trace --memory-trace-steps
    WARM_UP`: the timed steps run without the counter)."""
    with tempfile.TemporaryDirectory(prefix="ppdsl-tune-") as out:
        sets = [*overrides, *layout_overrides(layout), f"train.steps={steps + WARM_UP}", "train.log_every=1"]
        cmd = [sys.executable, "-m", "ppdsl", "run", spec, "--nproc", str(world), "--out", out, "--overwrite"]
        cmd += ["--trace"] if trace else []
        cmd += ["--memory-trace", "--memory-trace-steps", str(WARM_UP)] if memory else []
        for s in sets:
            cmd += ["--set", s]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "RANK", "WORLD_SIZE"))}
        env["OMP_NUM_THREADS"] = "1"
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"{layout.label()}: ppdsl run failed ({proc.returncode}): {proc.stderr[-2000:]}")
        records = [json.loads(x) for x in Path(out, "metrics.jsonl").read_text().splitlines() if x.strip()]
        times = [r["step_time_s"] for r in records if "step_time_s" in r][WARM_UP:]
        if not times:
            raise RuntimeError(f"{layout.label()}: no step times in metrics.jsonl")
        return LayoutRun(times, json.loads(Path(out, "trace.json").read_text()) if trace else None,
                         json.loads(Path(out, "memory.json").read_text()) if memory else None)


def measure_layout(spec: str, world: int, layout: Layout, steps: int, overrides: Sequence[str] = ()) -> float:
    """Median step time (s) of `ppdsl run` with this layout, the first two steps left out."""
    return statistics.median(run_layout(spec, world, layout, steps, overrides).times)


def calibrate(spec: str, world: int, profile: CostProfile, pred: Prediction, global_batch: int,
              overrides: Sequence[str], target: Path, steps: int = 4, log=print) -> CostProfile:
    """The profile with the compute slowdown of `world` processes taken from one traced run of
    `pred`'s layout: its F / B / W seconds (warm-up steps left out) over their prediction
    from the one-process profile. Saved to `target`."""
    from .views.trace import measured_actions

    t0 = now()
    run = run_layout(spec, world, pred.layout, steps, overrides, trace=True)
    times, trace = run.times, run.trace
    assert trace is not None
    by_step = measured_actions(trace)
    actions = [(a.action.op.value, a.action.stage, (a.end_us - a.start_us) / 1e6)
               for step in sorted(by_step)[2:] for acts in by_step[step].values() for a in acts]
    unslowed = predict(attrs.evolve(profile, contention={**profile.contention, world: 1.0}), pred.layout,
                       global_batch, world)
    factor = calibration_factor(unslowed, actions)
    log(f"calibration: a traced run of {pred.layout.label()} ({now() - t0:.0f} s): its F / B / W took "
        f"{factor:.2f}x the one-process profile (load {load_average()}); saved to {target}")
    profile = attrs.evolve(profile, contention={**profile.contention, world: factor})
    bare = attrs.evolve(profile, step_overhead={**profile.step_overhead, world: 0.0})
    overhead = max(0.0, statistics.median(times) - predict(bare, pred.layout, global_batch, world).step_s)
    log(f"calibration: {overhead * 1e3:.1f} ms a step outside the model (measured {statistics.median(times) * 1e3:.1f} ms)")
    profile = attrs.evolve(profile, step_overhead={**profile.step_overhead, world: overhead})
    profile.save(target)
    return profile


def calibrate_tp(spec: str, world: int, profile: CostProfile, pred: Prediction, global_batch: int,
                 overrides: Sequence[str], target: Path, steps: int = 4, log=print) -> CostProfile:
    """The profile with the time of one tensor-parallel collective (tp = `pred`'s) taken from one
    traced run: its F and B time beyond the (calibrated) compute, per collective they ran."""
    from ppdsl.lowering.costs import tp_collectives_per_block
    from .views.trace import measured_actions

    layout = attrs.evolve(pred.layout, sequence_parallel=False)
    t0 = now()
    trace = run_layout(spec, world, layout, steps, overrides, trace=True).trace
    assert trace is not None
    by_step = measured_actions(trace)
    compute = predict(attrs.evolve(profile, tp_collective={**profile.tp_collective, layout.tp: 0.0}), layout,
                      global_batch, world)
    blocks = [b - a for a, b in compute.split]
    split_bw = any(a.action.op.value == "W" for st in by_step.values() for acts in st.values() for a in acts)
    spent = expected = 0.0
    count = 0
    for step in sorted(by_step)[2:]:
        for acts in by_step[step].values():
            for a in acts:
                op, stage = a.action.op.value, a.action.stage
                if op == "W":
                    continue
                f, b, w = compute.action_s[stage]
                spent += (a.end_us - a.start_us) / 1e6
                expected += f if op == "F" else b if split_bw else b + w
                count += blocks[stage] * tp_collectives_per_block(False)
    per = max(0.0, (spent - expected) / max(1, count))
    log(f"calibration: a traced run of {layout.label()} ({now() - t0:.0f} s): one tp={layout.tp} collective "
        f"takes {per * 1e3:.2f} ms (load {load_average()}); saved to {target}")
    profile = attrs.evolve(profile, tp_collective={**profile.tp_collective, layout.tp: per})
    profile.save(target)
    return profile


def load_average() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def now() -> float:
    return time.monotonic()




# ---- the command -----------------------------------------------------------------------------

PROFILE_HIGH = 8  # the larger microbatch size profiled (or the global batch, when smaller)


def world1_overrides(samples: int, global_batch: int) -> list[str]:
    # one process: no expert parallelism either (the profile's experts are whole, as at ep = 1)
    return ["mesh.tp=1", "mesh.pp=1", "mesh.dp=1", "mesh.ep=1", "mesh.cp=1", "pipeline.style=1f1b", "pipeline.chunks=1",
            f"pipeline.microbatches={global_batch // samples}", "pipeline.split=auto"]


def obtain_profile(spec: str, text: str, overrides: Sequence[str], global_batch: int, path: Path | None,
                   log=print) -> tuple[CostProfile, Path]:
    """Read the profile at `path`, or measure one (one process, then a two-process gloo
    benchmark) and write it there (default runs/<spec name>/profile.json)."""
    target = path or Path("runs") / Path(spec).stem / "profile.json"
    if path is not None and path.exists():
        log(f"profile: read {path}")
        return CostProfile.load(path), path
    from ppdsl.lowering.lower import lower
    from ppdsl.runtime.train.profile import measure_comm, measure_profile

    high = min(global_batch, PROFILE_HIGH)
    plans = []
    for samples in sorted({1, high}) if high > 1 else (1, 1):
        result = check_text(text, spec, 1, [*overrides, *world1_overrides(samples, global_batch)], model=True)
        if not result.ok:
            raise ValueError(f"cannot profile {spec} in one process: "
                             + "; ".join(d.message for d in result.diagnostics if d.is_error))
        plans.append(lower(result.spec, 1, result.model_info))
    t0 = now()
    comm = measure_comm()
    t1 = now()
    profile = measure_profile(plans, comm)
    log(f"profile: measured in {now() - t0:.1f} s (communication {t1 - t0:.1f} s, load {load_average()}); "
        f"written to {target}")
    profile.save(target)
    return profile, target


def main(args) -> int:  # an argparse.Namespace from ppdsl.cli
    spec, world = args.spec, args.world
    text = Path(spec).read_text(encoding="utf-8")
    overrides = list(args.overrides)
    global_batch = global_batch_of(text, spec, world, overrides)
    zero, _ = model_state_of(text, spec, overrides)
    profile, target = obtain_profile(spec, text, overrides, global_batch, Path(args.profile) if args.profile else None)
    t0 = now()
    reshard = _spec_of(text, spec, overrides).train.reshard_after_forward
    cps, eps = search_axes(text, spec, world, overrides)
    layouts = list(candidate_layouts(world, global_batch, zero=zero, reshard_after_forward=reshard, cp_sizes=cps,
                                     ep_sizes=eps))
    checked: dict[Layout, tuple[Any, Any]] = {}
    valid, refused = valid_layouts(text, spec, world, layouts, overrides, checked=checked)
    memory_cache: dict = {}

    def predictions(profile: CostProfile) -> list[Prediction]:
        # memory: each candidate's lowered plan at the split predicted for it (lowering/rank_memory)
        return with_memory([predict(profile, layout, global_batch, world) for layout in valid], valid, checked, world,
                           memory_cache)

    preds = predictions(profile)
    ranked_in = now() - t0
    if world not in profile.contention and not args.no_calibrate and preds:
        # one traced run of the best layout without tensor parallelism (its F / B / W are pure compute)
        preds.sort(key=lambda p: p.step_s)
        pick = next((p for p in preds if p.layout.tp == 1), preds[0])
        profile = calibrate(spec, world, profile, pick, global_batch, overrides, target)
        preds = predictions(profile)
    if not args.no_calibrate:
        # one traced run per tensor-parallel size that leads the ranking uncalibrated
        for _ in range(3):
            preds.sort(key=lambda p: p.step_s)
            lead = next((p for p in preds[: max(5, args.measure)] if p.layout.tp > 1
                         and p.layout.tp not in profile.tp_collective), None)
            if lead is None:
                break
            profile = calibrate_tp(spec, world, profile, lead, global_batch, overrides, target)
            preds = predictions(profile)
    budget = None if args.memory is None else args.memory * 2**30
    over = [p for p in preds if budget is not None and p.memory_bytes is not None and p.memory_bytes > budget]
    preds = sorted((p for p in preds if p not in over), key=lambda p: (p.step_s, p.memory_bytes or 0))
    print(f"{len(layouts)} candidate layouts for world {world}: {len(valid)} proved valid by check, "
          f"{refused} refused, {len(over)} over the memory budget; enumerated, checked and ranked in {ranked_in:.1f} s")
    if not preds:
        print("no layout fits", file=sys.stderr)
        return 1
    measured: dict[Layout, float] = {}
    measured_memory: dict[Layout, int | None] = {}
    if args.measure:
        print(f"measuring the top {args.measure} ({args.steps} steps each, {args.rounds} round(s) in turn, "
              f"load {load_average()}; memory: the peak of live tensor bytes in the {WARM_UP} warm-up steps) ...")
        runs: dict[Layout, list[float]] = {p.layout: [] for p in preds[: args.measure]}
        for _ in range(args.rounds):  # interleaved: the machine's load changes hit every layout alike
            for p in preds[: args.measure]:
                run = run_layout(spec, world, p.layout, args.steps, overrides, memory=True)
                runs[p.layout].append(statistics.median(run.times))
                peaks = [x for x in (measured_memory.get(p.layout), run.memory_peak) if x is not None]
                measured_memory[p.layout] = max(peaks) if peaks else None
                print(f"  {p.layout.label()}: predicted {p.step_s * 1e3:.1f} ms, measured "
                      f"{runs[p.layout][-1] * 1e3:.1f} ms; memory predicted {_gib(p.memory_bytes)}, measured "
                      f"{_gib(run.memory_peak)}", flush=True)
        measured = {k: statistics.median(v) for k, v in runs.items()}
    print(render_table(preds, max(args.top, args.measure or 0), measured, measured_memory))
    print("\nwhy the top ones win:")
    for a, b in zip(preds[:3], preds[1:4]):
        print(f"  {a.layout.label()} over {b.layout.label()}: {why(a, b)}")
    if measured:
        errors = [abs(p.step_s - measured[p.layout]) / measured[p.layout] for p in preds if p.layout in measured]
        best = min(measured.values())
        top = measured[preds[0].layout]
        print(f"\nprediction error: median {statistics.median(errors):.0%}, max {max(errors):.0%}; the top predicted "
              f"layout measured {top * 1e3:.1f} ms, the best measured {best * 1e3:.1f} ms ({top / best - 1:+.0%}); "
              f"load {load_average()}")
        mem = [abs(p.memory_bytes - m) / m for p in preds if (m := measured_memory.get(p.layout))
               and p.memory_bytes is not None]
        if mem:
            print(f"memory error (the largest rank, predicted against the peak of live tensor bytes): median "
                  f"{statistics.median(mem):.0%}, max {max(mem):.0%}")
    if args.output:
        out = best_spec_text(text, spec, preds[0].layout)
        check = check_text(out, args.output, world, overrides, model=False)
        if not check.ok:
            print(f"internal error: the written spec does not check: {[d.message for d in check.diagnostics]}",
                  file=sys.stderr)
            return 1
        Path(args.output).write_text(out, encoding="utf-8")
        print(f"\nwrote {args.output}: {preds[0].layout.label()} (differs from {spec} only in layout keys)")
    return 0
