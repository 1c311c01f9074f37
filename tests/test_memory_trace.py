"""`ppdsl run --memory-trace` (issue 34): the plan carries each rank's predicted peak
(`Plan.memory`, lowering/rank_memory.py), the runtime counts each rank's peak of live tensor
bytes (runtime/train/memory_trace.py) and prints one against the other (runtime/train/memory_report.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ppdsl.dsl.check import check_file
from ppdsl.lowering.lower import lower
from ppdsl.lowering.plan import Plan
from ppdsl.runtime.train import memory_report
from ppdsl.runtime.train.memory_trace import LiveBytes, MeasuredMemory, MemoryTracker
from ppdsl.views.report import plan_report

from _run_helpers import TINY_CPU, run_cmd

PP2 = ["mesh.tp=1", "mesh.pp=2"]


def _plan(world: int = 2, overrides: list[str] = PP2, model: bool = True) -> Plan:
    r = check_file(str(TINY_CPU), world=world, overrides=overrides, model=model)
    assert r.ok, r.diagnostics
    return lower(r.spec, world, r.model_info)


def test_the_plan_carries_ppdsl_plans_figures() -> None:
    r = check_file(str(TINY_CPU), world=4, model=True)
    plan = lower(r.spec, 4, r.model_info)
    assert plan.memory is not None and plan.memory.traced
    rows = plan_report(plan, r.model_info, r.spec.model.dims.get("hidden")).rows
    assert [plan.memory.of_rank(plan.mesh, row.rank) for row in rows] == [row.memory_bytes for row in rows]
    assert [row.activation_bytes for row in rows] == [plan.memory.activations[row.pp] for row in rows]
    again = Plan.from_json(json.loads(json.dumps(plan.to_json())))
    assert again == plan and again.memory == plan.memory
    assert _plan(model=False).memory is None  # nothing to count without the model


def test_live_bytes_counts_storages_alive_at_once() -> None:
    mode = LiveBytes()
    kept = torch.zeros(1024)  # 4 KiB, made before the counter: counted once `track` is given it
    mode.track([kept, kept[:10]])  # a view of a counted storage counts once
    assert mode.live == 4096
    with mode:
        a = kept + 1  # 4 KiB more
        b = a * 2  # and 4 more: 12 KiB alive
        del a, b  # freed
        c = kept.sum()  # a scalar
    assert mode.peak == 3 * 4096 and mode.at.endswith(": mul")
    assert mode.live == 4096 + c.untyped_storage().nbytes()


def test_the_tracker_stops_after_its_steps() -> None:
    tracker = MemoryTracker(torch.device("cpu"), 0, steps=1)
    tracker.start()
    x = torch.ones(256) * 2  # 1 KiB, and 1 KiB of ones alive while it is made
    tracker.after_step(1)  # stops counting
    y = torch.ones(4096) * 2  # not counted
    m = tracker.result()
    assert (m.peak, tracker.steps) == (2048, 1) and x.numel() + y.numel() > 0


def test_the_report_holds_the_measurement_against_the_plan() -> None:
    plan = _plan()
    assert plan.memory is not None
    predicted = plan.memory.peak
    measured = [MeasuredMemory(r, predicted[r] // 2, 0, "forward / backward: mm", "live tensor bytes") for r in (1, 0)]
    rows = memory_report.rows(plan, measured)
    assert [(r.rank, r.pp, r.predicted) for r in rows] == [(0, 0, predicted[0]), (1, 1, predicted[1])]
    assert all(r.error == pytest.approx(1.0, abs=1e-6) for r in rows)
    text = "\n".join(memory_report.lines(plan, measured, 2))
    assert "over 2 step(s)" in text and "+100.0%" in text and "forward / backward: mm" in text


@pytest.mark.distributed
def test_run_memory_trace_prints_predicted_against_measured(tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = ["run", str(TINY_CPU), "--nproc", "2", "--out", str(out), "--memory-trace", "--set", "train.steps=2"]
    for s in PP2:
        args += ["--set", s]
    proc, _ = run_cmd(args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "memory: each rank's peak over 2 step(s), measured = live tensor bytes" in proc.stdout
    data = json.loads((out / "memory.json").read_text())
    plan = Plan.from_json(json.loads((out / "plan.json").read_text()))
    assert plan.memory is not None and data["steps"] == 2 and data["traced"]
    ranks = data["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert r["predicted_bytes"] == plan.memory.peak[r["pp"]]  # the plan's figure, not re-derived
        assert r["measured_bytes"] > r["state_at_start_bytes"] > 0
        # docs/memory.md: the tiny specs are within 15 % on CPU; a loose bound here
        assert abs(r["predicted_bytes"] - r["measured_bytes"]) <= 0.3 * r["measured_bytes"], r
        assert f"{r['measured_bytes'] / 2**20:.1f} MiB" in proc.stdout
