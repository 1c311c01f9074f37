"""Data-dependent code run on meta tensors, which hold no values: each value read takes the
plain path (the own-forward trace and the cut proof run model code this way, and a stage's
stand-in runs the module it stands in for so, to learn its output's shape)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

__all__ = ["meta_autocast", "meta_values", "scalar_reads", "without_values"]


def scalar_reads() -> dict[Any, Any]:
    """What reading a value of a meta tensor gives in the traces (it holds none): the plain path."""
    import torch

    T = torch.Tensor
    # `0 in mask` (4.x masks) as for a mask without padding
    return {T.item: 0, T.__bool__: False, T.__int__: 0, T.__float__: 0.0, T.__index__: 0, T.__contains__: False}


def without_values(func: Any, args: tuple[Any, ...], reads: dict[Any, Any]) -> tuple[bool, Any]:
    """(True, what a value read gives) for a read of a meta tensor's value, else (False, the
    arguments with each 0-dim integer meta tensor used as an index read as 0: an eager MoE's
    ``expert_mask[expert_idx]``; beside a meta tensor, each 0-dim tensor of another device on
    meta, `_scalar_on_meta`)."""
    import torch

    if func in reads and args and getattr(args[0], "is_meta", False):
        return True, reads[func]
    if func is torch.Tensor.__getitem__ and len(args) == 2:
        def plain(i: Any) -> Any:
            if isinstance(i, torch.Tensor) and i.is_meta and i.dim() == 0 and not i.is_floating_point() \
                    and i.dtype != torch.bool:
                return 0
            return i
        index = tuple(plain(i) for i in args[1]) if isinstance(args[1], tuple) else plain(args[1])
        return False, (args[0], index)
    if any(getattr(a, "is_meta", False) for a in args):
        return False, tuple(_scalar_on_meta(a) for a in args)
    return False, args


@contextlib.contextmanager
def meta_autocast() -> Iterator[None]:
    """``torch.autocast(device_type="meta", ...)`` as the CPU's: transformers 4.x rotary embeddings
    switch autocast off on their input's device type, which torch does not know for meta. And
    transformers' checks of values (``torch_compilable_check``: an image-text model's count of
    image tokens against its image features) off: meta holds no values to check, and the
    traces run with these contexts only."""
    import os

    import torch

    plain = torch.autocast

    class MetaAutocast(plain):  # type: ignore[misc, valid-type]
        def __init__(self, device_type: str, *args: Any, **kwargs: Any) -> None:
            super().__init__("cpu" if device_type == "meta" else device_type, *args, **kwargs)

    torch.autocast = MetaAutocast  # type: ignore[misc]
    checks = os.environ.get(_HF_CHECKS)
    os.environ[_HF_CHECKS] = "1"
    try:
        yield
    finally:
        torch.autocast = plain  # type: ignore[misc]
        if checks is None:
            os.environ.pop(_HF_CHECKS, None)
        else:
            os.environ[_HF_CHECKS] = checks


_HF_CHECKS = "TRANSFORMERS_DISABLE_TORCH_CHECK"


@contextlib.contextmanager
def meta_values() -> Iterator[None]:
    """Data-dependent code on meta tensors takes its plain path: value reads as `scalar_reads`,
    0-dim indices as 0, ``nonzero`` as if every element were non-zero (an eager MoE runs every
    expert on every token, each once)."""
    import torch.fx.experimental._config as fx_config
    from torch.overrides import TorchFunctionMode

    reads = scalar_reads()

    class MetaValues(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
            done, value = without_values(func, args, reads)
            return value if done else func(*value, **(kwargs or {}))

    with fx_config.patch(meta_nonzero_assume_all_nonzero=True), meta_autocast(), MetaValues():
        yield


def _scalar_on_meta(value: Any) -> Any:
    """A 0-dim tensor of another device beside meta tensors, on meta: a real device takes a 0-dim CPU
    tensor beside its own as a scalar (DistilBERT's 4.x ``masked_fill(mask, torch.tensor(min))``),
    the meta device refuses the mix."""
    import torch

    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_meta:
        return value.to("meta")
    return value
