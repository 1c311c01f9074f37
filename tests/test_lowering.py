"""Lowering: stage assignment goldens and properties, mesh layout, TP policy, plan JSON."""

from __future__ import annotations

import json
import random

import pytest

from ppdsl.dsl.check import check_text
from ppdsl.lowering.lower import lower
from ppdsl.lowering.plan import MeshLayout, Plan
from ppdsl.lowering.stages import check_ranges, cost_split, even_split

SPEC = """ppspec 1
model m {
  source = python("ppdsl.models.decoder:build_decoder")
  config { vocab_size = 128, dim = 64, n_layers = %(layers)d, n_heads = 4, max_seq_len = 64 }
}
mesh { tp = %(tp)d, pp = %(pp)d }
tensor_parallel {
  layers[*].attention.wq : column
  layers[*].attention.wo : row
  output : column
}
pipeline { style = %(style)s, chunks = %(chunks)d, microbatches = %(m)d %(extra)s }
train { global_batch = %(gb)d, seq_len = 16 }
"""


def _plan(world: int, layers: int = 8, tp: int = 1, pp: int = 2, style: str = "1f1b", chunks: int = 1, m: int = 4,
          gb: int | None = None, extra: str = "") -> Plan:
    gb = gb or m * (world // (tp * pp))
    text = SPEC % dict(layers=layers, tp=tp, pp=pp, style=style, chunks=chunks, m=m, gb=gb, extra=extra)
    result = check_text(text, "t.ppspec", world=world)
    assert result.ok, result.diagnostics
    return lower(result.spec, world)


def test_even_split_13_blocks_on_4_stages():
    assert even_split(13, 4) == [(0, 3), (3, 7), (7, 10), (10, 13)]


def test_even_split_24_blocks_on_8_virtual_stages():
    assert even_split(24, 8) == [(i * 3, i * 3 + 3) for i in range(8)]


def test_even_split_refuses_empty_stage():
    with pytest.raises(AssertionError, match="E0308"):  # check refuses it first: a bug if lowering meets it
        even_split(3, 4)


def test_cost_split_gives_embedding_stages_fewer_blocks():
    ranges = cost_split([1.0] * 16, 4, first_cost=2.0, last_cost=2.0)
    sizes = [b - a for a, b in ranges]
    assert sum(sizes) == 16 and sizes[0] < sizes[1] and sizes[-1] < sizes[1]


@pytest.mark.parametrize("seed", range(200))
def test_split_properties(seed: int):
    rng = random.Random(seed)
    stages = rng.randint(1, 16)
    blocks = rng.randint(stages, 64)
    for ranges in (even_split(blocks, stages),
                   cost_split([rng.random() + 0.1 for _ in range(blocks)], stages, rng.random() * 5, rng.random() * 5)):
        check_ranges(ranges, blocks, stages)  # every block exactly once, in order, none empty
        sizes = [b - a for a, b in ranges]
        assert min(sizes) >= 1
    sizes = [b - a for a, b in even_split(blocks, stages)]
    assert max(sizes) - min(sizes) <= 1


def test_loop_placement_interleaved():
    plan = _plan(world=4, layers=8, pp=4, style="interleaved", chunks=2, m=8)
    assert [(s.stage, s.rank, s.chunk, s.block_start, s.block_stop) for s in plan.stages] == [
        (0, 0, 0, 0, 1), (1, 1, 0, 1, 2), (2, 2, 0, 2, 3), (3, 3, 0, 3, 4),
        (4, 0, 1, 4, 5), (5, 1, 1, 5, 6), (6, 2, 1, 6, 7), (7, 3, 1, 7, 8)]
    assert plan.stages[0].first == ("tok_embeddings", "pos_embeddings")
    assert plan.stages[-1].last == ("norm", "output")


def test_v_placement_zbv():
    plan = _plan(world=4, layers=8, pp=4, style="zbv", chunks=2, m=8)
    assert [s.rank for s in plan.stages] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert plan.stages_of(0)[0].first and plan.stages_of(0)[1].last  # loss is computed on rank 0


def test_explicit_split_is_used_as_written():
    plan = _plan(world=2, layers=8, pp=2, extra=", split = [0:5, 5:8]")
    assert [(s.block_start, s.block_stop) for s in plan.stages] == [(0, 5), (5, 8)]


def test_explicit_split_with_chunks_one_range_per_virtual_stage():
    plan = _plan(world=2, layers=8, pp=2, style="interleaved", chunks=2, m=4,
                 extra=", split = [0:1, 1:4, 4:6, 6:8]")
    assert [(s.rank, s.block_start, s.block_stop) for s in plan.stages] == [(0, 0, 1), (1, 1, 4), (0, 4, 6), (1, 6, 8)]


def test_mesh_layout_groups():
    mesh = MeshLayout(world=8, dp=2, pp=2, tp=2)
    assert mesh.groups("tp") == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert mesh.groups("pp") == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert mesh.groups("dp") == ((0, 4), (1, 5), (2, 6), (3, 7))
    for r in range(8):
        assert mesh.rank_of(**mesh.coords(r)) == r


def test_tp_policy_expands_patterns_to_paths():
    plan = _plan(world=4, layers=4, tp=2, pp=2)
    paths = {(t.path, t.style) for t in plan.tp}
    assert ("layers.3.attention.wq", "column") in paths and ("layers.0.attention.wo", "row") in paths
    assert ("output", "column") in paths and len(plan.tp) == 9


def test_no_tp_policy_when_tp_is_one():
    assert _plan(world=2, layers=4, tp=1, pp=2).tp == ()


def test_plan_json_round_trip():
    plan = _plan(world=8, layers=8, tp=2, pp=2, style="zbv", chunks=2, m=4)
    data = json.loads(json.dumps(plan.to_json()))
    assert Plan.from_json(data) == plan


def test_train_plan_batch_arithmetic():
    plan = _plan(world=8, layers=8, tp=1, pp=2, m=4, gb=32)
    assert (plan.mesh.dp, plan.schedule.microbatches, plan.train.microbatch_size) == (4, 4, 2)
