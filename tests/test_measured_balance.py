"""`pipeline { balance = measured, profile = "file" }`: stages split on a measured cost profile, and
the step time it predicts in the plan (issue 13). Goldens of its diagnostics: tests/golden/E031[346]_*."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

from ppdsl.dsl.check import check_file, check_text
from ppdsl.lowering.costs import CostProfile, Layout, Linear, PartCost, predict
from ppdsl.lowering.lower import lower
from ppdsl.lowering.plan import Plan

ROOT = Path(__file__).resolve().parent.parent
GOLDEN_PROFILE = ROOT / "tests" / "golden" / "data" / "profile_tiny.json"
TINY_BLOCK_PARAMS = 49408  # one block of specs/tiny_cpu.ppspec's decoder (dim 64)


def part(c: float, params: int = TINY_BLOCK_PARAMS) -> PartCost:
    return PartCost(Linear(0.0, c), Linear(0.0, c), Linear(0.0, c), Linear(0.0, 100.0), params)


def write_profile(path: Path, costs: tuple[float, ...], seq_len: int = 32) -> Path:
    base = CostProfile.load(GOLDEN_PROFILE)
    return attrs.evolve(base, blocks=tuple(part(c) for c in costs), seq_len=seq_len).save(path)


def spec_text(pipeline: str, pp: int = 2) -> str:
    return f"""ppspec 1
model tiny {{
  source = python("ppdsl.models.decoder:build_decoder")
  config {{ vocab_size = 128, dim = 64, n_layers = 4, n_heads = 4, max_seq_len = 64 }}
}}
mesh {{ pp = {pp} }}
pipeline {{
  microbatches = 4
  {pipeline}
}}
train {{
  global_batch = 8
  seq_len = 32
}}
"""


def plan_of(tmp_path: Path, pipeline: str, world: int = 2, pp: int = 2) -> Plan:
    spec = tmp_path / "m.ppspec"
    spec.write_text(spec_text(pipeline, pp), encoding="utf-8")
    result = check_file(spec, world=world, model=False)
    assert result.ok, result.diagnostics
    return lower(result.spec, world)


def test_measured_balance_splits_on_the_profile_not_on_parameters(tmp_path: Path) -> None:
    write_profile(tmp_path / "p.json", (3.0, 3.0, 1.0, 1.0))
    plan = plan_of(tmp_path, 'balance = measured\n  profile = "p.json"')
    # per microbatch of 2 samples: blocks cost 18, 18, 6, 6 s; [0:1 | 1:4] = 18 | 30 beats 36 | 12
    assert [(s.block_start, s.block_stop) for s in plan.stages] == [(0, 1), (1, 4)]
    assert plan.predicted is not None and plan.predicted.stage_s == pytest.approx((18.0, 30.0))
    # parameters are equal per block: the parameter-count balance splits evenly
    assert [(s.block_start, s.block_stop) for s in plan_of(tmp_path, "balance = cost").stages] == [(0, 2), (2, 4)]


def test_the_split_follows_the_costs(tmp_path: Path) -> None:
    write_profile(tmp_path / "p.json", (1.0, 1.0, 1.0, 5.0))
    plan = plan_of(tmp_path, 'balance = measured\n  profile = "p.json"')
    assert [(s.block_start, s.block_stop) for s in plan.stages] == [(0, 3), (3, 4)]


def test_the_prediction_is_the_tune_cost_model_on_the_plan_split(tmp_path: Path) -> None:
    profile = CostProfile.load(write_profile(tmp_path / "p.json", (3.0, 3.0, 1.0, 1.0)))
    plan = plan_of(tmp_path, 'balance = even\n  profile = "p.json"')  # a profile predicts whatever the balance
    assert [(s.block_start, s.block_stop) for s in plan.stages] == [(0, 2), (2, 4)]
    want = predict(profile, Layout(1, 2, 1, "1f1b", 1, 4), 8, 2, split=((0, 2), (2, 4)))
    got = plan.predicted
    assert got is not None
    assert (got.step_s, got.pipeline_s, got.bubble, got.stage_s) == (want.step_s, want.pipeline_s, want.bubble, want.stage_s)
    assert got.profile == str(tmp_path / "p.json")


def test_the_plan_carries_the_prediction_through_json_and_none_without_a_profile(tmp_path: Path) -> None:
    write_profile(tmp_path / "p.json", (3.0, 3.0, 1.0, 1.0))
    plan = plan_of(tmp_path, 'balance = measured\n  profile = "p.json"')
    assert Plan.from_json(plan.to_json()) == plan
    assert plan_of(tmp_path, "balance = even").predicted is None


def test_a_profile_path_is_relative_to_the_spec_and_confined_under_no_model(tmp_path: Path) -> None:
    (tmp_path / "runs").mkdir()
    write_profile(tmp_path / "runs" / "p.json", (1.0, 1.0, 1.0, 1.0))
    (tmp_path / "sub").mkdir()
    spec = tmp_path / "sub" / "m.ppspec"
    spec.write_text(spec_text('balance = measured\n  profile = "../runs/p.json"'), encoding="utf-8")
    codes = [d.code for d in check_file(spec, world=2, model=False).diagnostics]
    assert codes == ["E0419"]
    assert check_file(spec, world=2, model=False, allow_paths=(str(tmp_path / "runs"),)).ok


def test_a_profile_of_another_width_is_refused_with_the_model_built(tmp_path: Path) -> None:
    if importlib.util.find_spec("torch") is None:
        pytest.skip("needs torch")
    path = tmp_path / "p.json"
    base = CostProfile.load(GOLDEN_PROFILE)
    attrs.evolve(base, blocks=tuple(part(1.0, params=7) for _ in range(4))).save(path)
    spec = tmp_path / "m.ppspec"
    spec.write_text(spec_text('balance = measured\n  profile = "p.json"'), encoding="utf-8")
    result = check_file(spec, world=2, model=True)
    assert [d.code for d in result.diagnostics if d.is_error] == ["E0316"]
    assert "block 0 of the cost profile has 7 parameters" in result.diagnostics[0].message


def test_balance_measured_needs_a_profile() -> None:
    result = check_text(spec_text("balance = measured"), world=2)
    assert [d.code for d in result.diagnostics] == ["E0313"]


def test_check_plan_and_schedule_from_the_cli(tmp_path: Path) -> None:
    write_profile(tmp_path / "profile.json", (3.0, 3.0, 1.0, 1.0))
    spec = tmp_path / "m.ppspec"
    spec.write_text(spec_text('balance = measured\n  profile = "profile.json"'), encoding="utf-8")

    def ppdsl(*args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "ppdsl", *args], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout

    assert "ok for world = 2" in ppdsl("check", str(spec), "--world", "2")
    plan = ppdsl("plan", str(spec), "--world", "2")
    # 1F1B on 2 stages: stage 1 busy 4 x 30 s, plus stage 0's first F (6 s) and last B + W (12 s)
    assert "predicted step 138000.0 ms from the measured profile" in plan
    assert "F + B + W per microbatch and virtual stage: 0: 18000.00 ms, 1: 30000.00 ms" in plan
    assert "predicted step 138000.0 ms" in ppdsl("schedule", str(spec), "--world", "2")


# ---- zero-bubble orders on measured costs ---------------------------------------------------

ZB_CASES = [("zbh1", 2, 4, 1), ("zbh1", 4, 8, 1), ("zbh1", 3, 2, 1), ("zbv", 2, 4, 2), ("zbv", 4, 8, 2),
            ("zbv", 3, 3, 2), ("interleaved_zb", 2, 4, 2), ("interleaved_zb", 2, 6, 3)]


def _cost_of(costs: list[tuple[float, float, float]]):
    from ppdsl.core.schedules import Op

    return lambda a: costs[a.stage][{Op.F: 0, Op.B: 1, Op.W: 2}[a.op]]


@pytest.mark.parametrize("style,pp,m,v", ZB_CASES)
def test_zero_bubble_orders_on_measured_costs_are_complete_and_keep_the_memory_caps(style: str, pp: int, m: int,
                                                                                    v: int) -> None:
    import random

    from ppdsl.core.schedules import generate
    from ppdsl.core.schedules.simulate import simulate

    rng = random.Random(f"{style}{pp}{m}{v}")
    unit = generate(style, pp, m, v)
    cap = max(simulate(unit).peak_activations) if style != "interleaved_zb" else (v + 1) * pp - 1
    for _ in range(5):
        costs = [(rng.uniform(0.5, 3), rng.uniform(0.5, 3), rng.uniform(0.1, 2)) for _ in range(pp * v)]
        timed = generate(style, pp, m, v, costs)
        sim = simulate(timed, _cost_of(costs))
        assert sim.ok, sim.problems
        assert max(sim.peak_activations) <= cap
        assert timed.stage_ranks == unit.stage_ranks and timed.split_backward


def test_a_measured_order_beats_the_unit_order_where_costs_differ() -> None:
    from ppdsl.core.schedules import generate
    from ppdsl.core.schedules.simulate import simulate

    costs = [(2.0, 1.5, 0.5)] * 4  # F slower than B, W cheap: the unit order waits on forwards
    cost = _cost_of(costs)
    assert simulate(generate("zbv", 2, 4, 2, costs), cost).makespan == 34.5
    assert simulate(generate("zbv", 2, 4, 2), cost).makespan == 39.0


def test_the_plan_of_a_zbv_spec_with_a_profile_holds_the_measured_order(tmp_path: Path) -> None:
    from ppdsl.core.schedules import generate

    base = CostProfile.load(GOLDEN_PROFILE)
    blocks = tuple(PartCost(Linear(0.0, 2.0), Linear(0.0, 1.5), Linear(0.0, 0.5), Linear(0.0, 100.0),
                            TINY_BLOCK_PARAMS) for _ in range(4))
    attrs.evolve(base, blocks=blocks).save(tmp_path / "p.json")
    plan = plan_of(tmp_path, 'style = zbv\n  chunks = 2\n  balance = measured\n  profile = "p.json"')
    assert plan.predicted is not None and plan.predicted.cost_ordered
    assert plan.schedule != generate("zbv", 2, 4, 2)
    assert "actions ordered on the measured costs" in plan.predicted.lines()[0]
    # a unit-cost profile keeps the unit order, bit for bit
    flat = tuple(PartCost(Linear(0.0, 1.0), Linear(0.0, 1.0), Linear(0.0, 1.0), Linear(0.0, 100.0),
                          TINY_BLOCK_PARAMS) for _ in range(4))
    attrs.evolve(base, blocks=flat).save(tmp_path / "p.json")
    plan = plan_of(tmp_path, 'style = zbv\n  chunks = 2\n  balance = measured\n  profile = "p.json"')
    assert plan.schedule == generate("zbv", 2, 4, 2) and plan.predicted is not None
    assert not plan.predicted.cost_ordered


def test_a_replayed_block_never_sees_the_forwards_cache() -> None:
    """runtime.train.profile replays each block on the arguments the model's forward gave it; a key/value
    cache among them (transformers' DynamicCache) would grow with every replay (`ppdsl tune` on a
    Llama spec died in the attention's mask add), so it is replaced by None."""
    import torch

    from ppdsl.runtime.train.profile import _Replay

    class DynamicCache:
        pass

    seen: list[object] = []

    class Block(torch.nn.Module):
        def forward(self, x: torch.Tensor, past_key_values: object = None) -> torch.Tensor:
            seen.append(past_key_values)
            return x * 2

    replay = _Replay(Block(), (torch.ones(2, 3),), {"past_key_values": DynamicCache()})
    out, x = replay.forward()
    assert seen == [None] and x is not None and torch.equal(out, torch.full((2, 3), 2.0))
