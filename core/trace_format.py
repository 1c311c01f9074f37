"""The trace file format: the Chrome trace JSON a traced run writes.

``ppdsl run --trace`` records, per rank and per training step, when each action ran
(``runtime.train.trace``); this module holds the file format (pure Python, no torch). Reading a
trace back (checking it against the plan, drawing it) is ``ppdsl.views.trace``.

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
