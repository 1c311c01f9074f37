"""How a tensor-parallel layer cuts a full dimension (pure arithmetic: `Partition`, `padded_size`),
and what every parallel layer shares: the source module's layout and the group it splits over.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import Any, Literal, cast

import attrs
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from ppdsl.core.phrasing import not_divisible_by_tp



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


def source_dims(module: nn.Module) -> tuple[Layout, int, int]:
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


def linear_params(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    weight, bias = module.weight, module.bias
    assert isinstance(weight, torch.Tensor)
    assert bias is None or isinstance(bias, torch.Tensor)
    return weight, bias


def out_dim(layout: Layout) -> int:
    """Dim of the weight tensor that indexes output features."""
    return 0 if layout == "linear" else 1


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            layout: Layout) -> torch.Tensor:
    if layout == "linear":
        return F.linear(x, weight, bias)
    # The same ops as transformers' Conv1D.forward (addmm on a 2-D view).
    out_shape = x.shape[:-1] + (weight.size(1),)
    flat = x.reshape(-1, x.size(-1))
    y = torch.addmm(bias, flat, weight) if bias is not None else flat @ weight
    return y.view(out_shape)


def new_param(shape: tuple[int, ...], device: Any, dtype: Any) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, device=device, dtype=dtype))


class GroupModule(nn.Module):
    """A module holding a process group: deepcopy shares the group (a communicator handle,
    which cannot be copied) and copies everything else."""

    group: ProcessGroup

    def __deepcopy__(self, memo: dict[int, Any]) -> GroupModule:
        memo[id(self.group)] = self.group
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            new.__dict__[key] = copy.deepcopy(value, memo)
        return new
