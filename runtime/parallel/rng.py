"""Dropout randomness under tensor parallelism (Megatron's model-parallel RNG, without globals).

Every rank has two streams:

* The **replicated stream**: torch's default generators (the CPU one and the rank's CUDA
  device's), seeded by `seed_replicated_stream` from (train seed, dp rank, pp rank). The ranks of
  one tensor-parallel group share dp and pp coordinates, so they draw the same numbers in the
  same order; different data-parallel replicas and pipeline ranks draw different ones. Every
  dropout outside a tensor-parallel region uses it: the embeddings' dropout, the residual
  stream's, the one after a row-parallel layer's all-reduce. Those activations are replicated
  over tp, so every tp rank applies the same mask to them and the replicated parameters (norms,
  embeddings, row-parallel biases) stay bitwise equal.

* A **tensor-parallel region** (`TensorParallelRng.region`): the part of an attention module
  that works on this rank's own heads, from the module's entry to its row-parallel output
  projection (or to its end when the projection lives elsewhere, as BERT's). On entry the
  default generators are re-seeded with a seed derived from one draw of the replicated stream
  and the tp rank; on exit their replicated state is put back. So each tp rank draws the
  attention-probability masks of its own heads independently (as Megatron's
  ``get_cuda_rng_tracker().fork()`` does), different in every call.

The region keeps no state of its own: its seed is a function of the replicated stream's state.
Non-reentrant activation checkpointing restores that state before recomputing a block, so the
recomputed masks equal the original ones; a training checkpoint saves it (``rng/torch``,
``rng/cuda``), so a resumed run continues the uninterrupted one.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterable, Iterator, Sequence

import torch
from torch import nn

__all__ = [
    "TensorParallelRng",
    "install_sequence_parallel_regions",
    "install_tensor_parallel_regions",
    "is_tensor_parallel_region",
    "mix_seed",
    "replicated_seed",
    "seed_replicated_stream",
]

_MASK63 = (1 << 63) - 1
_TP_REGION_TAG = 0x7470  # "tp": keeps region seeds apart from replicated_seed's values


def mix_seed(*values: int) -> int:
    """A 63-bit seed from integers (splitmix64 steps; the same in every process)."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (v & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
        h = h * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 29
    return h & _MASK63


def replicated_seed(seed: int, dp_rank: int, pp_rank: int) -> int:
    """The seed of the replicated stream of the ranks at (dp_rank, pp_rank): the same for every
    tp rank, different for every data-parallel replica and pipeline rank. (A pipeline rank's
    model chunks draw from its one stream in turn, so they get different masks too.)"""
    return mix_seed(seed, dp_rank, pp_rank)


def seed_replicated_stream(seed: int, dp_rank: int, pp_rank: int) -> int:
    """Seed torch's default generators (CPU and every CUDA device) and Python's `random` with
    `replicated_seed`; returns the seed."""
    s = replicated_seed(seed, dp_rank, pp_rank)
    torch.manual_seed(s)
    random.seed(s)
    return s


class TensorParallelRng:
    """Enters and leaves tensor-parallel regions for one rank (`tp_rank`) on `device`.

    Regions do not nest: an `enter` inside a region only counts, and `leave` (the row-parallel
    layer's input: the end of the local part) ends the region early, before the module's exit.
    """

    def __init__(self, tp_rank: int, device: torch.device | str = "cpu") -> None:
        self.tp_rank = tp_rank
        device = torch.device(device)
        self._cuda = device.type == "cuda"
        self._cuda_index: int | None = None
        if self._cuda:
            self._cuda_index = device.index if device.index is not None else torch.cuda.current_device()
        self._depth = 0
        self._saved: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self.entered = 0  # regions entered so far (for tests and diagnostics)

    @property
    def inside(self) -> bool:
        """Whether the default generators hold this rank's region stream now."""
        return self._saved is not None

    def enter(self) -> None:
        self._depth += 1
        if self._depth > 1:
            return
        # one draw advances the replicated stream (so consecutive regions get different seeds)
        draw = int(torch.randint(0, 1 << 62, (), dtype=torch.int64))
        cuda_state = torch.cuda.get_rng_state(self._cuda_index) if self._cuda else None
        self._saved = (torch.get_rng_state(), cuda_state)
        s = mix_seed(draw, _TP_REGION_TAG, self.tp_rank)
        torch.default_generator.manual_seed(s)
        if self._cuda:
            torch.cuda.default_generators[self._cuda_index].manual_seed(s)
        self.entered += 1

    def leave(self) -> None:
        """End the region (if inside one): the replicated state comes back."""
        if self._saved is None:
            return
        cpu_state, cuda_state = self._saved
        self._saved = None
        torch.set_rng_state(cpu_state)
        if cuda_state is not None:
            torch.cuda.set_rng_state(cuda_state, self._cuda_index)

    def exit(self) -> None:
        self._depth = max(0, self._depth - 1)
        if self._depth == 0:
            self.leave()

    @contextlib.contextmanager
    def region(self) -> Iterator[TensorParallelRng]:
        """One region as a context (`enter` ... `exit`)."""
        self.enter()
        try:
            yield self
        finally:
            self.exit()


def is_tensor_parallel_region(module: nn.Module) -> bool:
    """Whether `module`'s forward works on tp-local heads / features: it has a column-parallel
    linear child that keeps its output split, and either a row-parallel linear child (GPT-2's
    and Llama's attention, the generic decoder's, any MLP) or is a localised attention class
    whose output projection lives elsewhere (BERT's self-attention)."""
    from ppdsl.runtime.parallel.tp import SUPPORTED_ATTENTION, ColumnParallelLinear, RowParallelLinear

    children = list(module.children())
    if not any(isinstance(c, ColumnParallelLinear) and not c.gather_output for c in children):
        return False
    return any(isinstance(c, RowParallelLinear) for c in children) or type(module).__name__ in SUPPORTED_ATTENTION


def install_tensor_parallel_regions(
    modules: Iterable[nn.Module], tp_rank: int, device: torch.device | str = "cpu"
) -> TensorParallelRng:
    """Make the forward of every tensor-parallel region under `modules` (see
    `is_tensor_parallel_region`) run on this tp rank's own stream, up to the input of its
    row-parallel layer(s): forward hooks, so activation checkpointing and the split backward's
    recomputation see the same regions. Returns the rank's `TensorParallelRng`."""
    from ppdsl.runtime.parallel.tp import RowParallelLinear

    rng = TensorParallelRng(tp_rank, device)
    seen: set[int] = set()
    for root in modules:
        for module in root.modules():
            if id(module) in seen or not is_tensor_parallel_region(module):
                continue
            seen.add(id(module))
            module.register_forward_pre_hook(lambda _m, _args: rng.enter())
            module.register_forward_hook(lambda _m, _args, _out: rng.exit(), always_call=True)
            for child in module.children():
                if isinstance(child, RowParallelLinear):
                    child.register_forward_pre_hook(lambda _m, _args: rng.leave())
    return rng


def install_sequence_parallel_regions(
    stages: Sequence[nn.Module], tp_rank: int, device: torch.device
) -> TensorParallelRng:
    """Sequence parallelism: each block works on this tp rank's own tokens, so its dropout (on
    the residual stream, after the attention / MLP output) draws from a per-tp-rank stream: the
    whole block's forward is a region of a second `TensorParallelRng` (forward hooks, so
    activation checkpointing recomputes the same masks). The attention / MLP regions inside
    nest in it (they enter from the rank's stream and give it back at their row layer). The
    replicated stream advances by one draw per block on every tp rank alike, so the dropout
    outside blocks (embeddings, head) stays shared over tp."""
    rng = TensorParallelRng(tp_rank, device)
    for stage in stages:
        for block in stage.blocks():  # type: ignore[operator]
            block.register_forward_pre_hook(lambda _m, _args: rng.enter())
            block.register_forward_hook(lambda _m, _args, _out: rng.exit(), always_call=True)
    return rng
