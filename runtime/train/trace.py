"""Record what each rank does, per training step (``train.trace = true`` / ``ppdsl run --trace``).

The executor and the trainer append ``(kind, stage, microbatch, start_ns, end_ns)`` tuples to
the recorder's current step; nothing else happens per action, and with tracing off they hold
no recorder and record nothing. The clock is ``time.perf_counter_ns`` (CLOCK_MONOTONIC on
Linux, shared by the processes of one host). On CUDA the clock first synchronises the device,
so each interval is the work's real duration, at the cost of the host running ahead of the
GPU no more (a traced CUDA run is slower; a CPU one is not, see docs/cli.md).

At the end, ``write_trace`` gathers every rank's steps to rank 0 (one ``gather_object``),
which writes RUN_DIR/trace.json (the format is ``ppdsl.core.trace_format``). Per logged step,
``bubble_slots`` carries each rank's pipeline bubble to metrics.jsonl.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ppdsl.lowering.plan import Plan
from ppdsl.core.trace_format import RankTrace, RawEvent, StepTrace, chrome_trace, pipeline_bubble

from ppdsl.runtime.run.rundir import PLAN_FILE, TRACE_FILE  # noqa: F401  (TRACE_FILE: the launcher writes it)
MAX_KEPT_STEPS = 1000  # steps kept for trace.json (the first ones); bubbles are measured on every step


class Recorder:
    """One rank's recorded steps. `events` is the current step's list: append raw tuples."""

    def __init__(self, rank: int, coords: dict[str, int], device: torch.device) -> None:
        self.rank, self.coords = rank, coords
        self.now: Callable[[], int] = time.perf_counter_ns
        if device.type == "cuda":
            def synced() -> int:
                torch.cuda.synchronize(device)
                return time.perf_counter_ns()

            self.now = synced
        self.events: list[RawEvent] = []
        self.steps: list[StepTrace] = []  # for trace.json: the first MAX_KEPT_STEPS
        self.last: StepTrace | None = None
        self._step = 0
        self._start = 0

    def begin_step(self, step: int) -> None:
        self._step, self.events = step, []
        self._start = self.now()

    def end_step(self) -> StepTrace:
        end = self.now()
        trace = StepTrace(self._step, self._start, end, tuple(self.events))  # raw tuples: Event's fields
        if len(self.steps) < MAX_KEPT_STEPS:
            self.steps.append(trace)
        self.last, self.events = trace, []
        return trace

    @contextlib.contextmanager
    def span(self, kind: str) -> Iterator[None]:
        start = self.now()
        try:
            yield
        finally:
            self.events.append((kind, -1, -1, start, self.now()))

    def rank_trace(self) -> RankTrace:
        return RankTrace(self.rank, dict(self.coords), tuple(self.steps))


def span(recorder: Recorder | None, kind: str) -> contextlib.AbstractContextManager[None]:
    """Time a block as one event of `kind`, or nothing without a recorder."""
    return contextlib.nullcontext() if recorder is None else recorder.span(kind)


def bubble_slots(recorder: Recorder, world: int) -> list[float]:
    """The last step's pipeline bubble in this rank's slot of a world-long list, zeros in the
    others: an all-reduce of MAX over the ranks fills every slot (piggybacked on one the trainer
    runs anyway, so tracing adds no collective per step)."""
    assert recorder.last is not None
    slots = [0.0] * world
    slots[recorder.rank] = pipeline_bubble(recorder.last)
    return slots


def write_trace(recorder: Recorder, path: Path | None, meta: dict[str, Any]) -> Path | None:
    """Gather every rank's recorded steps on rank 0 and write them to `path` (a collective);
    returns the path on rank 0, else None."""
    mine = recorder.rank_trace()
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[Any] = [None] * dist.get_world_size() if recorder.rank == 0 else []
        dist.gather_object(mine, gathered if recorder.rank == 0 else None, dst=0)
    else:
        gathered = [mine]
    if recorder.rank != 0 or path is None:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(chrome_trace(sorted(gathered, key=lambda r: r.rank), meta)), encoding="utf-8")
    tmp.replace(path)
    return path


def write_plan(plan: Plan, run_dir: Path) -> Path:
    """RUN_DIR/plan.json: the plan the run executes (``Plan.from_json`` reads it back)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / PLAN_FILE
    path.write_text(plan.dumps() + "\n", encoding="utf-8")
    return path
