"""train.zero: what check accepts (E0315, W0317), the model-state bytes per rank under each ZeRO
stage (lowering.memory), and how `ppdsl plan` and `ppdsl tune` use them. Pure Python."""

from __future__ import annotations

import pytest

from ppdsl.dsl.check import check_text
from ppdsl.dsl.introspect import ModelInfo, ModuleInfo
from ppdsl.lowering.costs import CommModel, CostProfile, Layout, Linear, PartCost, predict
from ppdsl.lowering.lower import lower
from ppdsl.lowering.memory import (
    BYTES, WHOLE_BLOCKS, ZERO_STAGES, Resharded, dp_collectives, dp_traffic_bytes, optimizer_slots, resharded,
    state_bytes,
)
from ppdsl.views.report import plan_report
from ppdsl.tune import candidate_layouts, layout_memory, model_state_of

SPEC = """ppspec 1
model tiny {
  source = python("ppdsl.models.decoder:build_decoder")
  config { vocab_size = 128, dim = 64, n_layers = 4, n_heads = 4, max_seq_len = 64 }
}
mesh { pp = 2 }
pipeline { style = 1f1b, microbatches = 2 }
train { global_batch = 8, seq_len = 32, zero = ZERO, optimizer = OPT }
"""


def spec(zero: int = 0, opt: str = "adamw") -> str:
    return SPEC.replace("ZERO", str(zero)).replace("OPT", opt)


def codes(result) -> list[str]:
    return [d.code for d in result.diagnostics]


# ---- the figures -------------------------------------------------------------------------------


def test_optimizer_state_depends_on_the_optimizer() -> None:
    assert optimizer_slots("adamw") == optimizer_slots("adam") == 2
    assert optimizer_slots("sgd", momentum=0.9) == 1
    assert optimizer_slots("sgd") == 0
    with pytest.raises(ValueError):
        optimizer_slots("lion")


def test_state_bytes_under_each_stage() -> None:
    p, dp = 1000, 4
    full, shard = p * BYTES, p * BYTES // dp
    zero0 = state_bytes(p, dp, 0, 2)
    assert (zero0.weights, zero0.grads, zero0.optimizer) == (full, full, 2 * full)
    assert zero0.at_rest == zero0.peak == 4 * full
    zero1 = state_bytes(p, dp, 1, 2)
    assert (zero1.weights, zero1.grads, zero1.optimizer) == (full, full, 2 * shard)
    assert zero1.at_rest == full + shard + 2 * shard  # only the owned gradients stay after the reduce-scatter
    zero3 = state_bytes(p, dp, 3, 2)
    # in the step: the whole weights and gradients of the rank's stages besides its shards
    assert (zero3.weights, zero3.grads, zero3.optimizer) == (full + shard, full, 2 * shard)
    assert zero3.at_rest == 4 * shard  # between steps: only shards
    assert zero3.peak < zero0.peak and zero1.peak < zero0.peak
    assert zero3.peak == zero1.peak + shard  # in the step zero 3 also keeps its weight shard
    assert zero3.at_rest < zero1.at_rest
    # Adam at dp = 2: at rest half of the replicas' state
    assert state_bytes(p, 2, 3, 2).at_rest == state_bytes(p, 2, 0, 2).peak // 2


def test_nothing_is_sharded_over_one_rank_or_without_optimizer_state() -> None:
    for zero in ZERO_STAGES:
        assert state_bytes(1000, 1, zero, 2) == state_bytes(1000, 1, 0, 2)
    # sgd without momentum: no state to shard, the same peak (at rest only the owned gradients stay)
    assert state_bytes(1000, 4, 1, 0).peak == state_bytes(1000, 4, 0, 0).peak


def test_dp_traffic_is_the_same_volume_under_every_stage() -> None:
    for zero in ZERO_STAGES:
        assert dp_traffic_bytes(1000, 4, zero) == 2 * 1000 * BYTES * 3 // 4
        assert dp_traffic_bytes(1000, 1, zero) == 0
    assert "reduce-scatter" in dp_collectives(3) and "all-gather" in dp_collectives(3)
    assert dp_collectives(0) == "gradient all-reduce"


# ---- check ---------------------------------------------------------------------------------------


def test_zero_3_is_accepted() -> None:
    result = check_text(spec(3), "z.ppspec", 4)
    assert result.ok and codes(result) == []


@pytest.mark.parametrize("zero", [2, 4, 7])
def test_other_stages_are_e0315_with_a_hint(zero: int) -> None:
    result = check_text(spec(zero), "z.ppspec", 4)
    [d] = result.diagnostics
    assert d.code == "E0315" and d.message == f"zero = {zero} is not a ZeRO stage ppdsl runs: use 0, 1 or 3"
    assert d.span is not None and d.span.line == 8
    if zero == 2:  # why there is no ZeRO-2 under a pipeline
        assert "reduce-scatter after every microbatch" in d.hint and "use zero = 1" in d.hint
    else:
        assert "3: weights, gradients and optimizer state sharded over dp (FSDP2)" in d.hint


@pytest.mark.parametrize("zero", [1, 3])
def test_w0317_when_dp_is_1_at_the_given_world(zero: int) -> None:
    result = check_text(spec(zero), "z.ppspec", 2)  # pp = 2: dp = 1
    assert result.ok
    [d] = result.diagnostics
    assert d.code == "W0317" and d.severity.value == "warning"
    assert f"zero = {zero} shards" in d.message and "but dp = 1: there is nothing to shard" in d.message
    assert check_text(spec(zero), "z.ppspec", 4).diagnostics == ()  # dp = 2


def test_w0317_with_the_world_left_free_names_the_world_sizes() -> None:
    result = check_text(spec(3), "z.ppspec")  # dp = world / 2, 8 / (dp * 2) whole: worlds 2, 4, 8
    assert result.ok and result.valid_worlds == (2, 4, 8)
    [d] = result.diagnostics
    assert d.code == "W0317" and "dp = 1 for world = 2" in d.message
    fixed = SPEC.replace("mesh { pp = 2 }", "mesh { pp = 2, dp = 1 }")
    [d] = check_text(fixed.replace("ZERO", "1").replace("OPT", "adamw"), "z.ppspec").diagnostics
    assert "but dp = 1: there" in d.message  # every size that works has dp = 1
    bigger = SPEC.replace("mesh { pp = 2 }", "mesh { pp = 2, dp = 2 }")
    assert check_text(bigger.replace("ZERO", "3").replace("OPT", "adamw"), "z.ppspec").diagnostics == ()


def test_w0317_for_zero_1_with_an_optimizer_without_state() -> None:
    [d] = check_text(spec(1, "sgd(lr = 0.1)"), "z.ppspec", 4).diagnostics
    assert d.code == "W0317" and "sgd without momentum keeps none" in d.message
    assert check_text(spec(1, "sgd(lr = 0.1, momentum = 0.9)"), "z.ppspec", 4).diagnostics == ()
    assert check_text(spec(3, "sgd(lr = 0.1)"), "z.ppspec", 4).diagnostics == ()  # weights and grads still shard


def test_no_w0317_for_zero_0_or_a_spec_with_errors() -> None:
    assert check_text(spec(0), "z.ppspec", 2).diagnostics == ()
    broken = spec(3).replace("microbatches = 2", "microbatches = 3")
    assert "W0317" not in codes(check_text(broken, "z.ppspec", 2))


# ---- ppdsl plan ------------------------------------------------------------------------------------


def _module(path: str, params: int, children: tuple[str, ...] = ()) -> ModuleInfo:
    return ModuleInfo(path, "Module", "other", None, None, None, None, False, params, params * 4, children)


def fake_info() -> ModelInfo:
    """The tiny decoder's module tree with round parameter counts."""
    mods = {"": _module("", 0, ("tok_embeddings", "pos_embeddings", "layers", "norm", "output")),
            "layers": _module("layers", 0, ("0", "1", "2", "3"))}
    for i in range(4):
        mods[f"layers.{i}"] = _module(f"layers.{i}", 1000)
    mods.update({"tok_embeddings": _module("tok_embeddings", 500), "pos_embeddings": _module("pos_embeddings", 500),
                 "norm": _module("norm", 100), "output": _module("output", 900)})
    return ModelInfo("Decoder", mods, {"dim": 64}, (), sum(m.num_params for m in mods.values()))


def report(zero: int, world: int = 4, opt: str = "adamw"):
    text = spec(zero, opt).replace("global_batch = 8", f"global_batch = {2 * world}")
    result = check_text(text, "z.ppspec", world)
    assert result.ok, result.diagnostics
    return plan_report(lower(result.spec, world, None), fake_info(), 64)


def test_plan_breaks_memory_down_under_the_specs_zero() -> None:
    r0, r3 = report(0), report(3)
    for a, b in zip(r0.rows, r3.rows):
        params = 3000  # 2 blocks + the first (or last) modules
        assert a.params == b.params == params
        assert (a.weight_bytes, a.grad_bytes, a.optimizer_bytes) == (4 * params, 4 * params, 8 * params)
        assert (b.weight_bytes, b.grad_bytes, b.optimizer_bytes) == (6 * params, 4 * params, 4 * params)
        # the peak is the forward's (lowering/rank_memory.pipeline_peak): on pp rank 0 both
        # microbatches are in flight before its first backward (no gradients yet), the last
        # rank's second forward runs with the first one's gradients
        grads = 0 if a.pp == 0 else 4 * params
        assert a.memory_bytes == 12 * params + grads + a.activation_bytes == a.replica_bytes
        assert b.memory_bytes == 10 * params + grads + b.activation_bytes  # zero 3 at dp = 2: whole weights + shard
        assert b.rest_bytes == 8 * params and b.replica_bytes == a.memory_bytes
        assert a.dp_bytes == b.dp_bytes == 2 * params * 4 // 2
    text0, text3 = r0.render(), r3.render()
    assert "replicas" not in text0 and "at rest" not in text0
    head = next(line for line in text3.splitlines() if line.startswith("rank"))
    assert head.split()[6:15] == ["params", "weights", "grads", "optim", "activ", "memory", "replicas", "at",
                                  "rest"]
    assert "weights, grads and optimizer state sharded over dp (FSDP2)" in text3
    assert "dp/step = weight all-gather + gradient reduce-scatter, once per step" in text3
    assert "dp/step = gradient all-reduce" in text0


def test_plan_drop_grows_with_dp_and_uses_the_optimizer() -> None:
    r8 = report(3, world=16)  # dp 8
    row = r8.rows[0]
    assert row.memory_bytes < row.replica_bytes
    sgd = report(0, opt="sgd")
    assert sgd.rows[0].optimizer_bytes == 0 and "sgd without momentum: none" in sgd.render()
    momentum = report(1, opt="sgd(momentum = 0.9)")
    assert momentum.rows[0].optimizer_bytes == 4 * 3000 // 2
    assert "zero 1: optimizer state sharded over dp" in momentum.render()


def test_plan_json_has_the_breakdown() -> None:
    data = report(3).to_json()
    rank = data["ranks"][0]
    assert {"weight_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes", "rest_bytes",
            "replica_bytes"} <= set(rank)


def test_plan_without_the_model_shows_question_marks() -> None:
    result = check_text(spec(3), "z.ppspec", 4)
    text = plan_report(lower(result.spec, 4, None), None, 64).render()
    row = next(line for line in text.splitlines() if line.startswith("0 "))
    cells = row.split()[7:15]  # blocks is "0-1 +tok_embeddings+pos_embeddings"
    assert cells[:4] == ["?"] * 4 and cells[4].endswith("KiB") and cells[5:] == ["?"] * 3  # activations known


# ---- ppdsl tune ------------------------------------------------------------------------------------


def _profile() -> CostProfile:
    part = PartCost(Linear(0.0, 1.0), Linear(0.0, 1.0), Linear(0.0, 1.0), Linear(0.0, 100.0), 1000)
    none = PartCost(Linear(0.0, 0.0), Linear(0.0, 0.0), Linear(0.0, 0.0), Linear(0.0, 0.0), 0)
    return CostProfile("test", 32, (1, 8), (part,) * 4, none, none, Linear(0.0, 10.0), 1e-3,
                       CommModel(0.0, 0.0, 0.0, 0.0), 64, "cpu")


def test_tune_predicts_memory_with_the_plans_figures() -> None:
    # tune takes a candidate's memory from its lowered plan (lowering.rank_memory): what ppdsl plan prints
    for zero, opt in ((0, "adamw"), (3, "adamw"), (1, "sgd")):
        result = check_text(spec(zero, opt), "z.ppspec", 4)
        assert layout_memory(result.spec, fake_info(), 4, ((0, 2), (2, 4))) == \
            max(r.memory_bytes for r in report(zero, opt=opt).rows)
    prof = _profile()
    z0 = predict(prof, Layout(1, 2, 2, "gpipe", 1, 2), 8, 4)
    z3 = predict(prof, Layout(1, 2, 2, "gpipe", 1, 2, zero=3), 8, 4)
    assert z3.optimizer_s == pytest.approx(z0.optimizer_s / 2)  # a rank steps its shard only
    assert z3.layout.label().endswith("+z3")


def test_tune_keeps_the_specs_zero() -> None:
    assert all(layout.zero == 3 for layout in candidate_layouts(4, 8, zero=3))
    assert model_state_of(spec(3, "sgd(momentum = 0.9)"), "z.ppspec") == (3, 1)
    assert model_state_of(spec(0), "z.ppspec") == (0, 2)


# ---- zero 3 + reshard_after_forward ----------------------------------------------------------------


def _reshard_spec(zero: int = 3) -> str:
    return spec(zero).replace("zero = ", "reshard_after_forward = true, zero = ")


def test_reshard_after_forward_reaches_the_plan() -> None:
    result = check_text(_reshard_spec(), "z.ppspec", 4)
    assert result.ok and codes(result) == []
    assert lower(result.spec, 4, None).train.reshard_after_forward
    assert not lower(check_text(spec(3), "z.ppspec", 4).spec, 4, None).train.reshard_after_forward


@pytest.mark.parametrize("zero", [0, 1])
def test_w0318_reshard_without_zero_3(zero: int) -> None:
    result = check_text(_reshard_spec(zero), "z.ppspec", 4)
    assert result.ok
    [d] = result.diagnostics
    assert d.code == "W0318" and f"but zero = {zero} keeps every weight whole" in d.message
    assert d.span is not None and d.span.line == 8


def test_reshard_with_dp_1_is_w0317_only() -> None:
    [d] = check_text(_reshard_spec(), "z.ppspec", 2).diagnostics  # pp = 2: dp = 1, nothing gathered
    assert d.code == "W0317"


def test_resharded_state_bytes() -> None:
    # a rank of 2 stages: the first with blocks of 100 and 300 parameters and roots of 50, the other
    # with blocks of 200 and 100 and roots of 30; 4 microbatches
    stages = [([100.0, 300.0], 50.0, True), ([200.0, 100.0], 30.0, False)]
    params, dp = 780, 4
    plain, split = resharded(stages, 4, False), resharded(stages, 4, True)
    assert plain == Resharded(80.0, 300.0, 4 * 2 * 700.0, 4 * 2 * 4)
    assert split == Resharded(80.0, 300.0, 4 * (2 * 400.0 + 3 * 300.0), 4 * (2 * 2 + 3 * 2))
    z3, rf = state_bytes(params, dp, 3, 2), state_bytes(params, dp, 3, 2, plain)
    # the shard, the roots and the 2 largest-block-sized blocks whole; grads whole; optimizer 1/dp
    assert rf.weights == (params / dp + 80 + WHOLE_BLOCKS * 300) * BYTES
    assert (rf.grads, rf.optimizer, rf.at_rest) == (z3.grads, z3.optimizer, z3.at_rest)
    assert rf.peak < z3.peak
    # never more whole weights than the rank has
    assert state_bytes(params, dp, 3, 2, Resharded(80.0, 700.0, 0.0, 0)).weights == z3.weights
    assert state_bytes(params, dp, 1, 2, plain) == state_bytes(params, dp, 1, 2)  # only zero 3 reshards
    # traffic: reduce-scatter of the grads + all-gather of the roots once + the blocks per microbatch
    assert dp_traffic_bytes(params, dp, 3, plain) == int((params + 80 + 5600) * BYTES * 3 // 4)
    assert dp_traffic_bytes(params, dp, 3, plain) > dp_traffic_bytes(params, dp, 3)
    assert dp_traffic_bytes(params, 1, 3, plain) == 0
    assert "per microbatch" in dp_collectives(3, True) and dp_collectives(3) == dp_collectives(3, False)


def test_plan_and_tune_model_resharding() -> None:
    # pp = 1 at world 2: a rank holds the 4 blocks of 1000 parameters and roots of 2000
    plain, rf = (plan_report(lower(check_text(text.replace("mesh { pp = 2 }", "mesh { pp = 1 }"), "z.ppspec", 2).spec,
                                   2, None), fake_info(), 64) for text in (spec(3), _reshard_spec()))
    for a, b in zip(plain.rows, rf.rows):
        assert a.weight_bytes == (6000 + 3000) * BYTES and b.weight_bytes == (2000 + 2 * 1000 + 3000) * BYTES
        assert b.grad_bytes == a.grad_bytes and b.rest_bytes == a.rest_bytes
        # grads reduce-scattered and roots gathered once, 4 blocks gathered twice for each of 2 microbatches
        assert b.dp_bytes == (6000 + 2000 + 2 * 2 * 4000) * BYTES // 2 and a.dp_bytes == 6000 * BYTES
    text = rf.render()
    assert "zero 3 + reshard_after_forward" in text and "2 (F, B) times per microbatch" in text
    z3, rf3 = (layout_memory(check_text(text, "z.ppspec", 4).spec, fake_info(), 4, ((0, 2), (2, 4)))
               for text in (spec(3), _reshard_spec()))
    # 2 blocks of 1000 parameters and roots of 1000 a rank: both blocks may be whole at once, as without resharding
    assert rf3 == z3
    assert all(layout.reshard_after_forward for layout in candidate_layouts(4, 8, zero=3, reshard_after_forward=True))
