"""Column splits that keep the layer whole and compute only this rank's rows.

Two cases, one layer. Key / value projections with fewer kv heads than tp ranks (tp a multiple of
them): rank r holds query heads [r * H / tp, (r + 1) * H / tp), which all read kv head
r // (tp / kv_heads) under transformers' repeat_kv, so it computes that head's rows. And column
splits divided part by part (the plan's ``kv_parts``: GPTBigCode's and Falcon's multi-query
projections are q | k | v, of which each rank computes its 1/tp of q and the one k and v head):
the rows `ppdsl.core.own_tp.part_rows` gives. A rank's gradient covers only its rows, and a row held
by several ranks (a replicated head) gets a part from each, so the gradients are summed over tp
(the parameters are marked like sequence-parallel ones); its input gradient is only this rank's
part: the input enters through copy_to_tp (identity forward, all-reduce backward) as a
column-parallel layer's does.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ppdsl.core.own_tp import Parts, part_rows

__all__ = ["KvReplicatedLinear", "replicate_rows"]


class KvReplicatedLinear(nn.Linear):
    """An nn.Linear (same parameters, same names) whose forward produces its ``rows`` ranges."""

    rows: tuple[tuple[int, int], ...]
    group: Any

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from ppdsl.runtime.parallel.tp.comm import copy_to_tp

        if len(self.rows) == 1:
            (start, end), = self.rows
            weight, bias = self.weight[start:end], None if self.bias is None else self.bias[start:end]
        else:
            weight = torch.cat([self.weight[s:e] for s, e in self.rows])
            bias = None if self.bias is None else torch.cat([self.bias[s:e] for s, e in self.rows])
        return F.linear(copy_to_tp(x, self.group), weight, bias)


def replicate_rows(module: nn.Module, parts: Parts, group: Any) -> nn.Module:
    """Turn the column-split layer ``module`` (an nn.Linear, parameters kept) into this rank's
    KvReplicatedLinear over ``parts`` (`ppdsl.core.own_tp.Parts`); its parameters get
    ``sequence_parallel = True`` (gradients summed over tp)."""
    if not isinstance(module, nn.Linear):
        raise ValueError(f"a projection split part by part must be an nn.Linear, got {type(module).__name__}")
    import torch.distributed as dist

    tp_rank, tp_size = dist.get_rank(group), dist.get_world_size(group)
    assert sum(w for w, _ in parts) == module.out_features, (parts, module.out_features)
    module.__class__ = KvReplicatedLinear
    replicated: Any = module
    replicated.rows = part_rows(parts, tp_size, tp_rank)
    replicated.group = group
    for p in module.parameters(recurse=False):
        p.sequence_parallel = True  # type: ignore[attr-defined]
    return module
