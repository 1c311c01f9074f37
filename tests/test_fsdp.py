"""ZeRO-3 (``train { zero = 3 }``, FSDP2 over dp: ``runtime.parallel.fsdp``) equals one process.

One spawned world of 4 (dp 2 x pp 2) runs every schedule style on the generic decoder, GPT-2
(wte / lm_head tied across pipeline ranks under 1F1B, within one rank's two chunks under ZBV) and
Llama with bf16 autocast and activation checkpointing, each through ``runtime.verify.compare`` (two
steps, gradient clipping on: losses, first-step gradients gathered over dp and tp, parameters
after the last step). The same world checks what the trainer promises beyond equivalence: one
gradient reduce-scatter per FSDP module per step whatever the number of microbatches, the
parameters resharded after a forward-only evaluation, the layout of parameters and optimizer
state (DTensors Shard(0) on the dp mesh, the names of zero = 0), the bytes held at rest, and
fp16's loss scaling (driven on CPU in fp32) unscaling the dp shards.
A world of 8 (dp 2 x tp 2 x pp 2, sequence parallel) runs one case.

``test_fsdp_private_api_is_there`` fails loudly when a torch release renames what
``runtime.parallel.fsdp.reduce_gradients`` reaches into (as torch.distributed.pipelining does).
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch

from _exec_harness import case_id
from _tiny_models import tiny_plan
from dist_harness import run_distributed

ALL_STYLES = ("gpipe", "1f1b", "interleaved", "looped_bfs", "zbh1", "zbv", "interleaved_zb")
_SMALL = dict(microbatches=4, num_layers=4, steps=2, zero=3)

CASES: dict[int, list[dict[str, Any]]] = {
    4: [dict(family="generic", style=s, dp=2, pp=2, **_SMALL) for s in ALL_STYLES]
    # resharding after forward: a plain, a split-backward and a looped schedule (each style runs above)
    + [dict(family="generic", style=s, dp=2, pp=2, reshard_after_forward=True, **_SMALL)
       for s in ("gpipe", "zbh1", "interleaved_zb")]
    + [
        dict(family="gpt2", style="1f1b", dp=2, pp=2, **_SMALL),  # tied across pipeline ranks
        dict(family="gpt2", style="zbv", dp=2, pp=2, **_SMALL),  # tied across one rank's chunks
        dict(family="llama", style="interleaved_zb", dp=2, pp=2, precision="bf16", activation_checkpointing=True,
             **_SMALL),
        # resharding with W's recompute (activation checkpointing): a family's blocks
        dict(family="generic", style="zbv", dp=2, pp=2, precision="bf16", activation_checkpointing=True,
             reshard_after_forward=True, **_SMALL),
        # the own forward's blocks (GPT-2's), resharded, recomputed, stopped at a stage's end
        dict(family="gpt2", style="zbv", dp=2, pp=2, activation_checkpointing=True, reshard_after_forward=True,
             **_SMALL),
    ],
    8: [dict(family="gpt2", style="zbh1", dp=2, pp=2, tp=2, sequence_parallel=True, microbatches=4, num_layers=4,
             steps=2, zero=3)],
}
TIMEOUT_S = {4: 300, 8: 300}


def _trainer(case: dict[str, Any]) -> Any:
    from ppdsl.runtime.parallel.groups import build_process_groups, tie_pp_ranks_of
    from ppdsl.runtime.train.trainer import Trainer

    plan = tiny_plan(**case)
    groups = build_process_groups(plan.mesh, "cpu", tie_pp_ranks_of(plan.schedule.stage_ranks))
    return Trainer(plan, groups, torch.device("cpu"))


def _collectives_per_step(case: dict[str, Any], name: str = "reduce_scatter_single") -> tuple[list[int], int, int]:
    """(calls of torch.distributed.`name` in each of two steps, FSDP parameter groups on this
    rank, (blocks of the first stage, other blocks) on this rank)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    trainer = _trainer(case)
    calls = [0]
    original = getattr(dist, name)

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return original(*args, **kwargs)

    per_step = []
    setattr(dist, name, counting)  # what FSDP2's default reduce-scatter / all-gather call
    try:
        for step in range(2):
            calls[0] = 0
            trainer.step(step)
            per_step.append(calls[0])
    finally:
        setattr(dist, name, original)
    groups = sum(len(s._fsdp_param_groups) for root in trainer.fsdp_roots
                 for s in fully_shard.state(root)._state_ctx.all_states)
    first = sum(len(list(stage.blocks())) for stage in trainer.stages if stage.stage == 0)
    later = sum(len(list(stage.blocks())) for stage in trainer.stages if stage.stage > 0)
    return per_step, groups, (first, later)


def _max_whole_blocks(case: dict[str, Any]) -> tuple[int, int]:
    """(the most blocks of this rank holding whole weights at once during two steps, its blocks)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    trainer = _trainer(case)
    blocks = {id(b) for stage in trainer.stages for b in stage.blocks()}
    whole: set[int] = set()
    most = [0]
    to_unsharded, to_sharded = FSDPParamGroup._to_unsharded, FSDPParamGroup._to_sharded

    def unsharded(group: Any) -> None:
        to_unsharded(group)
        whole.update(id(m) for m in group.modules if id(m) in blocks)
        most[0] = max(most[0], len(whole))

    def sharded(group: Any) -> None:
        to_sharded(group)
        whole.difference_update(id(m) for m in group.modules)

    FSDPParamGroup._to_unsharded, FSDPParamGroup._to_sharded = unsharded, sharded  # type: ignore[method-assign]
    try:
        for step in range(2):
            trainer.step(step)
    finally:
        FSDPParamGroup._to_unsharded, FSDPParamGroup._to_sharded = to_unsharded, to_sharded  # type: ignore[method-assign]
    return most[0], len(blocks)


def _layout_and_eval(rank: int) -> dict[str, Any]:
    """Contract of the trainer under zero = 3 against zero = 0 in the same world."""
    from torch.distributed.tensor import DTensor, Shard

    from ppdsl.runtime.parallel.fsdp import local

    out: dict[str, Any] = {}
    # the own forward's blocks: the last block of a non-last stage ends the model's forward
    case = dict(family="gpt2", style="zbv", dp=2, pp=2, microbatches=4, num_layers=4, steps=1)
    sharded, replicated = _trainer(dict(case, zero=3)), _trainer(dict(case, zero=0))
    out["names"] = [n for n, _ in sharded.named_params] == [n for n, _ in replicated.named_params]
    for t in (sharded, replicated):
        t.step(0)
    dp_mesh = sharded.groups.mesh["dp"]
    p = sharded.params[0]
    state = sharded.optimizer_state(p)
    out["param_layout"] = all(isinstance(q, DTensor) and q.device_mesh == dp_mesh and q.placements == (Shard(0),)
                              for q in sharded.params)
    out["state_layout"] = all(isinstance(v, DTensor) and v.placements == (Shard(0),)
                              for k, v in state.items() if k != "step")
    out["holding"] = sharded.optimizer_holding(p) is sharded.optimizer
    out["eval"] = (sharded.evaluate(0), replicated.evaluate(0))
    out["resharded"] = all(isinstance(q, DTensor) for stage in sharded.stages for q in stage.parameters())
    out["bytes"] = tuple(sum(local(q).numel() * q.element_size() for q in t.params) for t in (sharded, replicated))
    # a torch release that renames what runtime.parallel.fsdp.reduce_gradients uses fails here, by name
    from torch.distributed.fsdp import fully_shard

    root_state = fully_shard.state(sharded.fsdp_roots[0])
    out["private_api"] = (
        hasattr(root_state, "_state_ctx") and hasattr(root_state._state_ctx, "all_states")
        and all(hasattr(s, "_fsdp_param_groups") for s in root_state._state_ctx.all_states)
        and callable(getattr(root_state, "_root_post_backward_final_callback", None))
    )
    return out


def _loss_scaling() -> list[tuple[float, float | None, bool]]:
    """fp16's dynamic loss scaling (CUDA only) driven on CPU in fp32: (loss, grad norm,
    skipped) of one step at zero = 3 and at zero = 0."""
    from ppdsl.runtime.train.optim import LossScaler

    out = []
    for zero in (3, 0):
        trainer = _trainer(dict(family="gpt2", style="1f1b", dp=2, pp=2, microbatches=4, num_layers=4, steps=1,
                                zero=zero))
        trainer.scaler = LossScaler(init=2.0**12)
        out.append(trainer.step(0))
    return out


def fsdp_worker(rank: int, world: int, cases: list[dict[str, Any]], extras: bool) -> list[Any]:
    import time

    from ppdsl.runtime.parallel.groups import build_process_groups, tie_pp_ranks_of
    from ppdsl.runtime.verify.world import verify_in_process

    reports = []
    for case in cases:
        start = time.perf_counter()
        plan = tiny_plan(**case)
        assert plan.mesh.world == world, (case, world)
        groups = build_process_groups(plan.mesh, "cpu", tie_pp_ranks_of(plan.schedule.stage_ranks))
        report = verify_in_process(plan, groups, torch.device("cpu"), plan.train.steps)
        reports.append((report, time.perf_counter() - start))
    if not extras:
        return [reports]
    counts = {
        (style, m, reshard): _collectives_per_step(dict(family="generic", style=style, dp=2, pp=2, microbatches=m,
                                                        num_layers=4, steps=2, zero=3, reshard_after_forward=reshard))
        for style in ("1f1b", "interleaved_zb") for m in (2, 8) for reshard in (False, True)
    }
    # the generic decoder's blocks, and the own forward's (GPT-2: rank 0's last block ends the forward)
    gathers = {
        (family, style, m, reshard): _collectives_per_step(
            dict(family=family, style=style, dp=2, pp=2, microbatches=m, num_layers=4, steps=2, zero=3,
                 reshard_after_forward=reshard), "all_gather_single")
        for family, style in (("generic", "1f1b"), ("generic", "interleaved_zb"), ("gpt2", "1f1b"))
        for m in (2,) for reshard in (False, True)
    }
    whole = {style: _max_whole_blocks(dict(family="generic", style=style, dp=2, pp=2, microbatches=4, num_layers=8,
                                            steps=2, zero=3, reshard_after_forward=True))
             for style in ("1f1b", "interleaved_zb")}
    return [reports, counts, _layout_and_eval(rank), _loss_scaling(), gathers, whole]


_results: dict[int, list[Any]] = {}


def _world(world: int) -> list[Any]:
    if world not in _results:
        _results[world] = run_distributed(fsdp_worker, world, CASES[world], world == 4, timeout=TIMEOUT_S[world])
    return _results[world]


def _id(case: dict[str, Any]) -> str:
    extra = [k for k in ("activation_checkpointing", "sequence_parallel", "reshard_after_forward") if case.get(k)]
    return "-".join([case_id(case), *extra, *([case["precision"]] if "precision" in case else [])])


# world 8 (zero 3 with tp 2 and sequence parallelism, about 40 s on 2 cores): `-m slow`
PARAMS = [pytest.param(w, i, id=f"w{w}-{_id(c)}", marks=[pytest.mark.distributed, *([pytest.mark.slow] if w == 8 else [])])
          for w, cases in CASES.items() for i, c in enumerate(cases)]


@pytest.mark.parametrize("world,index", PARAMS)
def test_zero3_matches_single_process(world: int, index: int) -> None:
    case = CASES[world][index]
    report, _seconds = _world(world)[0][0][index]
    text = report.render()
    assert report.ok, text
    assert report.steps == case["steps"]
    bf16 = case.get("precision") == "bf16"
    assert report.max_loss_diff <= 1e-6, text
    assert report.first_step_grad_diff <= (1e-5 if not bf16 else 1e-3), text
    assert report.max_param_diff <= (1e-4 if not bf16 else 1e-3), text


@pytest.mark.distributed
def test_one_gradient_reduce_scatter_per_step() -> None:
    """Per step, each FSDP parameter group (a block, a stage's root) reduce-scatters once,
    with 2 or 8 microbatches, under 1F1B and a split-backward schedule."""
    counts = _world(4)[0][1]
    for (style, microbatches, reshard), (per_step, groups, _blocks) in counts.items():
        assert groups > 0
        assert per_step == [groups, groups], (style, microbatches, reshard, per_step, groups)


@pytest.mark.distributed
def test_weight_all_gathers_per_step() -> None:
    """Without resharding each FSDP group all-gathers once per step; with it each block
    all-gathers for every microbatch's forward and backward (and a split backward's W: a fused
    norm's backward reads its weight), the roots once: what lowering/memory.py counts. (Rank 0's
    figures: it holds stage 0 under both styles.)"""
    gathers = _world(4)[0][4]
    for (family, style, microbatches, reshard), (per_step, groups, blocks) in gathers.items():
        first, later = blocks
        roots = groups - first - later
        if not reshard:
            expected = groups
        else:  # the first stage's W is its whole backward (its input needs no gradient): no B before it
            expected = roots + 2 * microbatches * first + (3 if style == "interleaved_zb" else 2) * microbatches * later
        assert per_step == [expected] * 2, (family, style, microbatches, reshard, per_step, groups, blocks)


@pytest.mark.distributed
def test_reshard_keeps_at_most_two_blocks_whole() -> None:
    """With resharding a rank of 4 blocks holds at most memory.WHOLE_BLOCKS of them whole at once
    (the block computing and the one FSDP2 prefetches in backward), under 1F1B and a split
    backward (W all-gathers one block at a time)."""
    from ppdsl.lowering.memory import WHOLE_BLOCKS

    for style, (most, blocks) in _world(4)[0][5].items():
        assert blocks == 4 and 1 <= most <= WHOLE_BLOCKS, (style, most, blocks)


@pytest.mark.distributed
def test_zero3_trainer_contract() -> None:
    out = _world(4)[0][2]
    assert out["private_api"], "torch renamed FSDP2 internals that runtime.parallel.fsdp.reduce_gradients uses"
    assert out["names"]
    assert out["param_layout"] and out["state_layout"] and out["holding"]
    sharded_eval, replicated_eval = out["eval"]
    assert abs(sharded_eval - replicated_eval) <= 1e-6, out["eval"]
    assert out["resharded"]
    sharded_bytes, replicated_bytes = out["bytes"]
    assert sharded_bytes <= replicated_bytes / 2 + 4096, out["bytes"]


def test_fsdp_private_api_is_there() -> None:
    """What ``runtime.parallel.fsdp.reduce_gradients`` reaches into (torch.distributed.pipelining's own
    ``perform_reduce_grad`` does the same), checked without a process group."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState, FSDPStateContext

    assert callable(getattr(fully_shard, "state", None))
    assert callable(getattr(FSDPState, "_root_post_backward_final_callback", None))
    assert callable(getattr(FSDPParamGroup, "post_backward", None))
    assert "all_states" in inspect.getsource(FSDPStateContext)
    assert "self._fsdp_param_groups" in inspect.getsource(FSDPState.__init__)
    assert "self._state_ctx" in inspect.getsource(FSDPState)
    # runtime.parallel.fsdp.WeightAccess (reshard_after_forward under split backward)
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    assert "self._all_gather_result" in inspect.getsource(FSDPParamGroup)
    assert isinstance(getattr(FSDPParamGroup, "is_unsharded", None), property)
    assert "self._unsharded_param" in inspect.getsource(FSDPParam)


@pytest.mark.distributed
def test_zero3_loss_scaling_unscales_the_shards() -> None:
    (loss3, norm3, skipped3), (loss0, norm0, skipped0) = _world(4)[0][3]
    assert not skipped3 and not skipped0
    assert abs(loss3 - loss0) <= 1e-6
    assert norm3 is not None and norm0 is not None and abs(norm3 - norm0) <= 1e-5 * norm0, (norm3, norm0)
