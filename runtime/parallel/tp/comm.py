"""Autograd-aware collectives for Megatron-style 1D tensor parallelism (the f / g operators).

Every function takes the tensor-parallel process group explicitly. With a group of size 1 each
one returns its input unchanged, so a tp=1 plan runs the same code without communication.

Naming follows Megatron-LM's mappings:

==================== ======================== ========================
function             forward                  backward
==================== ======================== ========================
copy_to_tp   (f)     identity                 all-reduce
reduce_from_tp (g)   all-reduce               identity
gather_from_tp       all-gather (last dim)    split (last dim)
scatter_to_tp        split (last dim)         all-gather (last dim)
gather_seq           all-gather (seq dim)     reduce-scatter (seq dim)
reduce_scatter_seq   reduce-scatter (seq dim) all-gather (seq dim)
scatter_seq          split (seq dim)          all-gather (seq dim)
gather_seq_replicated all-gather (seq dim)    split (seq dim)
==================== ======================== ========================

``gather_seq`` leaves the sequence-parallel region into tensor-parallel work (the gradient that
comes back is partial on each rank, so it is summed); ``gather_seq_replicated`` leaves it into
replicated work (a head every tp rank computes in full: each rank's gradient is already the
whole one, so it is only split).

The sequence dim defaults to 1 because HF models are batch-first ([batch, seq, hidden]).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = [
    "all_reduce_grads",
    "copy_to_tp",
    "gather_from_tp",
    "gather_seq",
    "gather_seq_replicated",
    "reduce_from_tp",
    "reduce_scatter_seq",
    "scatter_seq",
    "scatter_to_tp",
    "tp_rank",
    "tp_size",
]


def all_reduce_grads(params: Iterable[torch.nn.Parameter], group: ProcessGroup) -> None:
    """Sum the gradients of replicated parameters over the group, in one flat all-reduce.

    With sequence parallelism, parameters used on the sequence-split activations (layer norms
    between a row and the next column split) get only this rank's share of the gradient; call
    this after backward for them. Parameters without a gradient are skipped.
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads or tp_size(group) == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def tp_rank(group: ProcessGroup) -> int:
    """This process's rank inside the tensor-parallel group."""
    return dist.get_rank(group)


def tp_size(group: ProcessGroup) -> int:
    """The number of ranks in the tensor-parallel group."""
    return dist.get_world_size(group)


# ---------------------------------------------------------------------------------------------
# Raw (non-autograd) collectives
# ---------------------------------------------------------------------------------------------


def _all_reduce(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    # all_reduce works in place; clone so the autograd input is never mutated.
    out = x.contiguous().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out


def _split(x: torch.Tensor, group: ProcessGroup, dim: int) -> torch.Tensor:
    size = tp_size(group)
    if x.size(dim) % size != 0:
        raise ValueError(
            f"cannot split dim {dim} of size {x.size(dim)} evenly over {size} tensor-parallel ranks"
        )
    return x.chunk(size, dim=dim)[tp_rank(group)].contiguous()


def _gather(x: torch.Tensor, group: ProcessGroup, dim: int) -> torch.Tensor:
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(tp_size(group))]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=dim)


def _reduce_scatter(x: torch.Tensor, group: ProcessGroup, dim: int) -> torch.Tensor:
    size = tp_size(group)
    if x.size(dim) % size != 0:
        raise ValueError(
            f"cannot reduce-scatter dim {dim} of size {x.size(dim)} over {size} tensor-parallel ranks"
        )
    chunks = [c.contiguous() for c in x.chunk(size, dim=dim)]
    out = torch.empty_like(chunks[0])
    dist.reduce_scatter(out, chunks, op=dist.ReduceOp.SUM, group=group)
    return out


# ---------------------------------------------------------------------------------------------
# Autograd functions
# ---------------------------------------------------------------------------------------------


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _gather(x, group, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _split(grad, ctx.group, ctx.dim), None, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _split(x, group, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _gather(grad, ctx.group, ctx.dim), None, None


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _gather(x, group, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _reduce_scatter(grad, ctx.group, ctx.dim), None, None


class _ReduceScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter(x, group, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _gather(grad, ctx.group, ctx.dim), None, None


# ---------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------


def copy_to_tp(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """f: identity forward, all-reduce of the gradient backward (entry of a column split)."""
    if tp_size(group) == 1:
        return x
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """g: all-reduce (sum) forward, identity backward (exit of a row split)."""
    if tp_size(group) == 1:
        return x
    return _ReduceFromTP.apply(x, group)


def gather_from_tp(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """All-gather along the last dim forward; keep this rank's slice of the gradient backward."""
    if tp_size(group) == 1:
        return x
    return _GatherFromTP.apply(x, group, x.dim() - 1)


def scatter_to_tp(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Keep this rank's slice of the last dim forward; all-gather the gradient backward."""
    if tp_size(group) == 1:
        return x
    return _ScatterToTP.apply(x, group, x.dim() - 1)


def gather_seq(x: torch.Tensor, group: ProcessGroup, dim: int = 1) -> torch.Tensor:
    """Sequence parallel entry of a column split: all-gather on `dim`, reduce-scatter backward."""
    if tp_size(group) == 1:
        return x
    return _GatherSeq.apply(x, group, dim % x.dim())


def reduce_scatter_seq(x: torch.Tensor, group: ProcessGroup, dim: int = 1) -> torch.Tensor:
    """Sequence parallel exit of a row split: reduce-scatter on `dim`, all-gather backward."""
    if tp_size(group) == 1:
        return x
    return _ReduceScatterSeq.apply(x, group, dim % x.dim())


def scatter_seq(x: torch.Tensor, group: ProcessGroup, dim: int = 1) -> torch.Tensor:
    """Enter the sequence-parallel region from a replicated tensor: split on `dim` forward,
    all-gather the gradient backward."""
    if tp_size(group) == 1:
        return x
    return _ScatterToTP.apply(x, group, dim % x.dim())


def gather_seq_replicated(x: torch.Tensor, group: ProcessGroup, dim: int = 1) -> torch.Tensor:
    """Leave the sequence-parallel region into replicated computation: all-gather on `dim`
    forward; backward keeps this rank's slice of the (replicated, already complete) gradient."""
    if tp_size(group) == 1:
        return x
    return _GatherFromTP.apply(x, group, dim % x.dim())
