"""Record what each rank does, per training step (``train.trace = true`` / ``ppdsl run --trace``).

The executor and the trainer append ``(kind, stage, microbatch, start_ns, end_ns)`` tuples to
the recorder's current step; nothing else happens per action, and with tracing off they hold
no recorder and record nothing. The clock is ``time.perf_counter_ns`` (CLOCK_MONOTONIC on
Linux, shared by the processes of one host). On CUDA the clock first synchronises the device,
so each interval is the work's real duration, at the cost of the host running ahead of the
GPU no more (a traced CUDA run is slower; a CPU one is not, see docs/cli.md).

At the end, ``write_trace`` gathers every rank's steps to rank 0 (one ``gather_object``),
which writes RUN_DIR/trace.json (the format is ``lowering.trace``). Per logged step,
``gather_bubbles`` gives every rank's pipeline bubble for metrics.jsonl.
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
from ppdsl.lowering.trace import Event, RankTrace, StepTrace, chrome_trace, pipeline_bubble

RawEvent = tuple[str, int, int, int, int]  # kind, stage, microbatch, start_ns, end_ns
TRACE_FILE, PLAN_FILE = "trace.json", "plan.json"  # in the run directory


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
        self.steps: list[StepTrace] = []
        self._step = 0
        self._start = 0

    def begin_step(self, step: int) -> None:
        self._step, self.events = step, []
        self._start = self.now()

    def end_step(self) -> StepTrace:
        end = self.now()
        trace = StepTrace(self._step, self._start, end, tuple(Event(*e) for e in self.events))
        self.steps.append(trace)
        self.events = []
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


def gather_bubbles(recorder: Recorder, device: torch.device) -> list[float]:
    """The last step's pipeline bubble of every global rank (a collective: every rank calls it)."""
    mine = torch.tensor([pipeline_bubble(recorder.steps[-1])], dtype=torch.float32, device=device)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [round(float(mine), 4)]
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [round(float(t), 4) for t in every]


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
