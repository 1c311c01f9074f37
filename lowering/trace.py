"""Measured timelines: the Chrome trace JSON a traced run writes, read back and checked.

``ppdsl run --trace`` records, per rank and per training step, when each action ran
(``runtime.trace``); this module holds the file format (pure Python, no torch) and what is
done with it afterwards: check that a trace ran the plan (``check_trace``) and turn one step
into a ``SimResult`` that ``schedule_render`` draws beside the planned one (``measured_sim``).

The file is Chrome's trace event format (loadable in Perfetto and chrome://tracing): one
process per global rank, threads ``compute`` (F / B / W, clip, optimizer), ``comm`` (p2p
posts, receive waits, send waits, collectives) and ``step`` (one event spanning each step).
Times are microseconds since the earliest recorded event; every event carries its step in
``args``, compute actions also their stage and microbatch. ``otherData.ppdsl`` names each
global rank's (dp, pp, tp) coordinates.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import attrs

from ppdsl.schedules.ir import Action, Op, Schedule
from ppdsl.schedules.simulate import SimResult, peak_activations

COMPUTE, COMM, STEP = 0, 1, 2  # thread ids
THREAD_NAMES = {COMPUTE: "compute", COMM: "comm", STEP: "step"}
ACTION_KINDS = ("F", "B", "W")
COMPUTE_KINDS = (*ACTION_KINDS, "clip", "optimizer")  # the rest is communication
PIPELINE = "pipeline"  # the span of the executor's train step; the bubble's denominator
TEXT_COLUMNS = 100  # the measured text timeline's width: real durations have no common unit


class Event(NamedTuple):
    """One recorded interval of one rank (nanoseconds of a monotonic clock). A named tuple:
    the recorder appends plain tuples of these fields, one per interval."""

    kind: str  # F | B | W | clip | optimizer | p2p | wait | send wait | loss all-reduce | grad sync | pipeline
    stage: int  # -1 when the event belongs to no stage
    microbatch: int  # -1 when it belongs to no microbatch
    start_ns: int
    end_ns: int


RawEvent = tuple[str, int, int, int, int]  # kind, stage, microbatch, start_ns, end_ns


@attrs.frozen
class StepTrace:
    step: int  # 1-based, as in metrics.jsonl
    start_ns: int
    end_ns: int
    events: tuple[RawEvent, ...]  # Event's fields as plain tuples (Event._make reads one)


@attrs.frozen
class RankTrace:
    rank: int  # global rank
    coords: Mapping[str, int]  # {"dp": .., "pp": .., "tp": ..}
    steps: tuple[StepTrace, ...]


def pipeline_bubble(step: StepTrace) -> float:
    """1 - (F / B / W time) / (the pipeline span) of one rank's step: the share of the
    executor's train step this rank spent not computing (waiting, communicating). Without a
    ``pipeline`` event, the whole step is the span."""
    span, busy = (step.start_ns, step.end_ns), 0
    for kind, _, _, start, end in step.events:
        if kind in ACTION_KINDS:
            busy += end - start
        elif kind == PIPELINE:
            span = (start, end)
    wall = span[1] - span[0]
    return max(0.0, 1.0 - busy / wall) if wall > 0 else 0.0


def event_name(e: Event) -> str:
    """``F s1 mb3``; ``wait s1 mb3`` (for the message F s1 mb3 consumes); ``optimizer``."""
    return e.kind if e.microbatch < 0 else f"{e.kind} s{e.stage} mb{e.microbatch}"


def chrome_trace(ranks: Sequence[RankTrace], meta: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The Chrome trace JSON object of every rank's recorded steps."""
    starts = [s.start_ns for r in ranks for s in r.steps] + [e[3] for r in ranks for s in r.steps for e in s.events]
    origin = min(starts, default=0)

    def us(ns: int) -> float:
        return round((ns - origin) / 1000, 3)

    def dur(start: int, end: int) -> float:
        return round(us(end) - us(start), 3)

    events: list[dict[str, Any]] = []
    for r in ranks:
        c = r.coords
        events.append({"name": "process_name", "ph": "M", "pid": r.rank,
                       "args": {"name": f"rank {r.rank} (pp {c['pp']}, tp {c['tp']}, dp {c['dp']})"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": r.rank, "args": {"sort_index": r.rank}})
        for tid, name in THREAD_NAMES.items():
            events.append({"name": "thread_name", "ph": "M", "pid": r.rank, "tid": tid, "args": {"name": name}})
        for s in r.steps:
            events.append({"name": f"step {s.step}", "cat": "step", "ph": "X", "pid": r.rank, "tid": STEP,
                           "ts": us(s.start_ns), "dur": dur(s.start_ns, s.end_ns), "args": {"step": s.step}})
            for e in map(Event._make, s.events):
                compute = e.kind in COMPUTE_KINDS
                args: dict[str, Any] = {"step": s.step}
                if e.stage >= 0:
                    args["stage"] = e.stage
                if e.microbatch >= 0:
                    args["microbatch"] = e.microbatch
                events.append({"name": event_name(e), "cat": "compute" if compute else "comm", "ph": "X",
                               "pid": r.rank, "tid": STEP if e.kind == PIPELINE else COMPUTE if compute else COMM,
                               "ts": us(e.start_ns), "dur": dur(e.start_ns, e.end_ns), "args": args})
    other = {"ppdsl": {"ranks": [{"rank": r.rank, **dict(r.coords)} for r in ranks], **dict(meta or {})}}
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}


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
    from ppdsl.schedules.simulate import simulate

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
