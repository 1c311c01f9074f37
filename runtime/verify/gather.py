"""Full tensors from a parallel run, for the comparison with the reference: each parameter or
gradient at its full shape (tensor-parallel and expert shards merged, ZeRO / FSDP shards gathered),
and all of them gathered on global rank 0. Collective.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ppdsl.runtime.parallel.expert import is_expert_shard
from ppdsl.runtime.parallel.fsdp import full
from ppdsl.runtime.stage.params import is_tp_sharded, owner_modules
from ppdsl.runtime.train.trainer import Trainer


def full_tensors(trainer: Trainer, kind: str) -> dict[str, torch.Tensor]:
    """name -> full-shape CPU copy of each local parameter (kind="param") or its gradient
    (kind="grad"). Collective over tp (and ep): every rank of those groups must call it."""
    tp = trainer.groups.layout.tp
    owners: dict[int, tuple[nn.Module, str]] = {}
    for stage in trainer.stages:
        owners.update(owner_modules(stage))
    out = {}
    # ZeRO-1 leaves each averaged gradient on its owner only: gather them (verification only)
    gathered = trainer.zero.gathered_gradients() if kind == "grad" and trainer.zero is not None else None
    for name, p in trainer.named_params:
        t = p.detach() if kind == "param" else p.grad if gathered is None else gathered[id(p)]
        if t is None:
            t = torch.zeros_like(p)
        t = full(t)  # ZeRO-3: the dp shards gathered (collective over dp)
        owner, local = owners[id(p)]
        if is_expert_shard(owner):  # its experts' rows from every rank of the ep group
            shards = [torch.empty_like(t) for _ in range(trainer.groups.layout.ep)]
            dist.all_gather(shards, t.contiguous(), group=trainer.groups.ep)
            t = owner.merge_shards(local, shards)
        elif is_tp_sharded(p, owner, local, tp):
            shards = [torch.empty_like(t) for _ in range(tp)]
            dist.all_gather(shards, t.contiguous(), group=trainer.groups.tp)
            t = owner.merge_shards(local, shards)
        out[name] = t.detach().cpu().clone()
    return out


def _gather_to_rank0(trainer: Trainer, kind: str) -> dict[str, torch.Tensor] | None:
    """Every parameter's full tensor on global rank 0 (None elsewhere). Collective."""
    g = trainer.groups
    mine = full_tensors(trainer, kind)
    if g.tp_rank != 0 or g.dp_rank != 0 or g.cp_rank != 0:
        mine = {}
    parts: list[Any] = [None] * g.layout.world if g.rank == 0 else None  # type: ignore[assignment]
    dist.gather_object(mine, parts, dst=0)
    if g.rank != 0:
        return None
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        merged.update(part)
    return merged
