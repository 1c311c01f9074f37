"""Memory features against the single-process reference: activation checkpointing (every
family, composed with the split backward of the zero-bubble schedules), ZeRO-1 over
data-parallel replicas, bf16 autocast on every schedule style, and fp16's refusal on CPU.

In-process tests check activation checkpointing on one stage (outputs, input and weight
gradients bitwise equal to no checkpointing, with dropout on; the block forward recomputed in
backward; fewer activation bytes kept). The distributed suites (gloo, hard timeouts) run the
plans through ``runtime.verify.world.verify_in_process`` as the equivalence matrix does.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from _exec_harness import case_id
from _tiny_models import tiny_plan
from dist_harness import run_distributed

from ppdsl.runtime.pipeline.split_backward import backward_input, backward_weight
from ppdsl.runtime.parallel.parallelize import apply_ac
from ppdsl.runtime.stage.build import MicroBatch, build_stages

ROOT = Path(__file__).resolve().parents[1]
ALL_STYLES = ("gpipe", "1f1b", "interleaved", "looped_bfs", "zbh1", "zbv", "interleaved_zb")


# ---------------------------------------------------------------------------------------------
# Activation checkpointing on one stage (in process)
# ---------------------------------------------------------------------------------------------


def _middle_stage(family: str, ac: bool) -> Any:
    """Rank 1's first stage of a pp = 2 zbv plan (a middle stage: input and output are hidden
    states), dropout 0.1 everywhere, in training mode."""
    plan = tiny_plan(family=family, style="zbv", pp=2, microbatches=4, num_layers=4, steps=1,
                     activation_checkpointing=ac)
    stage = build_stages(plan, 1, torch.device("cpu"), 0)[0]
    apply_ac([stage], plan.train.activation_checkpointing)
    assert stage.activation_checkpointing is ac
    for m in stage.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.1
    for m in stage.modules():  # attention-probability dropout of the HF attention modules
        if hasattr(m, "attention_dropout"):
            m.attention_dropout = 0.1
        if hasattr(m, "attn_dropout") and isinstance(m.attn_dropout, torch.nn.Dropout):
            m.attn_dropout.p = 0.1
    return stage.train()


def _run_stage(family: str, ac: bool, split: bool) -> dict[str, Any]:
    stage = _middle_stage(family, ac)
    calls = [0]
    original = stage.adapter.run_block

    def counting(*args: Any) -> Any:
        calls[0] += 1
        return original(*args)

    stage.adapter.run_block = counting  # the adapter instance belongs to this build only
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 16, 32, generator=g).requires_grad_(True)
    mb = MicroBatch(input_ids=torch.randint(0, 128, (1, 16), generator=g), labels=torch.randint(0, 4, (1,), generator=g),
                    attention_mask=torch.ones(1, 16, dtype=torch.long))
    torch.manual_seed(123)
    out = stage(x, mb)
    grad = torch.randn(out.shape, generator=g)
    counts = [calls[0]]
    torch.manual_seed(999)  # recomputation must not depend on the RNG state at backward time
    if split:
        params = [p for p in stage.parameters() if p.requires_grad]
        dx, groups = backward_input(out, grad, x, params)
        assert groups is not None
        counts.append(calls[0])
        backward_weight(groups)
    else:
        out.backward(grad)
        dx = x.grad
        counts.append(calls[0])
    counts.append(calls[0])
    grads = {n: p.grad.clone() for n, p in stage.named_parameters() if p.grad is not None}
    return dict(out=out.detach(), dx=dx, grads=grads, calls=counts, blocks=len(stage.block_names),
                own_forward=stage.adapter.own_forward)


@pytest.mark.parametrize("family", ["gpt2", "llama", "bert", "generic"])
def test_checkpointing_matches_and_composes_with_split_backward(family: str) -> None:
    plain = _run_stage(family, ac=False, split=False)
    for split in (False, True):
        ckpt = _run_stage(family, ac=True, split=split)
        assert torch.equal(ckpt["out"], plain["out"])
        assert torch.equal(ckpt["dx"], plain["dx"])
        assert ckpt["grads"].keys() == plain["grads"].keys() and plain["grads"]
        for name, g in plain["grads"].items():
            assert torch.allclose(ckpt["grads"][name], g, rtol=0, atol=1e-7), name
        n = ckpt["blocks"]
        if ckpt["own_forward"]:
            # the model's own forward runs the blocks, not the adapter's run_block this counts; that
            # it keeps less for backward is _saved_bytes' test
            assert ckpt["calls"] == plain["calls"] == [0, 0, 0], ckpt["calls"]
            continue
        if split:
            # recomputed once in B (backward_input), and again in W: backward_weight runs one
            # autograd.grad per weight group, and non-reentrant checkpointing recomputes once
            # per backward call
            assert ckpt["calls"][:2] == [n, 2 * n] and ckpt["calls"][2] >= 3 * n, ckpt["calls"]
        else:
            assert ckpt["calls"] == [n, 2 * n, 2 * n], ckpt["calls"]
    assert plain["own_forward"] or plain["calls"] == [plain["blocks"]] * 3


def _saved_bytes(ac: bool) -> int:
    """Bytes autograd keeps for backward after a stage forward (tensors saved outside a
    checkpoint; inside one the checkpoint's own hooks take them and keep nothing)."""
    plan = tiny_plan(family="gpt2", style="1f1b", pp=1, microbatches=1, num_layers=4, steps=1,
                     activation_checkpointing=ac)
    stage = build_stages(plan, 0, torch.device("cpu"), 0)[0].train()
    apply_ac([stage], plan.train.activation_checkpointing)
    total = [0]
    params = {p.data_ptr() for p in stage.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.data_ptr() not in params:
            total[0] += t.numel() * t.element_size()
        return t

    mb = MicroBatch(input_ids=torch.randint(0, 128, (4, 16)), labels=torch.randint(0, 128, (4, 16)))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = stage.loss(stage(None, mb), mb)
    loss.backward()
    return total[0]


def test_checkpointing_keeps_fewer_activations() -> None:
    plain, ckpt = _saved_bytes(False), _saved_bytes(True)
    assert ckpt < plain / 2, (ckpt, plain)


# ---------------------------------------------------------------------------------------------
# Distributed: equivalence with the reference
# ---------------------------------------------------------------------------------------------

_AC = dict(activation_checkpointing=True)
_SMALL = dict(microbatches=4, num_layers=4)

SUITES: dict[int, list[dict[str, Any]]] = {
    2: [
        # activation checkpointing, tp = 1: the first loss bitwise
        dict(family="gpt2", style="1f1b", pp=2, steps=2, **_SMALL, **_AC),
        dict(family="generic", style="zbv", pp=2, steps=2, **_SMALL, **_AC),
        dict(family="llama", style="interleaved", pp=2, steps=1, **_SMALL, **_AC),
        dict(family="bert", style="interleaved_zb", pp=2, steps=1, **_SMALL, **_AC),
    ]
    # bf16 autocast on every schedule style
    + [dict(family="generic", style=s, pp=2, steps=2, precision="bf16", **_SMALL) for s in ALL_STYLES],
    4: [
        # activation checkpointing with tensor parallelism
        dict(family="gpt2", style="1f1b", pp=2, tp=2, steps=1, **_SMALL, **_AC),
        dict(family="llama", style="zbv", pp=2, tp=2, steps=1, **_SMALL, **_AC),
        # ZeRO-1 over dp = 2, three steps
        dict(family="gpt2", style="1f1b", dp=2, pp=2, steps=3, zero=1, **_SMALL),
        dict(family="generic", style="zbv", dp=2, pp=2, steps=3, zero=1, **_SMALL),
        # ZeRO-1, activation checkpointing and bf16 together
        dict(family="llama", style="interleaved_zb", dp=2, pp=2, steps=3, zero=1, precision="bf16", **_SMALL, **_AC),
    ],
}
TIMEOUT_S = {2: 240, 4: 300}  # hard limits, with room for a loaded machine


def memory_worker(rank: int, world: int, cases: list[dict[str, Any]]) -> list[Any]:
    """Each case through verify_in_process; rank 0 returns (report, fp32 reference losses for
    the non-fp32 cases), the other ranks Nones."""
    from ppdsl.runtime.parallel.groups import build_process_groups, tie_pp_ranks_of
    from ppdsl.runtime.verify.reference import reference_run
    from ppdsl.runtime.verify.world import verify_in_process

    out = []
    for case in cases:
        plan = tiny_plan(**case)
        assert plan.mesh.world == world, (case, world)
        groups = build_process_groups(plan.mesh, "cpu", tie_pp_ranks_of(plan.schedule.stage_ranks))
        report = verify_in_process(plan, groups, torch.device("cpu"), plan.train.steps)
        fp32 = None
        if rank == 0 and plan.train.precision != "fp32":
            fp32_plan = tiny_plan(**{**case, "precision": "fp32"})
            fp32 = reference_run(fp32_plan, plan.train.steps).losses
        out.append((report, fp32))
    return out


_results: dict[int, list[Any]] = {}


def _suite(world: int) -> list[Any]:
    if world not in _results:
        _results[world] = run_distributed(memory_worker, world, SUITES[world], timeout=TIMEOUT_S[world])[0]
    return _results[world]


def _id(case: dict[str, Any]) -> str:
    return case_id(case) + ("-ac" if case.get("activation_checkpointing") else "")


PARAMS = [pytest.param(w, i, id=f"w{w}-{_id(c)}") for w, cases in SUITES.items() for i, c in enumerate(cases)]


@pytest.mark.distributed
@pytest.mark.parametrize("world,index", PARAMS)
def test_memory_feature_matches_reference(world: int, index: int) -> None:
    case = SUITES[world][index]
    report, fp32_losses = _suite(world)[index]
    text = report.render()
    assert not report.problems, text
    assert report.steps == case["steps"]
    if case.get("tp", 1) == 1 and case.get("dp", 1) == 1:
        assert report.first_loss_bitwise, text
    assert report.max_loss_diff <= 1e-6, text
    assert report.first_step_grad_diff <= 1e-5, text
    assert report.ok, text  # later gradients and parameters within Tolerances.for_plan
    if fp32_losses is not None:
        # bf16 autocast (8-bit mantissa) stays near the fp32 trajectory
        for (parallel, _ref), fp32 in zip(report.losses, fp32_losses):
            assert abs(parallel - fp32) <= 1e-2 * abs(fp32), (report.losses, fp32_losses)


# ---------------------------------------------------------------------------------------------
# fp16 on CPU
# ---------------------------------------------------------------------------------------------


def test_fp16_autocast_refused_on_cpu() -> None:
    from ppdsl.runtime.train.optim import autocast_factory

    with pytest.raises(ValueError, match="fp16 needs CUDA"):
        autocast_factory("fp16", torch.device("cpu"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="fp16 runs on CUDA")
def test_run_refuses_fp16_on_cpu(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    proc = subprocess.run(
        [sys.executable, "-m", "ppdsl", "run", str(ROOT / "specs" / "tiny_cpu.ppspec"),
         "--set", "mesh.tp=1", "--set", "mesh.pp=1", "--set", "train.precision=fp16", "--set", "train.steps=1",
         "--out", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env,
    )
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "fp16 needs CUDA" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    # with --nproc it is refused before any worker starts (no torchrun banner, no worker output)
    proc = subprocess.run(
        [sys.executable, "-m", "ppdsl", "run", str(ROOT / "specs" / "tiny_cpu.ppspec"), "--nproc", "4",
         "--set", "train.precision=fp16", "--out", str(tmp_path / "run4")],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env,
    )
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stderr.strip() == "ppdsl run: precision = fp16 needs CUDA; use bf16 on CPU", proc.stderr


def test_run_does_not_call_activation_checkpointing_ignored() -> None:
    from ppdsl.runtime.run import worker

    plan = tiny_plan(family="generic", style="1f1b", pp=2, microbatches=4, num_layers=4, steps=1,
                     activation_checkpointing=True)
    assert not any("activation" in item for item in worker._not_implemented(plan))
