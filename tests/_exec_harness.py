"""Helpers for the executor / training equivalence tests: the workers that run plans of the tiny
models (tests/_tiny_models.py: tiny_plan) against the single-process reference."""

from __future__ import annotations

from typing import Any

import torch

from _tiny_models import tiny_plan
from ppdsl.lowering.plan import Plan


def case_id(case: dict[str, Any]) -> str:
    keys = ("family", "style", "dp", "pp", "tp", "optimizer", "precision", "zero", "grad_clip", "steps")
    named = ("dp", "pp", "tp", "zero", "grad_clip")
    return "-".join(f"{k}{case[k]}" if k in named else str(case[k]) for k in keys if k in case)


def executor_checks_worker(rank: int, world: int) -> dict[str, Any]:
    """Executor behaviour beyond equivalence, on world 2 (pp = 2). Returns named results."""
    import torch.distributed as dist

    from ppdsl.runtime.pipeline.step_loss import sum_losses
    from ppdsl.runtime.parallel.groups import build_process_groups, tie_pp_ranks_of
    from ppdsl.runtime.stage.build import build_reference_model
    from ppdsl.runtime.verify.reference_loss import reference_loss
    from ppdsl.runtime.train.trainer import Trainer
    from ppdsl.runtime.verify.gather import _gather_to_rank0
    from ppdsl.runtime.verify.reference import reference_run
    from ppdsl.runtime.verify.world import verify_in_process

    out: dict[str, Any] = {}

    # groups: coordinates, peers and the tie group of a pp = 2 mesh
    plan = tiny_plan("gpt2", "1f1b", pp=2, microbatches=4, num_layers=4, steps=1)
    groups = build_process_groups(plan.mesh, "cpu", tie_pp_ranks_of(plan.schedule.stage_ranks))
    out["coords"] = groups.coords
    out["peers"] = [groups.pp_peer(p) for p in range(2)]
    out["tie_size"] = None if groups.tie is None else dist.get_world_size(groups.tie)

    # evaluation: forward only, equals the reference's mean loss bit for bit
    trainer = Trainer(plan, groups, torch.device("cpu"))
    out["eval"] = trainer.evaluate(0)
    # the executor refuses a wrong number of microbatches
    try:
        trainer.executor.train_step(trainer.data.microbatches(0, 0, "cpu")[:3])
        out["wrong_count"] = "accepted"
    except ValueError as exc:
        out["wrong_count"] = str(exc)
    # the same step with receives posted 1 or 3 actions ahead: identical losses and gradients
    for style in ("interleaved", "zbv"):
        p = tiny_plan("generic", style, pp=2, microbatches=4, num_layers=4, steps=1)
        g = build_process_groups(p.mesh, "cpu", tie_pp_ranks_of(p.schedule.stage_ranks))
        runs = []
        for lookahead in (1, 3):
            t = Trainer(p, g, torch.device("cpu"), lookahead=lookahead)
            reserved = t.executor._pool.allocated
            runs.append((t.forward_backward(0), _gather_to_rank0(t, "grad")))
            t.evaluate(0)
            out[f"buffers-{style}-{lookahead}"] = (reserved, t.executor._pool.allocated)
        if rank == 0:
            (loss1, grads1), (loss3, grads3) = runs
            out[f"lookahead-{style}"] = (
                loss1 == loss3 and grads1.keys() == grads3.keys() and all(torch.equal(grads1[n], grads3[n]) for n in grads1)
            )
    # without the tied-gradient sum GPT-2's wte / lm_head gradients are wrong: verify must say so
    original = Trainer.sync_gradients
    Trainer.sync_gradients = lambda self: None  # type: ignore[method-assign]
    try:
        out["untied"] = verify_in_process(plan, groups, torch.device("cpu"), 1)
    finally:
        Trainer.sync_gradients = original  # type: ignore[method-assign]
    if rank == 0:
        from ppdsl.runtime.data.source import make_data

        model = build_reference_model(plan.model, torch.device("cpu"), plan.train.seed)
        with torch.no_grad():
            losses = [reference_loss(plan, model, mb) for mb in make_data(plan).microbatches(0, 0, "cpu")]
        out["eval_reference"] = float(sum_losses(losses) / plan.schedule.microbatches)
        out["reference_first_loss"] = reference_run(plan, 1).losses[0]
    return out


def equivalence_worker(rank: int, world: int, plans: list[Plan]) -> list[Any]:
    """Run each plan (lowered by the caller: once, not on every rank) in this world for
    plan.train.steps steps; rank 0 returns the VerifyReports (with the seconds each case took),
    the others Nones."""
    import time

    from ppdsl.runtime.parallel.groups import build_process_groups, tie_pp_ranks_of
    from ppdsl.runtime.verify.world import verify_in_process

    reports = []
    for plan in plans:
        start = time.perf_counter()
        assert plan.mesh.world == world, (plan.mesh, world)
        groups = build_process_groups(plan.mesh, "cpu", tie_pp_ranks_of(plan.schedule.stage_ranks))
        report = verify_in_process(plan, groups, torch.device("cpu"), plan.train.steps)
        reports.append((report, time.perf_counter() - start))
    return reports
