"""Key / value projections with fewer kv heads than tp ranks (tp a multiple of them).

Each rank keeps the projection whole (replicated) and computes only the rows of the kv head its
query heads use: rank r holds query heads [r * H / tp, (r + 1) * H / tp), which all read kv head
r // (tp / kv_heads) under transformers' repeat_kv. A rank's gradient covers only those rows,
so the gradients are summed over tp (the parameters are marked like sequence-parallel ones), and
its input gradient only this rank's heads' part: the input enters through copy_to_tp (identity
forward, all-reduce backward) as a column-parallel layer's does.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["KvReplicatedLinear", "replicate_kv_heads"]


class KvReplicatedLinear(nn.Linear):
    """An nn.Linear (same parameters, same names) whose forward produces rows [start, end)."""

    rows: tuple[int, int]
    group: Any

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from .comm import copy_to_tp

        start, end = self.rows
        bias = self.bias[start:end] if self.bias is not None else None
        return F.linear(copy_to_tp(x, self.group), self.weight[start:end], bias)


def replicate_kv_heads(module: nn.Module, kv_heads: int, group: Any) -> nn.Module:
    """Turn the kv projection `module` (an nn.Linear, parameters kept) into this rank's
    KvReplicatedLinear; its parameters get ``sequence_parallel = True`` (gradients summed over tp)."""
    if not isinstance(module, nn.Linear):
        raise ValueError(f"a key/value projection to replicate must be an nn.Linear, got {type(module).__name__}")
    import torch.distributed as dist

    tp_rank, tp_size = dist.get_rank(group), dist.get_world_size(group)
    assert tp_size % kv_heads == 0 and kv_heads < tp_size, (kv_heads, tp_size)
    head_dim = module.out_features // kv_heads
    kv = tp_rank // (tp_size // kv_heads)
    module.__class__ = KvReplicatedLinear
    replicated: Any = module
    replicated.rows = (kv * head_dim, (kv + 1) * head_dim)
    replicated.group = group
    for p in module.parameters(recurse=False):
        p.sequence_parallel = True  # type: ignore[attr-defined]
    return module
