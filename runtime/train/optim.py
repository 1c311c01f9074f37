"""The numerics of a step besides the gradients: the optimizer (weight-decay groups), the LR
schedule, autocast precision and fp16's dynamic loss scaling."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from ppdsl.lowering.plan import LrSchedulePlan, OptimizerPlan

def param_groups(params: Iterable[nn.Parameter], weight_decay: float) -> list[dict[str, Any]]:
    """Decay matrices and embeddings, not biases and norm weights (decided by ndim, so a TP
    shard and the full tensor land in the same group)."""
    params = list(params)
    decay = [p for p in params if p.ndim >= 2]
    rest = [p for p in params if p.ndim < 2]
    return [g for g in ({"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}) if g["params"]]


def build_optimizer(params: Iterable[nn.Parameter], opt: OptimizerPlan) -> torch.optim.Optimizer:
    groups = param_groups(params, opt.weight_decay)
    if opt.name == "adamw":
        return torch.optim.AdamW(groups, lr=opt.lr, betas=opt.betas, eps=opt.eps)
    if opt.name == "adam":
        return torch.optim.Adam(groups, lr=opt.lr, betas=opt.betas, eps=opt.eps)
    if opt.name == "sgd":
        return torch.optim.SGD(groups, lr=opt.lr, momentum=opt.momentum)
    raise ValueError(f"unknown optimizer {opt.name!r}; expected adamw, adam or sgd")


def lr_factor(schedule: LrSchedulePlan, base_lr: float, total_steps: int) -> Callable[[int], float]:
    """LambdaLR factor for step index `i` (0-based): linear warm-up, then constant / cosine /
    linear decay to min_lr at the last step."""
    if schedule.name not in ("constant", "cosine", "linear"):
        raise ValueError(f"unknown lr schedule {schedule.name!r}; expected constant, cosine or linear")
    floor = schedule.min_lr / base_lr if base_lr > 0 else 0.0
    warmup = schedule.warmup

    def factor(i: int) -> float:
        if i < warmup:
            return (i + 1) / warmup
        if schedule.name == "constant":
            return 1.0
        progress = min(1.0, (i - warmup) / max(1, total_steps - warmup - 1))
        if schedule.name == "cosine":
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
        return 1.0 - (1 - floor) * progress

    return factor


def parameter_dtype(precision: str) -> torch.dtype:
    """The dtype of the parameters, gradients and optimizer state: float32 (bf16 and fp16 run
    under autocast over float32 weights), float64 for ``fp64``."""
    return torch.float64 if precision == "fp64" else torch.float32


def autocast_factory(precision: str, device: torch.device) -> Callable[[], contextlib.AbstractContextManager[Any]]:
    if precision in ("fp32", "fp64"):
        return contextlib.nullcontext
    if precision == "bf16":
        return lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    if precision == "fp16":
        if device.type != "cuda":
            raise ValueError("precision = fp16 needs CUDA; use bf16 on CPU")
        return lambda: torch.autocast("cuda", dtype=torch.float16)
    raise ValueError(f"unknown precision {precision!r}; expected fp32, bf16, fp16 or fp64")


class LossScaler:
    """Dynamic loss scaling for fp16 (the same rule as torch.amp.GradScaler)."""

    def __init__(self, init: float = 2.0**16, growth_interval: int = 2000) -> None:
        self.scale = init
        self.growth_interval = growth_interval
        self._good_steps = 0

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale /= 2
            self._good_steps = 0
            return
        self._good_steps += 1
        if self._good_steps % self.growth_interval == 0:
            self.scale *= 2
