"""The single-process reference `verify` compares a plan with: the full model trained in one
process by gradient accumulation over the same microbatches, with the same optimizer."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ppdsl.lowering.plan import Plan

from ppdsl.runtime.data.source import make_data
from ppdsl.runtime.pipeline.step_loss import sum_losses
from ppdsl.runtime.train.optim import autocast_factory, build_optimizer, lr_factor, parameter_dtype
from ppdsl.runtime.verify.reference_loss import reference_loss
from ppdsl.runtime.stage.build import build_reference_model


@dataclass
class ReferenceRun:
    losses: list[float]
    grads: list[dict[str, torch.Tensor]]  # per step, by every name (tied aliases included)
    grad_norms: list[float]  # per step, before clipping
    params: dict[str, torch.Tensor]
    aliases: dict[str, tuple[str, ...]]  # name -> every name of the same (tied) tensor
    eval: Any = None  # train.eval: runtime.train.evaluate.EvalResult after the last step


def reference_run(plan: Plan, steps: int, device: torch.device | str = "cpu") -> ReferenceRun:
    """Train the full model in this process: gradient accumulation over every data-parallel
    replica's microbatches, each loss scaled by 1/microbatches as in the pipeline, gradients
    averaged over the replicas, then the same clipping, optimizer and LR schedule."""
    device = torch.device(device)
    train = plan.train
    model = build_reference_model(plan.model, device, train.seed, parameter_dtype(train.precision))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(params, train.optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(train.lr_schedule, train.optimizer.lr, train.steps))
    autocast = autocast_factory(train.precision, device)
    data = make_data(plan)
    dp, m = plan.mesh.dp, plan.schedule.microbatches
    run = ReferenceRun([], [], [], {}, _aliases(model))
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        replica_losses = []
        for dp_rank in range(dp):
            losses = []
            for mb in data.microbatches(step, dp_rank, device):
                with autocast():
                    loss = reference_loss(plan, model, mb)
                scaled = loss / m
                scaled.backward()
                losses.append(scaled.detach())
            replica_losses.append(sum_losses(losses))
        if dp > 1:
            for p in params:
                if p.grad is not None:
                    p.grad.div_(dp)
        run.losses.append(float(sum_losses(replica_losses)) / dp)
        run.grads.append(_by_every_name(model, "grad"))
        norm = torch.nn.utils.clip_grad_norm_(params, math.inf if train.grad_clip is None else train.grad_clip)
        run.grad_norms.append(float(norm))
        optimizer.step()
        scheduler.step()
    run.params = _by_every_name(model, "param")
    if train.eval is not None:
        from ppdsl.runtime.train.evaluate import reference_evaluate

        run.eval = reference_evaluate(plan, model, device, steps)
    return run


def _aliases(model: nn.Module) -> dict[str, tuple[str, ...]]:
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return {n: tuple(group) for group in names.values() for n in group}


def _by_every_name(model: nn.Module, kind: str) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if not p.requires_grad:
            continue  # not trained (Afmoe's expert_bias): the trainer holds only trained parameters
        t = p.detach() if kind == "param" else p.grad
        out[name] = (torch.zeros_like(p) if t is None else t).detach().cpu().clone()
    return out
