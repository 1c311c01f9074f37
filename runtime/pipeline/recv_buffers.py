"""The executor's receive buffers: one pool per rank, allocated once before training, as large as
the most buffers the rank's precomputed steps ever hold (runtime/pipeline/executor.py)."""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence

import torch

from ppdsl.core.schedules.ir import Op
from ppdsl.core.schedules.messages import Message, Step

__all__ = ["BufferPool", "buffers_in_use"]


class BufferPool:
    """Receive buffers of one shape and dtype, reused across microbatches and steps."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        self.shape, self.dtype, self.device = shape, dtype, device
        self._free: list[torch.Tensor] = []
        self.allocated = 0

    def _new(self) -> torch.Tensor:
        self.allocated += 1
        return torch.empty(self.shape, dtype=self.dtype, device=self.device)

    def take(self) -> torch.Tensor:
        return self._free.pop() if self._free else self._new()

    def give(self, t: torch.Tensor) -> None:
        self._free.append(t)

    def reserve(self, n: int) -> None:
        """Allocate up front so that a step never allocates (`n`: the most buffers in use)."""
        self._free += [self._new() for _ in range(n - len(self._free))]


def buffers_in_use(steps: Sequence[Step], split_backward: bool, forward_only: bool = False,
                   held: Callable[[Message], bool] | None = None) -> int:
    """The most receive buffers a rank holds at once when running `steps`: a buffer is taken
    when its receive is posted and given back when its (microbatch, stage) is done (after F
    when evaluating, else after the last of B / W). `held`: count only the messages it accepts
    (one pool's: the boundaries of one shape)."""
    def counted(m: Message) -> bool:
        return held is None or held(m)

    live = peak = 0
    holding: collections.Counter[tuple[int, int]] = collections.Counter()
    for step in steps:
        live += sum(1 for m in step.post if counted(m))
        peak = max(peak, live)
        a = step.action
        if step.needs is not None and counted(step.needs):
            holding[(a.microbatch, a.stage)] += 1
        done = forward_only or a.op is (Op.W if split_backward else Op.B)
        if done:
            live -= holding.pop((a.microbatch, a.stage), 0)
    return peak
