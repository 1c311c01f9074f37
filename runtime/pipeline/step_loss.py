"""The step's loss from its microbatches' losses: ``sum_losses`` adds them in one fixed order (the
executor, the evaluator and the single-process reference all add through it, so their sums
agree), and ``_loss_dtype`` is the dtype the step's loss is summed over the world in.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ppdsl.core.task_loss import at_least_fp32
from ppdsl.runtime.parallel.groups import ProcessGroups


def _loss_dtype(groups: ProcessGroups, params: torch.dtype) -> torch.dtype:
    """What the step's loss is summed over the world in: float64 under context parallelism,
    whose cp shares of each microbatch's mean add up there (`runtime.parallel.context`), and
    with float64 parameters (precision = fp64); float32 otherwise."""
    return torch.float64 if groups.layout.cp > 1 or params == torch.float64 else torch.float32


def sum_losses(losses: Sequence[torch.Tensor]) -> torch.Tensor:
    """The step loss from per-microbatch (scaled) losses; the reference uses the same routine
    so that both add in the same order."""
    def value(loss: torch.Tensor) -> torch.Tensor:  # float64 stays (context parallelism's shares)
        return at_least_fp32(loss.detach())

    total = value(losses[0])
    for loss in losses[1:]:
        total = total + value(loss)
    return total
