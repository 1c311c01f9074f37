"""Vocabulary parallelism: the embedding split by vocabulary rows, and the cross-entropy over
vocabulary-split logits (Megatron's VocabParallelEmbedding / vocab_parallel_cross_entropy).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from ppdsl.core.task_loss import at_least_fp32

from ppdsl.runtime.parallel.tp.comm import (
    reduce_from_tp,
    reduce_scatter_seq,
    tp_rank,
    tp_size,
)

from ppdsl.runtime.parallel.tp.partition import GroupModule, Partition, Reduction, new_param


# ---------------------------------------------------------------------------------------------
# Vocab-parallel embedding
# ---------------------------------------------------------------------------------------------


class VocabParallelEmbedding(GroupModule):
    """Embedding rows split over tp ranks (padded to a multiple of `pad_to` with zero rows that
    are never selected): masked local lookup, then all-reduce (or, with `sequence_parallel`,
    reduce-scatter on `seq_dim`, so the output enters the sequence-parallel region split)."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        group: ProcessGroup,
        *,
        padding_idx: int | None = None,
        pad_to: int | None = None,
        sequence_parallel: bool = False,
        seq_dim: int = 1,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        super().__init__()
        self.group = group
        self.sequence_parallel = sequence_parallel
        self.seq_dim = seq_dim
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        try:
            self.partition = Partition.build(num_embeddings, tp_rank(group), tp_size(group), pad_to)
        except ValueError as e:
            raise ValueError(f"vocab-parallel embedding of {num_embeddings} rows: {e}") from None
        if padding_idx is not None and padding_idx < 0:
            padding_idx += num_embeddings
        self.padding_idx = padding_idx
        p = self.partition
        self.local_padding_idx = (
            padding_idx - p.start if padding_idx is not None and p.start <= padding_idx < p.end
            else None
        )
        self.weight = new_param((p.local, embedding_dim), device, dtype)

    @property
    def vocab_start(self) -> int:
        return self.partition.start

    @property
    def vocab_end(self) -> int:
        return self.partition.end

    def local_shard(self, name: str, full: torch.Tensor) -> torch.Tensor:
        if name != "weight":
            raise ValueError(f"unknown parameter {name!r}")
        return self.partition.shard(full, 0)

    def merge_shards(self, name: str, shards: Sequence[torch.Tensor]) -> torch.Tensor:
        if name != "weight":
            raise ValueError(f"unknown parameter {name!r}")
        return self.partition.merge(shards, 0)

    @torch.no_grad()
    def copy_from_full(self, weight: torch.Tensor) -> None:
        self.weight.copy_(self.local_shard("weight", weight))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        p = self.partition
        outside = (ids < p.start) | (ids >= p.end)
        local_ids = (ids - p.start).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight, self.local_padding_idx)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_seq(out, self.group, self.seq_dim)
        return reduce_from_tp(out, self.group)

    def extra_repr(self) -> str:
        p = self.partition
        return (
            f"{self.num_embeddings} (padded {p.padded}), {self.embedding_dim}, "
            f"rows=[{p.start}, {p.start + p.local}), padding_idx={self.padding_idx}"
        )


# ---------------------------------------------------------------------------------------------
# Vocab-parallel cross entropy
# ---------------------------------------------------------------------------------------------


class _VocabParallelCE(torch.autograd.Function):
    """Per-token cross entropy from vocab-sharded logits; forward exchanges 3 values per token
    (max, sum-exp, target logit), backward needs no communication."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, labels: torch.Tensor, group: ProcessGroup,
                vocab_start: int, vocab_end: int, ignore_index: int) -> torch.Tensor:
        x = at_least_fp32(logits)
        n_real = vocab_end - vocab_start
        if n_real < x.size(-1):
            x = x.clone()
            x[..., n_real:] = float("-inf")
        token_max = x.max(dim=-1).values
        dist.all_reduce(token_max, op=dist.ReduceOp.MAX, group=group)
        x = x - token_max.unsqueeze(-1)

        outside = (labels < vocab_start) | (labels >= vocab_end)
        local_labels = (labels - vocab_start).masked_fill(outside, 0)
        target = x.gather(-1, local_labels.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)

        exp = x.exp()
        # One all-reduce for both per-token sums.
        sums = torch.stack([exp.sum(dim=-1), target])
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        sum_exp, target = sums[0], sums[1]

        ignored = labels == ignore_index
        loss = (sum_exp.log() - target).masked_fill(ignored, 0.0)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_labels, outside | ignored, ignored)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        softmax, local_labels, no_target, ignored = ctx.saved_tensors
        # d loss / d logit = softmax - onehot(target); out of place so a retained graph can
        # run backward again.
        minus_one = (~no_target).to(softmax.dtype).neg().unsqueeze(-1)
        g = softmax.scatter_add(-1, local_labels.unsqueeze(-1), minus_one)
        g = g * grad.masked_fill(ignored, 0.0).unsqueeze(-1)
        return g.to(ctx.logits_dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(
    local_logits: torch.Tensor,
    labels: torch.Tensor,
    group: ProcessGroup,
    vocab_start: int,
    vocab_end: int,
    ignore_index: int = -100,
    reduction: Reduction = "mean",
) -> torch.Tensor:
    """Exact cross entropy of vocab-sharded logits without gathering them.

    `local_logits[..., :vocab_end - vocab_start]` are the logits of vocabulary entries
    [vocab_start, vocab_end); any further columns are padding and are treated as -inf.
    `reduction = "mean"` averages over tokens whose label is not `ignore_index` (like
    F.cross_entropy; NaN when every token is ignored). Computed in fp32.
    """
    if local_logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"logits {tuple(local_logits.shape)} and labels {tuple(labels.shape)} disagree"
        )
    if not 0 <= vocab_end - vocab_start <= local_logits.size(-1):
        raise ValueError(
            f"vocab range [{vocab_start}, {vocab_end}) does not fit {local_logits.size(-1)} "
            "local logits"
        )
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    loss = _VocabParallelCE.apply(local_logits, labels, group, vocab_start, vocab_end,
                                  ignore_index)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (labels != ignore_index).sum()


def shard_vocab_embedding(
    module: nn.Embedding,
    group: ProcessGroup,
    *,
    pad_to: int | None = None,
    sequence_parallel: bool = False,
    seq_dim: int = 1,
) -> VocabParallelEmbedding:
    """This rank's vocab-parallel shard of a full nn.Embedding."""
    if not isinstance(module, nn.Embedding):  # a spec naming the wrong module: a user error
        raise ValueError(f"expected nn.Embedding, got {type(module).__qualname__}")  # noqa: TRY004
    if module.max_norm is not None or module.sparse or module.scale_grad_by_freq:
        raise ValueError("vocab-parallel embedding supports no max_norm, sparse or "
                         "scale_grad_by_freq")
    w = module.weight
    new = VocabParallelEmbedding(
        module.num_embeddings, module.embedding_dim, group, padding_idx=module.padding_idx,
        pad_to=pad_to, sequence_parallel=sequence_parallel, seq_dim=seq_dim, device=w.device,
        dtype=w.dtype,
    )
    new.copy_from_full(w)
    new.train(module.training)
    return new
