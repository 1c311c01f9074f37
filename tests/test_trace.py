"""Traces: `ppdsl run --trace` writes a Chrome trace that runs the plan, bubbles in metrics.jsonl,
and `ppdsl schedule --measured` draws it beside the planned schedule."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from _run_helpers import run_cmd, tiny_cpu_spec
from ppdsl.lowering.plan import Plan
from ppdsl.core.schedules import generate
from ppdsl.core.schedules.ir import Schedule
from ppdsl.core.trace_format import COMPUTE, Event, RankTrace, StepTrace, chrome_trace, pipeline_bubble
from ppdsl.views.trace import check_trace, measured_sim, traced_steps

SVG = "{http://www.w3.org/2000/svg}"


def fake_trace(schedule: Schedule, steps: int = 2, *, gap_ns: int = 1000) -> dict:
    """Every rank runs its plan list back to back, one microsecond per action."""
    ranks = []
    for r, actions in enumerate(schedule.ranks):
        recorded, t = [], 0
        for step in range(1, steps + 1):
            start = t
            events = []
            for a in actions:
                events.append(Event(a.op.value, a.stage, a.microbatch, t, t + gap_ns))
                t += gap_ns
            events.append(Event("pipeline", -1, -1, start, t))
            recorded.append(StepTrace(step, start, t, tuple(events)))
        ranks.append(RankTrace(r, {"dp": 0, "pp": r, "tp": 0}, tuple(recorded)))
    return chrome_trace(ranks)


def test_a_trace_of_the_plan_passes_and_each_fault_is_named() -> None:
    schedule = generate("zbv", 2, 4, 2)
    trace = fake_trace(schedule)
    assert check_trace(trace, schedule, [1, 2]) == []
    # the JSON round trip is what a file gives back
    assert check_trace(json.loads(json.dumps(trace)), schedule, traced_steps(trace)) == []

    def compute(tr: dict, rank: int, step: int) -> list[dict]:
        return [e for e in tr["traceEvents"] if e["ph"] == "X" and e.get("tid") == COMPUTE and e["pid"] == rank and e["args"]["step"] == step]

    missing = fake_trace(schedule)
    missing["traceEvents"].remove(compute(missing, 1, 2)[3])
    assert any("step 2 rank 1" in p for p in check_trace(missing, schedule, [1, 2]))

    swapped = fake_trace(schedule)
    a, b = compute(swapped, 0, 1)[:2]
    a["ts"], b["ts"] = b["ts"], a["ts"]
    problems = check_trace(swapped, schedule, [1, 2])
    assert len(problems) == 1 and "step 1 rank 0" in problems[0] and "#0" in problems[0]

    overlapping = fake_trace(schedule)
    compute(overlapping, 1, 1)[0]["dur"] = 2.5  # runs into the next action
    assert any("before" in p for p in check_trace(overlapping, schedule, [1, 2]))


def test_bubble_and_measured_sim() -> None:
    step = StepTrace(1, 0, 1000, (Event("F", 0, 0, 100, 400), Event("B", 0, 0, 500, 900),
                                  Event("pipeline", -1, -1, 0, 1000), Event("optimizer", -1, -1, 950, 1000)))
    assert pipeline_bubble(step) == pytest.approx(0.3)
    schedule = generate("1f1b", 2, 2, 1)
    sim = measured_sim(fake_trace(schedule), schedule, 2)
    assert sim.ok and sim.makespan == pytest.approx(0.004)  # 4 actions of 1 us, in ms
    with pytest.raises(ValueError, match="step 3 is not in the trace"):
        measured_sim(fake_trace(schedule), schedule, 3)


@pytest.mark.distributed
def test_run_trace_runs_the_plan_and_schedule_measured_draws_it(tmp_path: Path) -> None:
    """Two pipeline ranks on zero bubble V (F, B and W on two chunks a rank), as a user runs it."""
    spec = tiny_cpu_spec(tmp_path, "traced", steps=3, every=None)
    out = tmp_path / "run"
    proc, _ = run_cmd(["run", str(spec), "--set", "mesh.tp=1", "--set", "pipeline.style=zbv",
                       "--set", "pipeline.chunks=2", "--set", "train.save_final=false", "--nproc", "2",
                       "--out", str(out), "--trace"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "trace: " in proc.stdout
    plan = Plan.from_json(json.loads((out / "plan.json").read_text()))
    trace = json.loads((out / "trace.json").read_text())
    assert traced_steps(trace) == [1, 2, 3]
    assert check_trace(trace, plan.schedule, [1, 2, 3]) == []
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {"rank 0 (pp 0, tp 0, dp 0)", "rank 1 (pp 1, tp 0, dp 0)"}
    kinds = {e["name"].split(" s")[0] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert {"optimizer", "wait", "p2p", "loss all-reduce", "pipeline"} <= kinds
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [len(r["bubble"]) for r in records] == [2, 2, 2]
    assert all(0.0 <= b < 1.0 for r in records for b in r["bubble"])

    svg_path = tmp_path / "measured.svg"
    proc, _ = run_cmd(["schedule", "--measured", str(out), "--format", "svg", "-o", str(svg_path)])
    assert proc.returncode == 0, proc.stderr
    root = ET.fromstring(svg_path.read_text())
    boxes = [r for r in root.iter(f"{SVG}rect") if r.get("class") == "action"]
    assert len(boxes) == 2 * sum(len(acts) for acts in plan.schedule.ranks)  # planned + measured
    titles = [t.text or "" for t in root.iter(f"{SVG}text")]
    assert any(t.startswith("planned") for t in titles) and any(t.startswith("measured step 3") for t in titles)

    proc, _ = run_cmd(["schedule", "--measured", str(tmp_path), "--format", "text"])
    assert proc.returncode == 2 and "plan.json" in proc.stderr and "Traceback" not in proc.stderr
