"""Text, SVG and JSON views of a simulated schedule."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

from ppdsl.views.schedule_render import render_svg, render_text, schedule_from_json, to_json
from ppdsl.core.schedules import STYLES, generate, style_problem
from ppdsl.core.schedules.ir import Action, Op, Schedule
from ppdsl.core.schedules.simulate import simulate

SVG = "{http://www.w3.org/2000/svg}"


def test_text_grid_1f1b() -> None:
    schedule = generate("1f1b", 4, 8, 1)
    text = render_text(schedule, simulate(schedule))
    lines = text.splitlines()
    rows = [line for line in lines if line.startswith("rank ")]
    assert len(rows) == 4
    assert rows[0].split("|")[1].split()[:5] == ["F0", "F1", "F2", "F3", "."]
    # rank 3 starts after three idle steps, then alternates F and a two-unit B
    assert rows[3].split("|")[1].split()[:7] == [".", ".", ".", "F0", "B0", "--", "F1"]
    assert "bubble: 0.2727" in text
    assert "peak activations: rank 0: 4, rank 1: 3, rank 2: 2, rank 3: 1" in text
    assert "legend:" in text


def test_text_distinguishes_chunks() -> None:
    schedule = generate("zbv", 4, 8, 2)
    text = render_text(schedule, simulate(schedule))
    row0 = next(line for line in text.splitlines() if line.startswith("rank 0"))
    cells = row0.split("|")[1].split()
    assert "F0" in cells and "f0" in cells and "w0" in cells and "W0" in cells
    assert "bubble: 0.0588" in text
    four = generate("interleaved", 2, 2, 4)
    assert "F0:2" in render_text(four, simulate(four))


def test_text_reports_problems() -> None:
    bad = Schedule("hand", 1, 1, 1, False, (0,), ((Action(Op.B, 0, 0), Action(Op.F, 0, 0)),))
    text = render_text(bad, simulate(bad))
    assert "NOT RUNNABLE" in text and "order" in text


@pytest.mark.parametrize(("style", "v"), [("1f1b", 1), ("zbv", 2), ("interleaved", 4), ("zbh1", 1)])
def test_svg_is_xml_with_one_rect_per_action(style: str, v: int) -> None:
    schedule = generate(style, 4, 8, v)
    sim = simulate(schedule)
    svg = render_svg(schedule, sim)
    root = ET.fromstring(svg)
    assert root.tag == f"{SVG}svg"
    actions = [r for r in root.iter(f"{SVG}rect") if r.get("class") == "action"]
    assert len(actions) == sum(len(acts) for acts in schedule.ranks)
    others = [r for r in root.iter(f"{SVG}rect") if r.get("class") != "action"]
    assert all(r.get("class") == "legend" for r in others)
    texts = " ".join(t.text or "" for t in root.iter(f"{SVG}text"))
    assert f"{style}" in texts and "pp=4" in texts and "m=8" in texts and f"v={v}" in texts
    assert f"bubble={sim.bubble:.4f}" in texts
    assert "rank 0" in texts and "rank 3" in texts and "F forward" in texts


def test_json_contract_and_round_trip() -> None:
    for style in STYLES:
        v = 1 if style_problem(style, 4, 8, 1) is None else 2
        schedule = generate(style, 4, 8, v)
        sim = simulate(schedule)
        d = to_json(schedule, sim)
        assert {"style", "pp", "microbatches", "chunks", "ranks", "bubble", "peak_activations"} <= set(d)
        assert (d["style"], d["pp"], d["microbatches"], d["chunks"]) == (style, 4, 8, v)
        assert [r["rank"] for r in d["ranks"]] == [0, 1, 2, 3]
        first = d["ranks"][0]["actions"][0]
        assert set(first) == {"op", "microbatch", "stage"} and first["op"] in ("F", "B", "W")
        assert d["bubble"] == sim.bubble
        assert d["peak_activations"] == list(sim.peak_activations)
        again = schedule_from_json(json.loads(json.dumps(d)))
        assert again == schedule


def test_json_minimal_form_infers_placement_and_split() -> None:
    schedule = generate("zbv", 2, 2, 2)
    d = to_json(schedule, simulate(schedule))
    for extra in ("makespan", "split_backward", "stage_ranks"):
        d.pop(extra)
    assert schedule_from_json(d) == schedule


@pytest.mark.parametrize(
    ("mutate", "fragment"),
    [
        (lambda d: d.pop("style"), "'style'"),
        (lambda d: d.update(pp=0), "'pp' must be a positive integer"),
        (lambda d: d.update(chunks="2"), "'chunks' must be a positive integer"),
        (lambda d: d.update(ranks={}), "'ranks' must be a list"),
        (lambda d: d["ranks"].pop(), "lists 1 ranks"),
        (lambda d: d["ranks"][1].update(rank=0), "repeated"),
        (lambda d: d["ranks"][0]["actions"].append({"op": "X", "microbatch": 0, "stage": 0}), "bad action"),
        (lambda d: d.update(split_backward="yes"), "'split_backward'"),
        (lambda d: d.update(stage_ranks=[0, "a"]), "'stage_ranks'"),
    ],
)
def test_json_errors_are_value_errors(mutate: object, fragment: str) -> None:
    schedule = generate("1f1b", 2, 2, 1)
    d = to_json(schedule, simulate(schedule))
    mutate(d)  # type: ignore[operator]
    with pytest.raises(ValueError, match=fragment):
        schedule_from_json(d)


def test_result_of_another_schedule_is_refused() -> None:
    a, b = generate("1f1b", 2, 2, 1), generate("gpipe", 2, 2, 1)
    with pytest.raises(ValueError, match="different schedule"):
        render_text(a, simulate(b))
