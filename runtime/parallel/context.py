"""Context parallelism: each sequence split over the cp ranks, attention over the whole of it.

The layout (docs/language.md, "Context parallelism"): a sequence of S tokens is cut into 2 * cp
chunks of S / (2 * cp); cp rank i holds chunk i and chunk 2 * cp - 1 - i (head-tail: under a
causal mask the early chunks attend to little and the late ones to much, so every rank gets
one of each and the same work). Everything but attention is per token and runs on the rank's
own tokens unchanged; the tokens keep their global positions (rotary tables, absolute
position embeddings) and their next-token targets are taken over the whole sequence before the
split.

Attention: each attention module the plan names (``Plan.context_attention``, found by check's
meta probe of the forward) calls, through transformers' attention interface, an attention that
all-gathers the keys and values of the cp group (autograd: the backward sums the gradients of
every rank's queries) and masks by the global positions: query q sees key k when
position(k) <= position(q). All-gather rather than a ring: at the sequence lengths a CPU /
single-node run meets it is one collective per layer instead of cp - 1 exchanges, on gloo as on
NCCL, and the attention is HF's own SDPA call on the gathered keys, not a second kernel with its
own online-softmax numerics. (torch.distributed.tensor.experimental.context_parallel was
considered: it patches SDPA for DTensor sequence sharding and needs its own buffers' ordering of
the inputs; its round-robin rotation and load balancer are private and change between releases.)

The loss: each rank's cross-entropy summed over its tokens, times cp / (the microbatch's
targets), so that the average over the cp ranks (gradient averaging over dp * cp,
``runtime.train.trainer``) is the whole microbatch's mean, as one process computes it.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch import nn

ATTENTION = "ppdsl_context_parallel"  # the name registered in transformers' AttentionInterface


def local_positions(seq_len: int, cp: int, cp_rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The global positions of cp rank `cp_rank`'s tokens: chunks cp_rank and 2 * cp - 1 - cp_rank."""
    assert seq_len % (2 * cp) == 0, (seq_len, cp)  # check: E0245
    c = seq_len // (2 * cp)
    head, tail = cp_rank * c, (2 * cp - 1 - cp_rank) * c
    return torch.cat([torch.arange(head, head + c, device=device), torch.arange(tail, tail + c, device=device)])


@attrs.frozen
class SequenceShard:
    """What a microbatch carries under context parallelism (`shard_microbatch`)."""

    position_ids: torch.Tensor  # (1, S / cp): the global positions of this rank's tokens
    targets: torch.Tensor  # (B, S / cp): their next-token labels, shifted over the whole sequence
    scale: float  # cp / (the microbatch's targets): this rank's loss is its targets' sum times this

    def to(self, device: torch.device | str) -> SequenceShard:
        return SequenceShard(self.position_ids.to(device), self.targets.to(device), self.scale)


def shard_microbatch(mb: Any, cp: int, cp_rank: int) -> Any:
    """The part of microbatch `mb` (a runtime.stage.build.MicroBatch, whole sequences) cp rank `cp_rank` runs."""
    from ppdsl.core.task_loss import IGNORE_INDEX, shifted_labels

    seq = mb.input_ids.shape[1]
    idx = local_positions(seq, cp, cp_rank, mb.input_ids.device)
    full = shifted_labels(mb.labels)
    targets = full[:, idx]
    # the microbatch's mean, or per token over the global batch (its token_divisor: chat data)
    divisor = getattr(mb, "token_divisor", None)
    total = int((full != IGNORE_INDEX).sum()) if divisor is None else divisor
    shard = SequenceShard(idx.unsqueeze(0), targets, cp / total if total else 0.0)
    return attrs.evolve(mb, input_ids=mb.input_ids[:, idx], labels=mb.labels[:, idx], sequence_shard=shard)


class ShardedData:
    """A data source whose microbatches are this cp rank's part of each sequence."""

    def __init__(self, source: Any, cp: int, cp_rank: int) -> None:
        self.source, self.cp, self.cp_rank = source, cp, cp_rank

    def __getattr__(self, name: str) -> Any:
        return getattr(self.source, name)

    def microbatches(self, *args: Any, **kwargs: Any) -> list[Any]:
        return [shard_microbatch(mb, self.cp, self.cp_rank) for mb in self.source.microbatches(*args, **kwargs)]


def sharded_loss(per_token: torch.Tensor, shard: SequenceShard) -> torch.Tensor:
    """This rank's share of the microbatch's mean loss, cp * (its targets' sum) / (the microbatch's
    targets), from its per-token losses (0 where ignored). Summed and scaled in float64: the cp
    shares add up to the mean one process computes to within one fp32 rounding."""
    return per_token.double().sum() * shard.scale


# ---------------------------------------------------------------------------------------------
# attention
# ---------------------------------------------------------------------------------------------


@attrs.frozen
class ContextGroup:
    """Set on every context-parallel attention module: its cp group and the static mask."""

    group: Any  # ProcessGroup
    size: int
    rank: int
    seq_len: int  # the whole sequence
    # the attention the model was built with: "eager" runs the model's own eager attention (what
    # the single-process model runs) on the gathered keys, anything else transformers' SDPA
    implementation: str = "eager"

    def mask(self, device: torch.device) -> torch.Tensor:
        """(1, 1, S / cp, S) bool: this rank's queries (rows) against the whole sequence's keys in
        sequence order (`in_order`), True where the query attends."""
        q = local_positions(self.seq_len, self.size, self.rank, device)
        k = torch.arange(self.seq_len, device=device)
        return (k.unsqueeze(0) <= q.unsqueeze(1))[None, None]

    def in_order(self, device: torch.device) -> torch.Tensor:
        """Where each position's key sits in the all-gather (cp rank 0's tokens, then 1's, ...):
        gathered.index_select(dim, in_order) is the sequence in order, so each query row attends
        to the same keys in the same order as in one process."""
        k = torch.cat([local_positions(self.seq_len, self.size, r, device) for r in range(self.size)])
        return torch.argsort(k)


class _GatherSequence(torch.autograd.Function):
    """All-gather along `dim` over the cp group; backward: the sum of every rank's gradient of
    the gathered tensor, this rank's part of it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cp: ContextGroup, dim: int) -> torch.Tensor:  # type: ignore[override]
        ctx.cp, ctx.dim = cp, dim
        parts = [torch.empty_like(x) for _ in range(cp.size)]
        dist.all_gather(parts, x.contiguous(), group=cp.group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        cp: ContextGroup = ctx.cp
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=cp.group)
        return total.chunk(cp.size, dim=ctx.dim)[cp.rank].contiguous(), None, None


def context_parallel_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               attention_mask: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """transformers' attention interface: (B, H, S / cp, D) queries against the whole sequence."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cp: ContextGroup = module.__dict__["ppdsl_context"]
    order = cp.in_order(query.device)
    key = _GatherSequence.apply(key, cp, 2).index_select(2, order)
    value = _GatherSequence.apply(value, cp, 2).index_select(2, order)
    kwargs.pop("is_causal", None)
    allowed = cp.mask(query.device)
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if cp.implementation == "eager" and eager is not None:  # an additive mask, as the model's own builds it
        additive = torch.zeros(allowed.shape, dtype=query.dtype, device=query.device)
        additive.masked_fill_(~allowed, torch.finfo(query.dtype).min)
        return eager(module, query, key, value, additive, **kwargs)
    return sdpa_attention_forward(module, query, key, value, allowed, is_causal=False, **kwargs)


def apply_cp(stages: Sequence[nn.Module], attention_paths: Sequence[str], group: Any, cp: int, cp_rank: int,
             seq_len: int) -> int:
    """Route the named attention modules this rank holds through `context_parallel_attention`;
    returns how many. Their config (shared by the model's modules) names the attention."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, context_parallel_attention)
    wanted, done = set(attention_paths), 0
    for stage in stages:
        for name, module in stage.named_modules():
            if name in wanted:
                built = module.config._attn_implementation
                module.__dict__["ppdsl_context"] = ContextGroup(
                    group, cp, cp_rank, seq_len, "sdpa" if built not in ("eager", ATTENTION) else "eager")
                module.config._attn_implementation = ATTENTION
                done += 1
        config = getattr(stage, "config", None)
        if config is not None:  # the masks the forward builds: none for this attention
            config._attn_implementation = ATTENTION
    return done
