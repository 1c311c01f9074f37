"""Megatron-style 1D tensor-parallel linears (column and row), built by slicing a full (unsharded) module.
The vocabulary-parallel embedding and cross-entropy are `runtime.parallel.tp.vocab`.

Every layer keeps the source module's parameter names (`weight`, `bias`) and weight layout
(`nn.Linear` stores [out, in]; transformers' GPT-2 `Conv1D` stores [in, out]), holding only this
rank's shard, so a full state-dict entry maps onto a local one by a slice (`local_shard`) and
back by a concatenation (`merge_shards`).

The tensor-parallel group is always an explicit argument; tp rank and size come from
`dist.get_rank(group)` / `dist.get_world_size(group)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

from ppdsl.core.phrasing import not_divisible_by_tp

from ppdsl.runtime.parallel.tp.comm import (
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
    "RowParallelLinear",
    "replace_module",
    "shard_column",
    "shard_lm_head",
    "shard_row",
]

from ppdsl.runtime.parallel.tp.partition import GroupModule, Layout, Partition, linear_params, matmul, new_param, out_dim, source_dims


# ---------------------------------------------------------------------------------------------
# Column-parallel linear
# ---------------------------------------------------------------------------------------------


class ColumnParallelLinear(GroupModule):
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
        self.weight = new_param(shape, device, dtype)
        self.bias = new_param((local,), device, dtype) if bias else None

    def local_shard(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of the full tensor for parameter `name` ('weight' or 'bias')."""
        if name not in ("weight", "bias"):
            raise ValueError(f"unknown parameter {name!r}")
        dim = out_dim(self.layout) if name == "weight" else 0
        parts = full.chunk(self.fused, dim=dim)
        return torch.cat([self.partition.shard(p, dim) for p in parts], dim=dim)

    def merge_shards(self, name: str, shards: Sequence[torch.Tensor]) -> torch.Tensor:
        """The full tensor for parameter `name` from every rank's shard (tp-rank order)."""
        if name not in ("weight", "bias"):
            raise ValueError(f"unknown parameter {name!r}")
        dim = out_dim(self.layout) if name == "weight" else 0
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
        y = matmul(x, self.weight, self.bias, self.layout)
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


class RowParallelLinear(GroupModule):
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
        self.weight = new_param(shape, device, dtype)
        self.bias = new_param((out_features,), device, dtype) if bias else None

    def _in_dim(self) -> int:
        return 1 - out_dim(self.layout)

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
        y = matmul(x, self.weight, None, self.layout)
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
    layout, n_in, n_out = source_dims(module)
    w, b = linear_params(module)
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
    layout, n_in, n_out = source_dims(module)
    w, b = linear_params(module)
    new = RowParallelLinear(
        n_in, n_out, group, bias=b is not None, layout=layout,
        input_is_parallel=input_is_parallel, sequence_parallel=sequence_parallel,
        seq_dim=seq_dim, device=w.device, dtype=w.dtype,
    )
    new.copy_from_full(w, b)
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
