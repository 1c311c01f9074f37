"""Megatron-style 1D tensor-parallel layers, built by slicing a full (unsharded) module.

Every layer keeps the source module's parameter names (`weight`, `bias`) and weight layout
(`nn.Linear` stores [out, in]; transformers' GPT-2 `Conv1D` stores [in, out]), holding only this
rank's shard, so a full state-dict entry maps onto a local one by a slice (`local_shard`) and
back by a concatenation (`merge_shards`).

The tensor-parallel group is always an explicit argument; tp rank and size come from
`dist.get_rank(group)` / `dist.get_world_size(group)`.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import Any, Literal, cast

import attrs
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from ppdsl.core.phrasing import not_divisible_by_tp

from .comm import (
    copy_to_tp,
    gather_from_tp,
    gather_seq,
    reduce_from_tp,
    reduce_scatter_seq,
    scatter_to_tp,
    tp_rank,
    tp_size,
)

__all__ = [
    "ColumnParallelLinear",
    "Layout",
    "Partition",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "padded_size",
    "replace_module",
    "shard_column",
    "shard_lm_head",
    "shard_row",
    "shard_vocab_embedding",
    "vocab_parallel_cross_entropy",
]

Layout = Literal["linear", "conv1d"]
Reduction = Literal["mean", "sum", "none"]


# ---------------------------------------------------------------------------------------------
# Partition arithmetic (pure)
# ---------------------------------------------------------------------------------------------


def padded_size(size: int, tp: int, pad_to: int | None) -> int:
    """`size` rounded up to a multiple of `pad_to` (unchanged when None); must divide by `tp`."""
    if pad_to is not None and pad_to < 1:
        raise ValueError(f"pad_to must be a positive integer, got {pad_to}")
    if pad_to is None:
        if size % tp != 0:
            raise ValueError(not_divisible_by_tp(size, tp) + "; pad it with pad_to = a "
                             f"multiple of {tp} (e.g. {tp * 64})")
        return size
    padded = math.ceil(size / pad_to) * pad_to
    if padded % tp != 0:
        raise ValueError(not_divisible_by_tp(f"{size} padded to a multiple of pad_to = {pad_to} ({padded})", tp) +
                         f"; choose pad_to as a multiple of {tp}")
    return padded


@attrs.frozen
class Partition:
    """How one dimension of `size` real entries, padded to `padded`, is split over `tp` ranks.

    Rank `rank` owns padded indices [start, start + local); its real indices are [start, end).
    """

    size: int
    padded: int
    rank: int
    tp: int

    @classmethod
    def build(cls, size: int, rank: int, tp: int, pad_to: int | None = None) -> Partition:
        assert 0 <= rank < tp
        return cls(size=size, padded=padded_size(size, tp, pad_to), rank=rank, tp=tp)

    @property
    def local(self) -> int:
        return self.padded // self.tp

    @property
    def start(self) -> int:
        return self.rank * self.local

    @property
    def end(self) -> int:
        """End of the real (unpadded) indices held here; equals start when all are padding."""
        return max(self.start, min(self.start + self.local, self.size))

    def shard(self, full: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's slice of `full` along `dim`, zero-filled where it falls in the padding."""
        assert full.size(dim) == self.size, (full.shape, dim, self.size)
        real = full.narrow(dim, min(self.start, self.size), self.end - self.start)
        n_pad = self.local - (self.end - self.start)
        if n_pad == 0:
            return real
        pad_shape = list(full.shape)
        pad_shape[dim] = n_pad
        return torch.cat([real, full.new_zeros(pad_shape)], dim=dim)

    def merge(self, shards: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
        """Inverse of `shard` over all ranks (shards in tp-rank order)."""
        assert len(shards) == self.tp
        return torch.cat(list(shards), dim=dim).narrow(dim, 0, self.size)


def _source_dims(module: nn.Module) -> tuple[Layout, int, int]:
    """(layout, in_features, out_features) of an nn.Linear or a transformers Conv1D."""
    if isinstance(module, nn.Linear):
        return "linear", module.in_features, module.out_features
    # Duck-typed so this module never imports transformers.
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx"):
        conv = cast(Any, module)
        assert tuple(conv.weight.shape) == (conv.nx, conv.nf)
        return "conv1d", int(conv.nx), int(conv.nf)
    raise ValueError(
        f"expected nn.Linear or transformers Conv1D, got {type(module).__module__}."
        f"{type(module).__qualname__}"
    )


def _linear_params(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    weight, bias = module.weight, module.bias
    assert isinstance(weight, torch.Tensor)
    assert bias is None or isinstance(bias, torch.Tensor)
    return weight, bias


def _out_dim(layout: Layout) -> int:
    """Dim of the weight tensor that indexes output features."""
    return 0 if layout == "linear" else 1


def _matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            layout: Layout) -> torch.Tensor:
    if layout == "linear":
        return F.linear(x, weight, bias)
    # The same ops as transformers' Conv1D.forward (addmm on a 2-D view).
    out_shape = x.shape[:-1] + (weight.size(1),)
    flat = x.reshape(-1, x.size(-1))
    y = torch.addmm(bias, flat, weight) if bias is not None else flat @ weight
    return y.view(out_shape)


def _new_param(shape: tuple[int, ...], device: Any, dtype: Any) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, device=device, dtype=dtype))


class _GroupModule(nn.Module):
    """A module holding a process group: deepcopy shares the group (a communicator handle,
    which cannot be copied) and copies everything else."""

    group: ProcessGroup

    def __deepcopy__(self, memo: dict[int, Any]) -> _GroupModule:
        memo[id(self.group)] = self.group
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            new.__dict__[key] = copy.deepcopy(value, memo)
        return new


# ---------------------------------------------------------------------------------------------
# Column-parallel linear
# ---------------------------------------------------------------------------------------------


class ColumnParallelLinear(_GroupModule):
    """Y_i = X A_i: the output features are split over tp ranks.

    `fused = k` treats the output as k equal parts (GPT-2 c_attn: q|k|v) and splits each part
    separately, so the local output is [part_0_i | ... | part_{k-1}_i]. `pad_to` pads the
    output features (a vocabulary) with zero rows/columns; padding and `fused > 1` exclude each
    other. `gather_output` all-gathers the output into the full, original feature order (padding
    removed). With `sequence_parallel` the input arrives split on `seq_dim` and is all-gathered.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group: ProcessGroup,
        *,
        bias: bool = True,
        layout: Layout = "linear",
        fused: int = 1,
        gather_output: bool = False,
        pad_to: int | None = None,
        sequence_parallel: bool = False,
        seq_dim: int = 1,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        super().__init__()
        if layout not in ("linear", "conv1d"):
            raise ValueError(f"layout must be 'linear' or 'conv1d', got {layout!r}")
        if fused < 1 or out_features % fused != 0:
            raise ValueError(
                f"fused = {fused} must be a positive divisor of out_features = {out_features}"
            )
        if fused > 1 and pad_to is not None:
            raise ValueError("pad_to cannot be combined with fused > 1")
        self.group = group
        self.in_features = in_features
        self.out_features = out_features
        self.layout: Layout = layout
        self.fused = fused
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel
        self.seq_dim = seq_dim
        part = out_features // fused
        if fused > 1 and part % tp_size(group) != 0:
            raise ValueError(
                "fused column split: " + not_divisible_by_tp(
                    f"each of the {fused} parts of {out_features} output features ({part})", tp_size(group))
            )
        try:
            self.partition = Partition.build(part, tp_rank(group), tp_size(group), pad_to)
        except ValueError as e:
            raise ValueError(f"column split of {out_features} output features: {e}") from None
        self.out_features_per_partition = fused * self.partition.local
        local = self.out_features_per_partition
        shape = (local, in_features) if layout == "linear" else (in_features, local)
        self.weight = _new_param(shape, device, dtype)
        self.bias = _new_param((local,), device, dtype) if bias else None

    def local_shard(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of the full tensor for parameter `name` ('weight' or 'bias')."""
        if name not in ("weight", "bias"):
            raise ValueError(f"unknown parameter {name!r}")
        dim = _out_dim(self.layout) if name == "weight" else 0
        parts = full.chunk(self.fused, dim=dim)
        return torch.cat([self.partition.shard(p, dim) for p in parts], dim=dim)

    def merge_shards(self, name: str, shards: Sequence[torch.Tensor]) -> torch.Tensor:
        """The full tensor for parameter `name` from every rank's shard (tp-rank order)."""
        if name not in ("weight", "bias"):
            raise ValueError(f"unknown parameter {name!r}")
        dim = _out_dim(self.layout) if name == "weight" else 0
        per_rank = [s.chunk(self.fused, dim=dim) for s in shards]
        return torch.cat(
            [self.partition.merge([r[k] for r in per_rank], dim) for k in range(self.fused)],
            dim=dim,
        )

    @torch.no_grad()
    def copy_from_full(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """Fill the local parameters from full (unsharded) tensors."""
        self.weight.copy_(self.local_shard("weight", weight))
        if self.bias is not None:
            if bias is None:
                raise ValueError("layer has a bias but no full bias was given")
            self.bias.copy_(self.local_shard("bias", bias))

    def _gather(self, y: torch.Tensor) -> torch.Tensor:
        y = gather_from_tp(y, self.group)
        p = self.partition
        if self.fused > 1:
            # [.., tp * (k * local)] -> [.., k * (tp * local)]: restore q|k|v part order.
            lead = y.shape[:-1]
            y = y.view(*lead, p.tp, self.fused, p.local).transpose(-3, -2).reshape(*lead, -1)
        elif p.padded != p.size:
            y = y[..., : p.size]
        return y

    # Set (by the stage builder) when the module enclosing this layer all-gathers its
    # sequence-split input itself (`gather_seq` at the entry of an attention / MLP module that
    # reads the sequence length from its input): the input is then already the full, gathered
    # sequence and the layer does no communication of its own.
    input_gathered: bool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.size(-1) != self.in_features:  # `ppdsl check` refuses such layouts (E0219); a last guard
            raise ValueError(f"a column-parallel layer takes the whole input ({self.in_features} features) but got "
                             f"{x.size(-1)}: a tensor split over tp reaches it")
        if self.input_gathered:
            pass
        elif self.sequence_parallel:
            x = gather_seq(x, self.group, self.seq_dim)
        else:
            x = copy_to_tp(x, self.group)
        y = _matmul(x, self.weight, self.bias, self.layout)
        return self._gather(y) if self.gather_output else y

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features}, "
            f"local_out={self.out_features_per_partition}, layout={self.layout}, "
            f"fused={self.fused}, gather_output={self.gather_output}, bias={self.bias is not None}"
            f", sequence_parallel={self.sequence_parallel}"
        )


# ---------------------------------------------------------------------------------------------
# Row-parallel linear
# ---------------------------------------------------------------------------------------------


class RowParallelLinear(_GroupModule):
    """Z = sum_i X_i B_i: the input features are split; the output is all-reduced (or
    reduce-scattered on `seq_dim` with `sequence_parallel`) and the full bias added once after.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group: ProcessGroup,
        *,
        bias: bool = True,
        layout: Layout = "linear",
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        seq_dim: int = 1,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        super().__init__()
        if layout not in ("linear", "conv1d"):
            raise ValueError(f"layout must be 'linear' or 'conv1d', got {layout!r}")
        size = tp_size(group)
        if in_features % size != 0:
            raise ValueError(
                "row split: " + not_divisible_by_tp(f"in_features = {in_features}", size)
            )
        if sequence_parallel and not input_is_parallel:
            raise ValueError("sequence_parallel needs input_is_parallel = True")
        self.group = group
        self.in_features = in_features
        self.out_features = out_features
        self.layout: Layout = layout
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = sequence_parallel
        self.seq_dim = seq_dim
        self.partition = Partition.build(in_features, tp_rank(group), size)
        local = self.partition.local
        self.in_features_per_partition = local
        shape = (out_features, local) if layout == "linear" else (local, out_features)
        self.weight = _new_param(shape, device, dtype)
        self.bias = _new_param((out_features,), device, dtype) if bias else None

    def _in_dim(self) -> int:
        return 1 - _out_dim(self.layout)

    def local_shard(self, name: str, full: torch.Tensor) -> torch.Tensor:
        if name == "weight":
            return self.partition.shard(full, self._in_dim())
        if name == "bias":
            return full  # replicated
        raise ValueError(f"unknown parameter {name!r}")

    def merge_shards(self, name: str, shards: Sequence[torch.Tensor]) -> torch.Tensor:
        if name == "weight":
            return self.partition.merge(shards, self._in_dim())
        if name == "bias":
            return shards[0]
        raise ValueError(f"unknown parameter {name!r}")

    @torch.no_grad()
    def copy_from_full(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight.copy_(self.local_shard("weight", weight))
        if self.bias is not None:
            if bias is None:
                raise ValueError("layer has a bias but no full bias was given")
            self.bias.copy_(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.group)
        if x.size(-1) != self.in_features_per_partition:  # `ppdsl check` refuses such layouts (E0212)
            raise ValueError(f"a row-parallel layer takes its input split over tp ({self.in_features_per_partition} of "
                             f"{self.in_features} features) but got {x.size(-1)}: no column split feeds it")
        y = _matmul(x, self.weight, None, self.layout)
        if not self.sequence_parallel:
            y = reduce_from_tp(y, self.group)
            return y + self.bias if self.bias is not None else y
        y = reduce_scatter_seq(y, self.group, self.seq_dim)
        if self.bias is None:
            return y
        # Each rank adds the bias to its own sequence block only, so its gradient is partial;
        # copy_to_tp all-reduces it in backward (out_features values) to keep the replicated
        # bias exact without a separate gradient sync.
        return y + copy_to_tp(self.bias, self.group)

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, local_in={self.in_features_per_partition}, "
            f"out={self.out_features}, layout={self.layout}, bias={self.bias is not None}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


# ---------------------------------------------------------------------------------------------
# Vocab-parallel embedding
# ---------------------------------------------------------------------------------------------


class VocabParallelEmbedding(_GroupModule):
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
        self.weight = _new_param((p.local, embedding_dim), device, dtype)

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
        x = logits.float()
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


# ---------------------------------------------------------------------------------------------
# Sharding a full module
# ---------------------------------------------------------------------------------------------


def shard_column(
    module: nn.Module,
    group: ProcessGroup,
    *,
    fused: int = 1,
    gather_output: bool = False,
    pad_to: int | None = None,
    sequence_parallel: bool = False,
    seq_dim: int = 1,
) -> ColumnParallelLinear:
    """This rank's column-parallel shard of a full nn.Linear / Conv1D."""
    layout, n_in, n_out = _source_dims(module)
    w, b = _linear_params(module)
    new = ColumnParallelLinear(
        n_in, n_out, group, bias=b is not None, layout=layout, fused=fused,
        gather_output=gather_output, pad_to=pad_to, sequence_parallel=sequence_parallel,
        seq_dim=seq_dim, device=w.device, dtype=w.dtype,
    )
    new.copy_from_full(w, b)
    new.train(module.training)
    return new


def shard_row(
    module: nn.Module,
    group: ProcessGroup,
    *,
    input_is_parallel: bool = True,
    sequence_parallel: bool = False,
    seq_dim: int = 1,
) -> RowParallelLinear:
    """This rank's row-parallel shard of a full nn.Linear / Conv1D."""
    layout, n_in, n_out = _source_dims(module)
    w, b = _linear_params(module)
    new = RowParallelLinear(
        n_in, n_out, group, bias=b is not None, layout=layout,
        input_is_parallel=input_is_parallel, sequence_parallel=sequence_parallel,
        seq_dim=seq_dim, device=w.device, dtype=w.dtype,
    )
    new.copy_from_full(w, b)
    new.train(module.training)
    return new


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


def shard_lm_head(
    module: nn.Module,
    group: ProcessGroup,
    *,
    pad_to: int | None = None,
    gather_output: bool = False,
) -> ColumnParallelLinear:
    """A column split of the vocabulary projection, padded like `shard_vocab_embedding` with the
    same `pad_to`, so a tied embedding and head hold identical shards. Without `gather_output`
    feed its output to `vocab_parallel_cross_entropy(..., head.partition.start,
    head.partition.end)`."""
    return shard_column(module, group, gather_output=gather_output, pad_to=pad_to)


def replace_module(root: nn.Module, path: str, new: nn.Module) -> nn.Module:
    """Replace the submodule at dotted `path` (e.g. 'transformer.h.0.attn.c_attn') by `new`;
    return the old one."""
    if not path:
        raise ValueError("module path must not be empty")
    parent_path, _, name = path.rpartition(".")
    try:
        parent = root.get_submodule(parent_path) if parent_path else root
    except AttributeError as e:
        raise ValueError(f"no module at {path!r}: {e}") from None
    old = parent._modules.get(name)
    if old is None:
        raise ValueError(f"no module at {path!r} (parent {type(parent).__name__} has no "
                         f"submodule {name!r})")
    setattr(parent, name, new)
    return old
