"""ZeRO-3 (``train { zero = 3 }``) through FSDP2: parameters, gradients and optimizer state
sharded over the data-parallel group, around each pipeline stage's blocks.

``apply_fsdp`` wraps, on the 1-D dp sub-mesh, every block of every stage module (chunk) this
pipeline rank holds, then each chunk as a root (its embeddings, head and norms). Each parameter
becomes a DTensor with placement Shard(0) of its tensor-parallel-local tensor (ppdsl's TP layers
hold plain tensors, so FSDP2 shards their local shards over dp); a plain torch optimizer over
those DTensors keeps its state sharded alike.

During a step the parameters stay unsharded from their first forward until the gradients are
reduced (``reshard_after_forward=False``, no gradient sync per microbatch): every microbatch's
forward and backward (and a split backward's later W) run on the same unsharded tensors and
accumulate into their ``.grad``; ``reduce_gradients`` then reduce-scatters each chunk's
gradients once per step (averaged over dp) onto the sharded parameters and frees the unsharded
ones. That is what torchtitan does for pipeline parallelism with FSDP (torch.distributed.pipelining's
``backward_maybe_with_nosync`` / ``perform_reduce_grad``).

So at rest a rank holds 1/dp of its stages' parameters, gradients and optimizer state, while
during a step it also holds its stages' unsharded parameters and gradients (at pp > 1 its share
of the model; benchmarks/bench_fsdp_memory.py measures both).

With ``train { reshard_after_forward = true }`` the blocks are wrapped with
``reshard_after_forward=True`` and resharded after every backward as well
(``set_reshard_after_backward(True)`` during the microbatches): a block's whole weights live only
while its forward or backward runs (FSDP2 all-gathers them again before each, and prefetches
the next block's in backward), every microbatch. The gradients still accumulate unsharded and
are reduce-scattered once per step by ``reduce_gradients``. The chunk roots (embeddings, head,
final norm) keep their weights whole for the step, as FSDP2 does for its root by default: they
are used at both ends of every microbatch's pass through the chunk (the head's forward is
followed at once by its backward on the last stage, a tied embedding at both ends), so
resharding them would all-gather them again at once. A split backward's W runs after B resharded the
block: it accumulates into the unsharded parameters the graph used (the executor takes them from
the autograd graph, ``runtime.pipeline.executor.graph_parameters``, not from the module, which holds the
sharded ones again). A linear's weight gradient needs only saved activations, but a fused norm's
backward kernel (layer_norm, rms_norm) reads its weight even for the weight's gradient, so W
all-gathers each block's weights again while it computes that block's gradients
(``WeightAccess``): under a zero-bubble style a block is gathered three times per microbatch
(F, B, W), twice under the others.

A parameter shared by two chunks of one rank (GPT-2's wte / lm_head under a V schedule) cannot
belong to two FSDP roots: ``untie_across_stages`` gives the later chunk its own copy. The
trainer sums the copy's gradient into the original's, as it does for tied copies on different
pipeline ranks, steps the original only (the copy is not among its named parameters) and
copies the original's values into the copy before each forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor


@dataclass(frozen=True)
class StageCopy:
    """A parameter that stage `stage` (index in the rank's list) holds as its own copy of the
    parameter an earlier stage of the rank holds as `original`."""

    stage: int
    name: str
    original: str


def untie_across_stages(stages: Sequence[nn.Module]) -> list[StageCopy]:
    """Give each stage its own Parameter (a clone: same values) where an earlier stage of the
    rank already holds it."""
    first_name: dict[int, str] = {}
    copies = []
    for i, stage in enumerate(stages):
        here: dict[int, str] = {}
        for owner_name, owner in stage.named_modules():
            for local_name, p in list(owner.named_parameters(recurse=False)):
                name = f"{owner_name}.{local_name}" if owner_name else local_name
                if id(p) in first_name:
                    setattr(owner, local_name, nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad))
                    copies.append(StageCopy(i, name, first_name[id(p)]))
                else:
                    here.setdefault(id(p), name)
        first_name.update(here)
    return copies


def apply_fsdp(stages: Sequence[nn.Module], dp_mesh: DeviceMesh,
               reshard_after_forward: bool = False) -> list[FSDPModule]:
    """Shard every block, then every stage module, over `dp_mesh`; returns the roots (the
    stage modules, now FSDP modules). `reshard_after_forward`: the blocks free their whole
    weights after each forward (the roots never do, see the module doc). Parameters shared
    between stages must be untied first. A 0-dim parameter cannot be sharded: check refuses it
    (E0409)."""
    for stage in stages:
        for name, p in stage.named_parameters():
            assert p.ndim > 0, f"{name} is a scalar parameter: check's E0409 should have refused zero = 3"
    for stage in stages:
        for block in stage.blocks():  # type: ignore[operator]
            fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    roots = []
    for stage in stages:
        fully_shard(stage, mesh=dp_mesh, reshard_after_forward=False)
        roots.append(stage)
    return roots  # type: ignore[return-value]


def accumulate_without_sync(roots: Sequence[FSDPModule], reshard_blocks: bool = False) -> None:
    """Before a step's microbatches: gradients accumulate unsharded; parameters stay unsharded,
    or with `reshard_blocks` the blocks' are freed after every backward (the roots' stay)."""
    for root in roots:
        root.set_is_last_backward(False)
        root.set_reshard_after_backward(reshard_blocks)  # recurses into the blocks
        root.set_reshard_after_backward(False, recurse=False)
        root.set_requires_gradient_sync(False)


def reduce_gradients(roots: Sequence[FSDPModule]) -> None:
    """After a step's microbatches: reduce-scatter every chunk's accumulated gradients (mean
    over dp) onto its sharded parameters and reshard.

    This drives FSDP2 by hand through private attributes, exactly as
    torch.distributed.pipelining does (``_PipelineStageBase.perform_reduce_grad``): the
    executor's backward calls are many per step, and a split backward's W is an
    ``autograd.grad`` that FSDP's hooks do not see as a backward; tests/test_fsdp.py fails
    loudly if a future torch renames what is used here."""
    for root in roots:
        root.set_is_last_backward(True)
        root.set_reshard_after_backward(True)
        root.set_requires_gradient_sync(True)
        state = fully_shard.state(root)  # type: ignore[attr-defined]
        for s in state._state_ctx.all_states:
            for group in s._fsdp_param_groups:
                group.post_backward()
        state._root_post_backward_final_callback()


class WeightAccess:
    """Around a split backward's W under zero = 3 with resharding: ``access()`` yields
    `need(params)`, which all-gathers the FSDP modules owning those unsharded parameters (the
    ones a forward used) where they are sharded now, and reshards the ones it gathered that the
    current parameters do not need; leaving ``access()`` reshards the rest. A module gathered by
    someone else (a root; a block FSDP2 prefetched for a later backward, whose all-gather may still
    be in flight: then W waits for it) is left whole. Collective over dp: every dp
    rank runs the same W groups in the same order."""

    def __init__(self, roots: Sequence[FSDPModule]) -> None:
        self.roots = list(roots)
        self._owner: dict[int, FSDPModule] = {}

    def _owner_of(self, p: torch.Tensor) -> FSDPModule | None:
        if id(p) not in self._owner:  # the unsharded parameters exist from the first all-gather on
            for root in self.roots:
                for m in root.modules():  # type: ignore[attr-defined]
                    if isinstance(m, FSDPModule):
                        for group in fully_shard.state(m)._fsdp_param_groups:  # type: ignore[attr-defined]
                            for fp in group.fsdp_params:
                                up = getattr(fp, "_unsharded_param", None)
                                if up is not None:
                                    self._owner[id(up)] = m
        return self._owner.get(id(p))

    @contextlib.contextmanager
    def access(self) -> Iterator[Callable[[Sequence[torch.Tensor]], None]]:
        held: dict[int, FSDPModule] = {}

        def need(params: Sequence[torch.Tensor]) -> None:
            owners = {id(m): m for p in params if (m := self._owner_of(p)) is not None}
            for key in [k for k in held if k not in owners]:
                held.pop(key).reshard()
            for key, m in owners.items():
                if key in held:
                    continue
                state = _gather_state(m)
                if state != "whole":
                    m.unshard()  # all-gathers, or waits for the all-gather FSDP2 prefetched
                if state == "sharded":
                    held[key] = m  # a prefetched one stays whole for the backward it was gathered for

        try:
            yield need
        finally:
            for m in held.values():
                m.reshard()


def _gather_state(m: FSDPModule) -> str:
    """"whole" (unsharded), "prefetched" (an all-gather in flight: FSDP2's backward prefetch) or
    "sharded"."""
    groups = fully_shard.state(m)._fsdp_param_groups  # type: ignore[attr-defined]
    if all(g.is_unsharded for g in groups):
        return "whole"
    if any(g._all_gather_result is not None for g in groups):
        return "prefetched"
    return "sharded"


def reshard(roots: Sequence[FSDPModule]) -> None:
    """Free the unsharded parameters (after a forward-only pass, which keeps them)."""
    for root in roots:
        for m in root.modules():  # type: ignore[attr-defined]
            if isinstance(m, FSDPModule):
                m.reshard()


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of `t` (its dp shard for a DTensor), sharing storage: what elementwise
    in-place updates (clipping, unscaling) and sums over other groups work on."""
    return t.to_local() if isinstance(t, DTensor) else t


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor-parallel-local tensor: gathered over dp for a DTensor. Collective."""
    return t.full_tensor() if isinstance(t, DTensor) else t

