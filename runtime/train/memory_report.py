"""`ppdsl run --memory-trace`'s report: every rank's measured peak (`runtime.train.memory_trace`) held
against the plan's prediction (`Plan.memory`, lowering/rank_memory.py, carried by the plan: the
worker neither reads the spec nor counts anything itself), gathered on rank 0, written to
RUN_DIR/memory.json and printed per rank."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from ppdsl.lowering.plan import Plan

from ppdsl.runtime.train.memory_trace import MeasuredMemory
from ppdsl.runtime.run.rundir import MEMORY_FILE

MIB = 2**20


@attrs.frozen
class RankMemoryRow:
    rank: int
    pp: int
    predicted: int | None  # bytes; None when the plan carries no prediction (lowered without the model)
    measured: int
    at: str

    @property
    def error(self) -> float | None:
        """(predicted - measured) / measured."""
        if self.predicted is None or self.measured <= 0:
            return None
        return (self.predicted - self.measured) / self.measured


def gather(measured: MeasuredMemory, world: int) -> list[MeasuredMemory]:
    """Every rank's measurement, on every rank (a collective: all ranks call it)."""
    if world == 1:
        return [measured]
    import torch.distributed as dist

    box: list[Any] = [None] * world
    dist.all_gather_object(box, attrs.asdict(measured))
    return [MeasuredMemory(**m) for m in box]


def rows(plan: Plan, measured: Sequence[MeasuredMemory]) -> list[RankMemoryRow]:
    mem = plan.memory
    return [RankMemoryRow(m.rank, plan.mesh.coords(m.rank)["pp"],
                          None if mem is None else mem.of_rank(plan.mesh, m.rank), m.peak, m.at)
            for m in sorted(measured, key=lambda m: m.rank)]


def to_json(plan: Plan, measured: Sequence[MeasuredMemory], steps: int) -> dict[str, Any]:
    how = measured[0].how if measured else ""
    return {"measured": how, "steps": steps, "traced": None if plan.memory is None else plan.memory.traced,
            "ranks": [{"rank": r.rank, "pp": r.pp, "predicted_bytes": r.predicted, "measured_bytes": r.measured,
                       "error": None if r.error is None else round(r.error, 4), "peak_at": r.at,
                       "state_at_start_bytes": m.start}
                      for r, m in zip(rows(plan, measured), sorted(measured, key=lambda m: m.rank))]}


def write(out_dir: str | Path, plan: Plan, measured: Sequence[MeasuredMemory], steps: int) -> Path:
    path = Path(out_dir) / MEMORY_FILE
    path.write_text(json.dumps(to_json(plan, measured, steps), indent=2) + "\n", encoding="utf-8")
    return path


def lines(plan: Plan, measured: Sequence[MeasuredMemory], steps: int) -> list[str]:
    """The table `ppdsl run --memory-trace` prints at the end."""
    how = measured[0].how if measured else ""
    basis = "no prediction: the plan was lowered without the model" if plan.memory is None else (
        "predicted = the plan's (lowering/rank_memory, as `ppdsl plan` prints it"
        + ("" if plan.memory.traced else "; activations by the 34*b*s*h formula") + ")")
    out = [f"memory: each rank's peak over {steps} step(s), measured = {how}; {basis}",
           f"  {'rank':>4} {'pp':>3} {'predicted':>10} {'measured':>10} {'error':>7}  peak at"]
    for r in rows(plan, measured):
        predicted = "?" if r.predicted is None else f"{r.predicted / MIB:.1f} MiB"
        error = "" if r.error is None else f"{r.error:+.1%}"
        out.append(f"  {r.rank:>4} {r.pp:>3} {predicted:>10} {r.measured / MIB:>6.1f} MiB {error:>7}  {r.at}".rstrip())
    return out
