"""Data-parallel gradient averaging: a bucketed all-reduce, once per step."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ppdsl.lowering.memory import BUCKET_BYTES  # noqa: F401  (lowering's memory model counts it)


def allreduce_average(grads: Sequence[torch.Tensor], group: Any, size: int, bucket_bytes: int = BUCKET_BYTES) -> None:
    """grads <- mean over `group`, flattened into buckets of about `bucket_bytes`."""
    pending = []
    for bucket in _buckets(grads, bucket_bytes):
        flat = torch.cat([g.reshape(-1) for g in bucket])
        pending.append((bucket, flat, dist.all_reduce(flat, group=group, async_op=True)))
    for bucket, flat, work in pending:
        work.wait()
        flat.div_(size)
        offset = 0
        for g in bucket:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def _buckets(grads: Sequence[torch.Tensor], bucket_bytes: int) -> list[list[torch.Tensor]]:
    out: list[list[torch.Tensor]] = []
    current: list[torch.Tensor] = []
    size = 0
    for g in grads:
        if current and (size + g.numel() * g.element_size() > bucket_bytes or g.dtype != current[0].dtype):
            out.append(current)
            current, size = [], 0
        current.append(g)
        size += g.numel() * g.element_size()
    if current:
        out.append(current)
    return out
