"""Bytes of model state a rank holds, and the data-parallel traffic of one step, under each ZeRO
stage: the one estimate `ppdsl plan` (lowering/report.py) and `ppdsl tune` (lowering/costs.py)
both use.

`params` is the number of parameters of the rank's stages (already divided by tp). Weights,
gradients and optimizer moments are fp32 (4 bytes; autocast keeps the parameters fp32).

- zero 0 (replicas): every dp rank holds the weights, the gradients and the optimizer state whole.
- zero 1: the optimizer state of each parameter lives on one dp rank (1/dp of it per rank); the
  gradients are accumulated whole over the microbatches and reduce-scattered once per step.
- zero 3 (FSDP2): at rest a rank holds 1/dp of the weights, gradients and optimizer state. In the
  step it all-gathers the weights of its stages at the first forward of each chunk and keeps them
  whole through the backward of the last microbatch (reshard_after_forward = False), and
  accumulates whole gradients that are reduce-scattered once per step: the peak holds the whole
  weights and gradients, and its weight shard besides them. So zero 3's peak is zero 1's plus the
  weight shard (1/dp of the weights); what it saves over zero 1 is memory between steps.

Traffic (bytes a rank sends per step, ring algorithms): an all-reduce of N bytes sends
2 (dp - 1) / dp * N; a reduce-scatter and an all-gather each half of it. zero 0 all-reduces the
gradients, zero 1 reduce-scatters the gradients and all-gathers the updated weights, zero 3
all-gathers the weights and reduce-scatters the gradients: the same volume, once per step.
"""

from __future__ import annotations

import attrs

from ppdsl.dsl.schema import optimizer_slots  # noqa: F401  (re-exported: the optimizer's state per parameter)

BYTES = 4  # fp32 weights, gradients and optimizer moments
ZERO_STAGES = (0, 1, 3)  # = the stages rule E0315 accepts


@attrs.frozen
class StateBytes:
    """One rank's model state in bytes: the peak during a step, split in three, and at rest."""

    weights: int  # zero 3: the whole weights of its stages plus its shard (FSDP2 keeps both)
    grads: int  # the whole gradients, accumulated over the microbatches (zero 3: plus its shard)
    optimizer: int
    at_rest: int  # between steps (after the optimizer step)

    @property
    def peak(self) -> int:
        return self.weights + self.grads + self.optimizer


def state_bytes(params: float, dp: int, zero: int, slots: int) -> StateBytes:
    """The model state of a rank holding `params` parameters, under ZeRO stage `zero` over `dp`
    data-parallel ranks, with `slots` optimizer tensors per parameter."""
    assert zero in ZERO_STAGES, zero
    full = params * BYTES
    shard = full / dp
    if zero == 0 or dp == 1:
        # dp = 1: nothing to shard, every stage keeps everything (check warns: W0317)
        weights, grads, opt = full, full, slots * full
        return StateBytes(int(weights), int(grads), int(opt), int(weights + grads + opt))
    if zero == 1:
        # after the reduce-scatter a rank keeps only the gradients it owns
        return StateBytes(int(full), int(full), int(slots * shard), int(full + shard + slots * shard))
    # the whole gradients are freed group by group as the reduce-scatter fills the shards: at most
    # the whole ones at a time; the weight shards stay allocated under the whole weights
    return StateBytes(int(full + shard), int(full), int(slots * shard), int(shard + shard + slots * shard))


def dp_traffic_bytes(params: float, dp: int, zero: int) -> int:
    """Bytes a rank sends to its data-parallel peers per step (see the module doc)."""
    assert zero in ZERO_STAGES, zero
    if dp <= 1:
        return 0
    return int(2 * params * BYTES * (dp - 1) // dp)


def dp_collectives(zero: int) -> str:
    """What the data-parallel traffic of a step is made of, in words."""
    return {0: "gradient all-reduce", 1: "gradient reduce-scatter + weight all-gather",
            3: "weight all-gather + gradient reduce-scatter"}[zero]
