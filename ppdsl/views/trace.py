"""Measured timelines read back: what a traced run's Chrome trace (`ppdsl.core.trace_format`) says.

Check that a trace ran the plan (``check_trace``), take each rank's measured F / B / W
(``measured_actions``, also `ppdsl tune`'s input), and turn one step into a ``SimResult`` that
``schedule_render`` draws beside the planned one (``measured_sim``, ``render_measured``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from ppdsl.core.schedules.ir import Action, Op, Schedule
from ppdsl.core.schedules.simulate import SimResult, peak_activations
from ppdsl.core.trace_format import ACTION_KINDS, COMPUTE, TEXT_COLUMNS


@attrs.frozen
class MeasuredAction:
    """One F / B / W of one rank in one step, in microseconds from the file's origin."""

    action: Action
    start_us: float
    end_us: float


def measured_actions(trace: Mapping[str, Any]) -> dict[int, dict[int, list[MeasuredAction]]]:
    """step -> global rank -> its F / B / W in the order they started. ValueError when the
    object is not a ppdsl trace."""
    if not isinstance(trace, Mapping) or not isinstance(trace.get("traceEvents"), list):
        raise ValueError("not a Chrome trace: no 'traceEvents' list")
    out: dict[int, dict[int, list[MeasuredAction]]] = {}
    for ev in trace["traceEvents"]:
        if not isinstance(ev, Mapping) or ev.get("ph") != "X" or ev.get("cat") != "compute":
            continue
        args = ev.get("args", {})
        kind = str(ev.get("name", "")).split(" ")[0]
        if kind not in ACTION_KINDS:
            continue
        try:
            action = Action(Op(kind), int(args["microbatch"]), int(args["stage"]))
            start, dur, step, rank = float(ev["ts"]), float(ev["dur"]), int(args["step"]), int(ev["pid"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"trace event {dict(ev)!r} lacks {exc}") from None
        out.setdefault(step, {}).setdefault(rank, []).append(MeasuredAction(action, start, start + dur))
    for by_rank in out.values():
        for acts in by_rank.values():
            acts.sort(key=lambda m: (m.start_us, m.end_us))
    return out


def pp_ranks(trace: Mapping[str, Any]) -> dict[int, int]:
    """global rank -> pipeline rank, from ``otherData.ppdsl.ranks``."""
    try:
        return {int(r["rank"]): int(r["pp"]) for r in trace["otherData"]["ppdsl"]["ranks"]}
    except (KeyError, TypeError, ValueError):
        raise ValueError("not a ppdsl trace: no otherData.ppdsl.ranks") from None


def check_trace(trace: Mapping[str, Any], schedule: Schedule, steps: Sequence[int]) -> list[str]:
    """What is wrong with `trace` as a run of `schedule`: [] when, for every step in `steps` and
    every global rank, the rank's F / B / W are exactly its pipeline rank's actions of the
    plan, each once, in the plan's order, and no two compute events of a rank overlap."""
    problems: list[str] = []
    by_step = measured_actions(trace)
    pp_of = pp_ranks(trace)
    for step in steps:
        for rank, pp in sorted(pp_of.items()):
            got = [m.action for m in by_step.get(step, {}).get(rank, [])]
            want = list(schedule.ranks[pp])
            if got != want:
                first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
                problems.append(f"step {step} rank {rank}: {len(got)} action(s), plan has {len(want)}; first difference "
                                f"at #{first}: ran {got[first] if first < len(got) else 'nothing'}, plan "
                                f"{want[first] if first < len(want) else 'nothing'}")
    for rank, intervals in _compute_intervals(trace).items():
        intervals.sort()
        for (s0, e0, n0), (s1, e1, n1) in zip(intervals, intervals[1:]):
            if s1 < e0 - 1e-3:  # the file rounds to nanoseconds
                problems.append(f"rank {rank}: {n1} starts at {s1} us, before {n0} ends at {e0} us")
    return problems


def _compute_intervals(trace: Mapping[str, Any]) -> dict[int, list[tuple[float, float, str]]]:
    out: dict[int, list[tuple[float, float, str]]] = {}
    for ev in trace["traceEvents"]:
        if isinstance(ev, Mapping) and ev.get("ph") == "X" and ev.get("tid") == COMPUTE:
            start = float(ev["ts"])
            out.setdefault(int(ev["pid"]), []).append((start, start + float(ev["dur"]), str(ev.get("name"))))
    return out


def traced_steps(trace: Mapping[str, Any]) -> list[int]:
    return sorted(measured_actions(trace))


def measured_sim(trace: Mapping[str, Any], schedule: Schedule, step: int) -> SimResult:
    """Step `step` of `trace` as a SimResult of `schedule` (times in milliseconds from the
    step's first action), one row per pipeline rank: the rank with dp = tp = 0. ValueError
    when the step is not in the trace or did not run the plan."""
    by_step = measured_actions(trace)
    if step not in by_step:
        raise ValueError(f"step {step} is not in the trace (it has steps {sorted(by_step)})")
    problems = check_trace(trace, schedule, [step])
    if problems:
        raise ValueError(f"the trace does not run this plan: {problems[0]}")
    representative = {}
    for r in trace["otherData"]["ppdsl"]["ranks"]:
        if r.get("dp", 0) == 0 and r.get("tp", 0) == 0:
            representative[int(r["pp"])] = int(r["rank"])
    rows = [by_step[step][representative[p]] for p in range(schedule.pp)]
    origin = min(m.start_us for row in rows for m in row)
    starts = tuple(tuple((m.start_us - origin) / 1000 for m in row) for row in rows)
    ends = tuple(tuple((m.end_us - origin) / 1000 for m in row) for row in rows)
    makespan = max(e for row in ends for e in row)
    busy = tuple(sum(e - s for s, e in zip(rs, re)) for rs, re in zip(starts, ends))
    bubble = sum(makespan - b for b in busy) / (schedule.pp * makespan) if makespan > 0 else 0.0
    return SimResult(schedule, starts, ends, makespan, bubble, busy, peak_activations(schedule), ())


def default_step(trace: Mapping[str, Any]) -> int:
    """The step drawn when none is asked for: the last one (the first pays for warm-up)."""
    steps = traced_steps(trace)
    if not steps:
        raise ValueError("the trace holds no steps")
    return steps[-1]


def render_measured(schedule: Schedule, trace: Mapping[str, Any], step: int, fmt: str) -> str:
    """The planned timeline (unit costs) and step `step` as measured, in `fmt` (text, svg, json)."""
    from .schedule_render import render_svg, render_text, stack_svg, to_json
    from ppdsl.core.schedules.simulate import simulate

    planned = simulate(schedule)
    measured = measured_sim(trace, schedule, step)
    heading = (f"measured step {step}: {schedule.style}  pp={schedule.pp}  m={schedule.microbatches}  "
               f"v={schedule.chunks}  bubble={measured.bubble:.4f}  makespan={measured.makespan:.1f} ms")
    planned_heading = (f"planned (unit costs): {schedule.style}  pp={schedule.pp}  m={schedule.microbatches}  "
                       f"v={schedule.chunks}  bubble={planned.bubble:.4f}  makespan={planned.makespan:g}")
    if fmt == "svg":
        return stack_svg([render_svg(schedule, planned, planned_heading), render_svg(schedule, measured, heading)])
    if fmt == "text":
        return render_text(schedule, planned, planned_heading) + "\n" + render_text(schedule, measured, heading, max_columns=TEXT_COLUMNS)
    if fmt == "json":
        import json

        return json.dumps({
            "planned": to_json(schedule, planned),
            "measured": {
                "step": step,
                "unit": "ms",
                "bubble": measured.bubble,
                "makespan": measured.makespan,
                "ranks": [{"rank": r, "actions": [{"op": s.action.op.value, "microbatch": s.action.microbatch,
                                                   "stage": s.action.stage, "start": s.start, "end": s.end}
                                                  for s in measured.slots(r)]} for r in range(schedule.pp)],
            },
        }, indent=2)
    raise ValueError(f"unknown format {fmt!r}")
