"""Bytes of model state a rank holds, and the data-parallel traffic of one step, under each ZeRO
stage: the one estimate `ppdsl plan` (ppdsl/views/report.py) and `ppdsl tune` (lowering/costs.py)
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
- zero 3 with reshard_after_forward: the blocks free their whole weights after each forward and
  each backward, every microbatch; the roots (embeddings, head, norms of each chunk) keep theirs
  for the step. At the peak a rank holds its weight shard, its roots' whole weights and
  WHOLE_BLOCKS = 2 blocks' whole weights (the block whose backward runs and the one FSDP2
  prefetches; tests/test_fsdp.py measures at most 2 at once), never more than all its weights;
  the gradients still accumulate whole (reduce-scattered once per step) and the optimizer
  state is 1/dp. So the weights drop to about 1/dp at the peak; the gradients do not.
  benchmarks/bench_fsdp_memory.py (decoder spec, 59 M parameters, dp 2, pp = tp = 1) measured
  in-step peak RSS 1182 MiB (zero 0), 927-958 (zero 1), 896 (zero 3), 722-728 (zero 3 with
  resharding); `ppdsl plan` predicts 805 and 637 MiB of state + activations for the last two: the
  same drop, 168 MiB.

Traffic (bytes a rank sends per step, ring algorithms): an all-reduce of N bytes sends
2 (dp - 1) / dp * N; a reduce-scatter and an all-gather each half of it. zero 0 all-reduces the
gradients, zero 1 reduce-scatters the gradients and all-gathers the updated weights, zero 3
all-gathers the weights and reduce-scatters the gradients: the same volume, once per step.
With reshard_after_forward each block's weights are all-gathered for every microbatch's forward
and backward, and for a split backward's W too (a fused norm's backward reads its weight; a
first stage's W is its whole backward, after no B): 2 or 3 all-gathers of the block weights per
microbatch instead of one per step; the roots once per step.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from ppdsl.dsl.schema import optimizer_slots  # noqa: F401  (re-exported: the optimizer's state per parameter)

BYTES = 4  # fp32 weights, gradients and optimizer moments (bf16 / fp16 autocast keeps them fp32)


def value_bytes(precision: str) -> int:
    """Bytes of one weight, gradient, optimizer moment or activation value under ``precision``
    (train.precision): 8 under fp64, else `BYTES`."""
    return 8 if precision == "fp64" else BYTES

ZERO_STAGES = (0, 1, 3)  # = the stages rule E0315 accepts
# the data-parallel gradient sync's buckets (runtime/parallel/grad_sync.py, runtime/parallel/zero.py read it here)
BUCKET_BYTES = 25 * 2**20
WHOLE_BLOCKS = 2  # zero 3 + reshard_after_forward: blocks whole at once (one computing, one prefetched)


@attrs.frozen
class Resharded:
    """zero 3 with reshard_after_forward: a rank's parameters by how they are all-gathered."""

    roots: float  # parameters of its chunks' roots (first / last modules): whole for the step
    largest_block: float  # parameters of its largest block
    gathered_per_step: float  # block parameters all-gathered in a step, summed over the gathers
    gathers: int  # block all-gathers in a step


def resharded(stages: Sequence[tuple[Sequence[float], float, bool]], microbatches: int,
              split_backward: bool) -> Resharded:
    """`stages`: per stage a rank holds, (parameters of each block, of its root modules, whether it
    is the first stage). Each block is all-gathered for every microbatch's F and B, and for W
    under a split backward except on the first stage (whose W is its whole backward)."""
    roots = sum(r for _, r, _ in stages)
    largest = max((b for blocks, _, _ in stages for b in blocks), default=0.0)
    per_microbatch = [(blocks, 3 if split_backward and not first else 2) for blocks, _, first in stages]
    gathered = sum(sum(blocks) * microbatches * n for blocks, n in per_microbatch)
    return Resharded(roots, largest, gathered, sum(len(blocks) * microbatches * n for blocks, n in per_microbatch))


@attrs.frozen
class StateBytes:
    """One rank's model state in bytes: the peak during a step, split in three, and at rest."""

    weights: int  # zero 3: the whole weights of its stages (resharding: of its roots and 2 blocks) plus its shard
    grads: int  # the whole gradients, accumulated over the microbatches (zero 3: plus its shard)
    optimizer: int
    at_rest: int  # between steps (after the optimizer step)

    @property
    def peak(self) -> int:
        return self.weights + self.grads + self.optimizer


def state_bytes(params: float, dp: int, zero: int, slots: int, reshard: Resharded | None = None,
                value: int = BYTES) -> StateBytes:
    """The model state of a rank holding `params` parameters, under ZeRO stage `zero` over `dp`
    data-parallel ranks, with `slots` optimizer tensors per parameter; `reshard`: zero 3 with
    reshard_after_forward (ignored otherwise); `value`: bytes per value (`value_bytes`)."""
    assert zero in ZERO_STAGES, zero
    full = params * value
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
    rest = int(shard + shard + slots * shard)
    if reshard is not None:
        whole = min(params, reshard.roots + WHOLE_BLOCKS * reshard.largest_block) * value
        return StateBytes(int(whole + shard), int(full), int(slots * shard), rest)
    return StateBytes(int(full + shard), int(full), int(slots * shard), rest)


def optimizer_temporaries(name: str, weight_decay: float = 0.0) -> int:
    """How many tensors the size of one parameter torch's optimizer step keeps alive besides the
    state, per parameter, one parameter at a time (the single-tensor implementation torch runs on
    CPU; measured with runtime/memory_trace's counter on torch 2.13): AdamW's ``sqrt(v)`` and its
    ``/ bias_correction`` (2), Adam's as well and its ``grad + wd * p`` with weight decay (3),
    SGD's ``grad + wd * p`` with weight decay (1; its momentum buffer is updated in place). On
    CUDA torch defaults to the foreach implementation, whose temporaries span every parameter
    of a group at once: not modelled."""
    decay = 1 if weight_decay > 0 else 0
    return {"adamw": 2, "adam": 2 + decay}.get(name, decay)


Terms = tuple[tuple[str, int], ...]  # a phase's bytes by what holds them


@attrs.frozen
class StatePhases:
    """A rank's model state (bytes, by term) in the phases of a step after the pipeline has run
    (its activations freed): the gradient sync, then the optimizer step with its temporaries."""

    grad_sync: Terms
    optimizer: Terms


def state_phases(state: StateBytes, dp: int, zero: int, largest: float, temporaries: int,
                 value: int = BYTES) -> StatePhases:
    """`state`: `state_bytes`'s; `largest`: the rank's largest parameter (values, tp-local);
    `temporaries`: `optimizer_temporaries`. Each phase's buffers, as the runtime allocates them:

    - the sync: zero 0 over dp > 1 flattens every gradient into buckets all in flight at once
      (runtime/parallel/grad_sync.py: a second copy of the gradients); zero 1 reduce-scatters windows of
      `BUCKET_BYTES` per rank (a dp-window input and a window output) into the owned gradients'
      new buffers (1/dp of the gradients) while the whole ones live; zero 3 reduce-scatters into
      the shards (nothing beyond the step's peak state). Every stage checks the gradients for
      inf / nan (two bool tensors of the largest parameter's size).
    - the optimizer step: zero 0 with every gradient, zero 1 with the owned ones (then its
      all-gather windows), zero 3 at rest (shards); `temporaries` x the largest parameter (its
      1/dp shard under zero 3)."""
    held: Terms = (("weights", state.weights), ("gradients", state.grads), ("optimizer state", state.optimizer))
    check = int(2 * largest)  # isfinite and its negation, a byte per value
    step_temps = int(temporaries * largest * value)
    if dp <= 1 or zero == 0:
        sync = (("gradient buckets", state.grads if dp > 1 else 0), ("inf / nan check", check))
        return StatePhases(held + sync, held + (("optimizer temporaries", step_temps),))
    grads = int(state.grads / dp)  # the owned gradients
    if zero == 1:
        window = int(min(BUCKET_BYTES, state.weights / dp))
        sync = held + (("owned gradients", grads), ("reduce-scatter windows", (dp + 1) * window))
        step = (("weights", state.weights), ("gradients", grads), ("optimizer state", state.optimizer),
                ("optimizer temporaries", max(step_temps, (dp + 1) * window)))
        return StatePhases(sync, step)  # (its inf / nan check comes after, on the owned gradients only)
    return StatePhases(held + (("inf / nan check", check),),
                       (("model state shards", state.at_rest), ("optimizer temporaries", int(step_temps / dp))))


def dp_traffic_bytes(params: float, dp: int, zero: int, reshard: Resharded | None = None, value: int = BYTES) -> int:
    """Bytes a rank sends to its data-parallel peers per step (see the module doc); `reshard`:
    zero 3 with reshard_after_forward (ignored otherwise); `value`: bytes per value."""
    assert zero in ZERO_STAGES, zero
    if dp <= 1:
        return 0
    if zero == 3 and reshard is not None:
        # the gradients' reduce-scatter, the roots' all-gather, the blocks' all-gathers
        return int((params + reshard.roots + reshard.gathered_per_step) * value * (dp - 1) // dp)
    return int(2 * params * value * (dp - 1) // dp)


def dp_collectives(zero: int, reshard: bool = False) -> str:
    """What the data-parallel traffic of a step is made of, in words."""
    if zero == 3 and reshard:
        return "block weight all-gathers per microbatch + root weight all-gather + gradient reduce-scatter"
    return {0: "gradient all-reduce", 1: "gradient reduce-scatter + weight all-gather",
            3: "weight all-gather + gradient reduce-scatter"}[zero]


def cp_traffic_bytes(attention_layers: int, microbatches: int, tokens: int, kv_width: int, cp: int,
                     recompute: bool = False, value: int = BYTES) -> int:
    """Bytes a rank sends to its cp group per step (runtime/parallel/context.py): per attention
    layer and microbatch the keys and values of the whole sequence (`tokens` of `kv_width`
    features each, this tp rank's heads) are all-gathered, (cp - 1) / cp of them sent by each rank
    (a ring), and their gradients all-reduced in backward (twice that); activation checkpointing
    gathers again in the recomputed forward."""
    if cp <= 1 or attention_layers == 0:
        return 0
    gathered = 2 * tokens * kv_width * value * (cp - 1) / cp
    return int(attention_layers * microbatches * ((2 if recompute else 1) * gathered + 2 * gathered))


def ep_traffic_bytes(moe_layers: int, microbatches: int, tokens: int, top_k: int, hidden: int, ep: int,
                     recompute: bool = False, value: int = BYTES) -> int:
    """Bytes a rank sends to its ep group per step (runtime/parallel/expert.py), routing taken as
    uniform: of each microbatch's `tokens` x `top_k` (token, expert) pairs, (ep - 1) / ep go to
    another rank, per MoE layer: the hidden state there and the output back (forward), their
    gradients the same way (backward), the expert ids (int64) there; activation checkpointing
    runs the forward's exchanges twice."""
    if ep <= 1 or moe_layers == 0:
        return 0
    pairs = tokens * top_k * (ep - 1) / ep
    forward = pairs * (2 * hidden * value + 8)
    backward = pairs * 2 * hidden * value
    return int(moe_layers * microbatches * ((2 if recompute else 1) * forward + backward))
