"""Stage building: each rank holds only its part, the parts equal the single-process reference.

In one process: every pipeline rank's stages of a pp=4 plan (1 and 2 chunks) are built and
chained; logits and loss must equal the reference model's bit for bit (CPU, fp32), gradients
within 1e-6 (tied weights: the sum over the stages that hold them). With 2 gloo processes
(tp=2): each family's stage chain matches the reference within 1e-5, gradients are the
reference gradients' shards.
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import torch
import torch.distributed as dist
from torch import nn

from _stage_helpers import (
    FAMILIES,
    MICROBATCH,
    SEQ_LEN,
    chain,
    make_microbatch,
    reference_forward,
    stage_plan,
)
from _tiny_models import HIDDEN, TINY
from dist_harness import run_distributed

from ppdsl.runtime.stage.build import (
    MicroBatch,
    StageModule,
    activation_dtype,
    activation_shape,
    build_reference_model,
    build_stages,
    rank_named_parameters,
    tied_parameter_groups,
    tied_parameter_ranks,
)

pytestmark = pytest.mark.usefixtures("one_thread")

CPU = torch.device("cpu")
SEED = 1234
GRAD_ATOL = 1e-6


def _all_stages(plan: Any, tp_group: Any = None) -> list[StageModule]:
    """Every pipeline stage in this process; ``tp_group``: the tp ranks, each building them all."""
    from ppdsl.runtime.parallel.parallelize import apply_tp

    stages = []
    for rank in range(plan.mesh.pp):  # each pipeline rank's stages, tied as that rank ties them
        built = build_stages(plan, rank, CPU, SEED)
        if tp_group is not None:
            apply_tp(built, plan, tp_group)
        stages += built
    return sorted(stages, key=lambda s: s.stage)


def _canonical(plan: Any) -> dict[str, str]:
    return {name: names[0] for names in plan.model.tied for name in names}


def _summed_grads(stages: list[StageModule], canonical: dict[str, str]) -> dict[str, torch.Tensor]:
    """Gradient per canonical parameter name, summed over every distinct Parameter holding it."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for stage in stages:
        for name, p in stage.named_parameters(remove_duplicate=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            key = canonical.get(name, name)
            out[key] = p.grad.clone() if key not in out else out[key] + p.grad
    return out


def _reference_grads(ref: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in ref.named_parameters()}


# ---------------------------------------------------------------------------------------------
# One process, tp = 1
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunks", [1, 2])
@pytest.mark.parametrize("family", FAMILIES)
def test_stage_chain_equals_reference(family: str, chunks: int) -> None:
    plan = stage_plan(family, "gpipe" if chunks == 1 else "interleaved", pp=4)
    ref = build_reference_model(plan.model, CPU, SEED)
    stages = _all_stages(plan)
    assert [s.stage for s in stages] == list(range(4 * chunks))

    # The union of the parts is the reference model, bit for bit, each parameter held once.
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    held: list[str] = []
    for stage in stages:
        for name, p in stage.named_parameters():
            assert torch.equal(p, ref_params[name]), name
            held.append(name)
    assert sorted(held) == sorted(ref_params)

    mb = make_microbatch(family, padded=chunks == 2 and family != "generic")
    logits = chain(stages, mb)
    loss = stages[-1].loss(logits, mb)
    ref_logits, ref_loss = reference_forward(family, ref, mb)
    assert torch.equal(logits, ref_logits)
    assert torch.equal(loss, ref_loss)

    loss.backward()
    ref_loss.backward()
    grads = _summed_grads(stages, _canonical(plan))
    ref_grads = _reference_grads(ref)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=0, atol=GRAD_ATOL, msg=name)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_detached_stage_backward_equals_chained(family: str) -> None:
    """As the executor runs it: each stage gets a detached input, backward is driven by the
    received output gradient; the result equals one backward through the whole chain."""
    plan = stage_plan(family, "interleaved", pp=2)
    mb = make_microbatch(family)
    chained = _all_stages(plan)
    chained[-1].loss(chain(chained, mb), mb).backward()

    stages = _all_stages(plan)
    inputs, outputs = [], []
    x: torch.Tensor | None = None
    for stage in stages:
        x_in = None if x is None else x.detach().requires_grad_(True)
        inputs.append(x_in)
        x = stage(x_in, mb)
        outputs.append(x)
    stages[-1].loss(outputs[-1], mb).backward()
    for i in range(len(stages) - 2, -1, -1):
        outputs[i].backward(inputs[i + 1].grad)
    canonical = _canonical(plan)
    expected = _summed_grads(chained, canonical)
    for name, g in _summed_grads(stages, canonical).items():
        torch.testing.assert_close(g, expected[name], rtol=0, atol=GRAD_ATOL, msg=name)


def test_each_rank_holds_only_its_share() -> None:
    plan = stage_plan("gpt2", pp=4)
    ref = build_reference_model(plan.model, CPU, SEED)
    total = sum(p.numel() for p in ref.parameters())
    numel = {n: p.numel() for n, p in ref.named_parameters(remove_duplicate=False)}
    block = sum(v for n, v in numel.items() if n.startswith("transformer.h.0."))
    expected = {
        0: numel["transformer.wte.weight"] + numel["transformer.wpe.weight"] + 2 * block,
        1: 2 * block,
        2: 2 * block,
        3: 2 * block + numel["transformer.ln_f.weight"] + numel["transformer.ln_f.bias"] + numel["lm_head.weight"],
    }
    for rank in range(4):
        stages = build_stages(plan, rank, CPU, SEED)
        params = list(rank_named_parameters(stages).values())
        count = sum(p.numel() for p in params)
        assert count == expected[rank], rank
        assert count < total * 0.6
        assert all(p.device == CPU and not p.is_meta for p in params)
        assert all(b.device == CPU for s in stages for b in s.buffers())


def test_v_placement_shares_the_tied_parameter() -> None:
    # pp=2, chunks=2 in a V: rank 0 holds stages 0 and 3, so both wte and lm_head.
    plan = stage_plan("gpt2", "zbv", pp=2)
    assert tied_parameter_ranks(plan, ("transformer.wte.weight", "lm_head.weight")) == (0,)
    rank0 = build_stages(plan, 0, CPU, SEED)
    assert [s.stage for s in rank0] == [0, 3]
    wte = rank0[0].get_parameter("transformer.wte.weight")
    assert rank0[1].get_parameter("lm_head.weight") is wte
    named = rank_named_parameters(rank0)
    assert "transformer.wte.weight" in named and "lm_head.weight" not in named

    stages = sorted(rank0 + build_stages(plan, 1, CPU, SEED), key=lambda s: s.stage)
    ref = build_reference_model(plan.model, CPU, SEED)
    mb = make_microbatch("gpt2")
    loss = stages[-1].loss(chain(stages, mb), mb)
    ref_logits, ref_loss = reference_forward("gpt2", ref, mb)
    assert torch.equal(loss, ref_loss)
    loss.backward()
    ref_loss.backward()
    torch.testing.assert_close(wte.grad, ref.transformer.wte.weight.grad, rtol=0, atol=GRAD_ATOL)


def test_tied_parameter_groups_and_ranks() -> None:
    """The plan holds the ties check found on the built model; a rank adds each trained
    parameter of a shared module, alone (one tensor on every pipeline rank)."""
    gpt2 = stage_plan("gpt2", pp=4)
    assert gpt2.model.tied == (("transformer.wte.weight", "lm_head.weight"),)
    assert tied_parameter_groups(gpt2, build_stages(gpt2, 0, CPU, SEED)) == [("transformer.wte.weight", "lm_head.weight")]
    assert tied_parameter_ranks(gpt2, gpt2.model.tied[0]) == (0, 3)
    assert stage_plan("llama", pp=4).model.tied == ()
    assert stage_plan("bert", pp=4).model.tied == ()
    tied_llama = stage_plan("llama", pp=2, config={"tie_word_embeddings": True})
    assert tied_llama.model.tied == (("model.embed_tokens.weight", "lm_head.weight"),)


def test_tied_llama_equals_reference() -> None:
    plan = stage_plan("llama", pp=2, config={"tie_word_embeddings": True})
    stages = _all_stages(plan)
    ref = build_reference_model(plan.model, CPU, SEED)
    assert ref.lm_head.weight is ref.model.embed_tokens.weight
    assert torch.equal(stages[0].get_parameter("model.embed_tokens.weight"), stages[-1].get_parameter("lm_head.weight"))
    mb = make_microbatch("llama")
    loss = stages[-1].loss(chain(stages, mb), mb)
    _, ref_loss = reference_forward("llama", ref, mb)
    assert torch.equal(loss, ref_loss)


@pytest.mark.parametrize("family", FAMILIES)
def test_activation_shape(family: str) -> None:
    plan = stage_plan(family, pp=4)
    assert activation_shape(plan) == (MICROBATCH, SEQ_LEN, HIDDEN)
    assert activation_dtype(plan) == torch.float32
    stages = build_stages(plan, 1, CPU, SEED)
    x = torch.zeros(activation_shape(plan))
    assert stages[0](x, make_microbatch(family)).shape == x.shape


@pytest.mark.parametrize("family", ("gpt2", "generic"))
def test_one_meta_model_build_per_plan_and_rank(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank builds the whole meta model once, to hold its weights: the tied groups and the
    hidden size come from the plan (check's facts), not from another build."""
    from ppdsl.runtime.stage import build as stage_mod

    builds = []
    real = stage_mod.build_skeleton
    monkeypatch.setattr(stage_mod, "build_skeleton", lambda model: builds.append(model) or real(model))
    plan = stage_plan(family, pp=2)
    stages = build_stages(plan, 0, CPU, SEED)
    groups = tied_parameter_groups(plan, stages)
    assert activation_shape(plan) == (MICROBATCH, SEQ_LEN, HIDDEN)
    assert len(builds) == 1, len(builds)
    assert groups == ([("transformer.wte.weight", "lm_head.weight")] if family == "gpt2" else [])
    assert not any(p.is_meta for s in stages for p in s.parameters())


def test_a_plan_lowered_without_the_model_is_refused() -> None:
    """check's facts of the model travel in the plan; without them the runtime says so."""
    import attrs

    plan = stage_plan("gpt2", pp=2)
    bare = attrs.evolve(plan, model=attrs.evolve(plan.model, tied=None))
    with pytest.raises(ValueError, match="lowered without the model"):
        build_stages(bare, 0, CPU, SEED)


def test_init_does_not_depend_on_the_global_rng() -> None:
    plan = stage_plan("llama", pp=2)
    torch.manual_seed(0)
    a = build_stages(plan, 1, CPU, SEED)[0]
    torch.manual_seed(99)
    b = build_stages(plan, 1, CPU, SEED)[0]
    c = build_stages(plan, 1, CPU, SEED + 1)[0]
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if pa.dim() == 2:
            assert not torch.equal(pa, pc), name


def test_user_errors_are_value_errors() -> None:
    plan = stage_plan("gpt2", pp=2)
    with pytest.raises(ValueError, match="pipeline rank 2"):
        build_stages(plan, 2, CPU, SEED)
    # check takes the family from the model's class: a plan naming another family, or none
    # registered, is edited by hand to reach the builder's own refusals
    wrong = attrs.evolve(plan, model=attrs.evolve(plan.model, family="gemma"))
    with pytest.raises(ValueError, match="model.layers"):
        build_stages(wrong, 0, CPU, SEED)
    with pytest.raises(ValueError, match="unknown model family"):
        build_stages(attrs.evolve(plan, model=attrs.evolve(plan.model, family="t5")), 0, CPU, SEED)

    first, = build_stages(plan, 0, CPU, SEED)
    mb = make_microbatch("gpt2")
    with pytest.raises(ValueError, match="not the last stage"):
        first.loss(torch.zeros(1), mb)
    with pytest.raises(ValueError, match="its input from the microbatch, not x"):
        first(torch.zeros(MICROBATCH, SEQ_LEN, HIDDEN), mb)
    last, = build_stages(plan, 1, CPU, SEED)
    with pytest.raises(ValueError, match="the previous stage's hidden states"):
        last(None, mb)


def test_hf_pretrained_reads_each_ranks_weights(tmp_path: Any) -> None:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(5)
    source = BertForSequenceClassification(BertConfig(**TINY["bert"].config))
    source.save_pretrained(tmp_path)
    plan = stage_plan("bert", pp=2, pretrained=tmp_path)
    expected = dict(source.named_parameters())
    for stage in _all_stages(plan):
        for name, p in stage.named_parameters():
            assert torch.equal(p, expected[name]), name
    reference = build_reference_model(plan.model, CPU, SEED)
    for name, p in reference.named_parameters():
        assert torch.equal(p, expected[name]), name


def test_microbatch_to() -> None:
    mb = make_microbatch("bert", padded=True).to("cpu")
    assert isinstance(mb, MicroBatch) and mb.attention_mask is not None and mb.token_type_ids is not None


# ---------------------------------------------------------------------------------------------
# Two processes, tp = 2
# ---------------------------------------------------------------------------------------------


def _gather_last(x: torch.Tensor, group: Any) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def _expected_shard(owner: nn.Module, local: str, full: torch.Tensor) -> torch.Tensor:
    shard = getattr(owner, "local_shard", None)
    return shard(local, full) if shard is not None else full


def _tp_family_check(family: str, group: Any) -> dict[str, float]:
    plan = stage_plan(family, pp=2, tp=2)
    ref = build_reference_model(plan.model, CPU, SEED)
    stages = _all_stages(plan, group)
    mb = make_microbatch(family, padded=family != "generic")
    out = chain(stages, mb)
    loss = stages[-1].loss(out, mb)
    ref_logits, ref_loss = reference_forward(family, ref, mb)
    part = stages[-1].head_partition
    if part is not None:  # vocab/label-parallel head: gather the shards, drop the padding
        out = _gather_last(out.detach(), group).narrow(-1, 0, ref_logits.size(-1))
    errors = {"logits": (out - ref_logits).abs().max().item(), "loss": (loss - ref_loss).abs().item()}

    loss.backward()
    ref_loss.backward()
    ref_grads = _reference_grads(ref)
    canonical = _canonical(plan)
    summed: dict[str, torch.Tensor] = {}
    owners: dict[str, tuple[nn.Module, str]] = {}
    for stage in stages:
        for name, p in stage.named_parameters():
            key = canonical.get(name, name)
            summed[key] = p.grad if key not in summed else summed[key] + p.grad
            owner_path, _, local = name.rpartition(".")
            owners.setdefault(key, (stage.get_submodule(owner_path), local))
    assert summed.keys() == ref_grads.keys()
    errors["grad"] = max(
        (g - _expected_shard(*owners[name], ref_grads[name])).abs().max().item() for name, g in summed.items()
    )
    sharded = sum(1 for owner, _ in owners.values() if hasattr(owner, "local_shard"))
    assert sharded >= 2 * 8, (family, sharded)  # at least the two split layers of every block
    return errors


def _tp_worker(rank: int, world_size: int) -> dict[str, dict[str, float]]:
    group = dist.group.WORLD
    return {family: _tp_family_check(family, group) for family in FAMILIES}


@pytest.mark.distributed
def test_tensor_parallel_stage_chain_matches_reference() -> None:
    results = run_distributed(_tp_worker, 2, timeout=300)  # generous: a hang guard, and busy CI machines are slow
    for rank, per_family in enumerate(results):
        for family, errors in per_family.items():
            for what, err in errors.items():
                assert err < 1e-5, (rank, family, what, err)


def test_a_parameter_registered_under_two_names_stays_one_on_meta() -> None:
    """The skeleton keeps a tie made by registering one new Parameter twice (a python factory's
    `w = nn.Parameter(...); a.weight = w; b.weight = w`), as check's meta build sees it: the
    stages, the reference and export then agree on the plan's ties."""
    from ppdsl.runtime.stage.skeleton import params_on_meta, tied_groups

    with params_on_meta():
        model = torch.nn.Module()
        model.a, model.b, model.c = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        shared = torch.nn.Parameter(torch.zeros(4, 4))
        model.a.weight = shared
        model.b.weight = shared
    assert model.a.weight.is_meta and model.a.weight is model.b.weight
    assert model.c.weight is not model.a.weight
    assert tied_groups(model) == [("a.weight", "b.weight")]
