"""Which module holds a parameter, whether it is a tensor-parallel shard, and the gradients a
rank holds: what training, verify and export need to know of a stage's parameters."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ppdsl.runtime.parallel.fsdp import local


def owner_modules(module: nn.Module) -> dict[int, tuple[nn.Module, str]]:
    """id(param) -> (the module that registers it, its attribute name there)."""
    owners: dict[int, tuple[nn.Module, str]] = {}
    for sub in module.modules():
        for name, p in sub.named_parameters(recurse=False):
            owners.setdefault(id(p), (sub, name))
    return owners


def is_tp_sharded(p: nn.Parameter, owner: nn.Module, local: str, tp: int) -> bool:
    """Whether `p` holds a tensor-parallel shard (else it is replicated over tp). A TP layer
    tells by `merge_shards`: a replicated tensor (a row-parallel bias) merges to its own shape."""
    if tp == 1 or not hasattr(owner, "merge_shards") or getattr(owner, "split_over", "tp") != "tp":
        return False
    shard = torch.empty(p.shape, dtype=p.dtype, device="meta")  # p may be a dp-sharded DTensor
    return tuple(owner.merge_shards(local, [shard] * tp).shape) != tuple(p.shape)


def local_grads(params: Iterable[nn.Parameter]) -> list[torch.Tensor]:
    """The gradients this rank holds (ZeRO-3: its dp shards, sharing storage)."""
    return [local(p.grad) for p in params if p.grad is not None]
