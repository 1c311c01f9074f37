"""The activations a training forward keeps for backward, measured on the meta device.

`trace_saved` runs the model's forward on meta tensors (nothing allocated) with gradients on,
in training mode, under ``torch.autograd.graph.saved_tensors_hooks``, and then the task loss on
its logits (`ppdsl.core.task_loss`). Every tensor autograd saves is counted once, by its storage
(a tensor saved by three projections, or a view of one already saved, adds nothing); parameters
and buffers are not activations and are left out. Each saved tensor is filed under

- the deepest module running when it was saved ("" for the model's own code outside any
  submodule, `LOSS` for the loss), and
- its producer: of the linear / Conv1D / embedding layers whose outputs reach it without passing
  through another such layer (a taint, as in `ppdsl.dsl.tp_dataflow`), the one that ran last,
  so that lowering can tell which saved tensors tensor parallelism splits: those a column-split
  layer produces. One producer stands for all of them because a plan check accepts never mixes
  split and whole inputs in one op (a residual stream's producers are all row-split or whole),
  and it keeps the record linear in the blocks (a residual stream reaches every earlier layer).

It runs at batch 1 and two sequence lengths (`lengths`): what a forward saves grows as
a * s + c * s^2 in the sequence length s (eager attention's scores are s^2), and linearly in
the batch, so `SavedActivations.bytes_at` gives it at any microbatch and sequence length,
torch-free (lowering/rank_memory.py). Sizes are those of the model's own dtype (fp32 as built).

torch is imported inside the functions only, like the rest of ``ppdsl.dsl``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    from torch import nn

__all__ = ["LOSS", "SavedActivations", "SavedGroup", "trace_saved", "trace_lengths"]

LOSS = "<loss>"  # the module key of what the task loss on the logits saves
LONGEST = 128  # the longer traced sequence (the shorter is half of it), within the model's positions


@attrs.frozen
class SavedGroup:
    """Bytes saved for backward by one module's own code, from one set of producer layers, at the
    two traced sequence lengths (batch 1)."""

    module: str  # the deepest module running ("" outside every submodule, LOSS for the loss)
    producer: str  # the layer that produced it last ("" for none: the token ids, a mask)
    short: int  # bytes at SavedActivations.lengths[0]
    long: int  # bytes at SavedActivations.lengths[1]


@attrs.frozen
class SavedActivations:
    """What one training forward (and its loss) saves for backward, by module and producers."""

    lengths: tuple[int, int]  # the two traced sequence lengths (batch 1)
    groups: tuple[SavedGroup, ...]

    def bytes_at(self, groups: Iterable[SavedGroup], batch: int, seq: int) -> float:
        """Bytes the `groups` save at this batch and sequence length: per group the a * s + c * s^2
        through its two traced points, times the batch."""
        s1, s2 = self.lengths
        total = 0.0
        for g in groups:
            c = (g.long / s2 - g.short / s1) / (s2 - s1)
            a = g.short / s1 - c * s1
            total += max(0.0, a * seq + c * seq * seq)
        return batch * total


def trace_lengths(config: Mapping[str, object]) -> tuple[int, int]:
    """The two sequence lengths traced: `LONGEST` and half of it, below the model's positions."""
    limits = [v for k in ("n_positions", "max_position_embeddings", "max_seq_len")
              if isinstance(v := config.get(k), int) and v > 0]
    longest = max(2, min([LONGEST, *limits]))
    return longest // 2, longest


def trace_saved(model: nn.Module, config: Mapping[str, object], layer_paths: list[str]) -> SavedActivations:
    """Trace ``model`` (built on meta) at both `trace_lengths`. Raises whatever the forward
    raises; the caller then keeps no figure (lowering falls back to its formula)."""
    lengths = trace_lengths(config)
    short, long = (_trace_once(model, layer_paths, s) for s in lengths)
    keys = sorted(set(short) | set(long))
    return SavedActivations(lengths, tuple(SavedGroup(m, p, short.get((m, p), 0), long.get((m, p), 0))
                                           for m, p in keys))


def _trace_once(model: nn.Module, layer_paths: list[str], seq: int) -> dict[tuple[str, str], int]:
    import torch
    from torch.overrides import TorchFunctionMode
    from torch.utils._pytree import tree_flatten

    from ppdsl.core.task_loss import causal_lm_loss

    from .meta_values import meta_autocast, meta_values
    from .tp_dataflow import _call

    def storage_key(t: Any) -> int:
        return t.untyped_storage()._cdata

    static = {storage_key(t) for t in (*model.parameters(), *model.buffers())}
    layers = set(layer_paths)
    stack: list[str] = [""]
    none = (-1, "")
    tags: dict[int, tuple[int, str]] = {}  # id of a tensor -> (when, layer) of its last producer
    alive: list[Any] = []  # keeps every seen tensor alive: no id or storage is reused
    seen: set[int] = set()
    found: dict[tuple[str, str], int] = {}
    calling = [none]  # the producer of the inputs of the torch call running

    def tag_of(tree: Any) -> tuple[int, str]:
        return max((tags.get(id(x), none) for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)),
                   default=none)

    def put(tree: Any, value: tuple[int, str]) -> None:
        for leaf in tree_flatten(tree)[0]:
            if isinstance(leaf, torch.Tensor):
                alive.append(leaf)
                tags[id(leaf)] = value

    class Taint(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
            incoming = tag_of((args, kwargs))
            calling.append(incoming)
            try:
                result = func(*args, **(kwargs or {}))
            finally:
                calling.pop()
            if incoming != none:
                put(result, incoming)
            return result

    def pack(t: Any) -> Any:
        key = storage_key(t)
        if key not in static and key not in seen:
            seen.add(key)
            alive.append(t)
            base = t._base if t._base is not None else t
            # an op's own output (softmax, exp) is saved before the call returns and is tagged
            tag = max(tags.get(id(t), none), tags.get(id(base), none)) if id(t) in tags or id(base) in tags \
                else calling[-1]
            group = (stack[-1], tag[1])
            found[group] = found.get(group, 0) + t.untyped_storage().nbytes()
        return t

    def pre(path: str) -> Any:
        def hook(module: Any, args: Any) -> None:
            stack.append(path)
        return hook

    def post(path: str) -> Any:
        def hook(module: Any, args: Any, output: Any) -> None:
            stack.pop()
            if path in layers:
                put(output, (len(alive), path))
        return hook

    handles = []
    for path, module in model.named_modules():
        if path:
            handles.append(module.register_forward_pre_hook(pre(path)))
            handles.append(module.register_forward_hook(post(path), always_call=True))
    was_training = model.training
    model.train()
    try:
        ids = torch.zeros((1, seq), dtype=torch.long, device="meta")
        with torch.enable_grad(), meta_autocast(), meta_values(), Taint(), \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = _call(model, ids)
            logits = getattr(out, "logits", out)
            if isinstance(logits, torch.Tensor) and logits.dim() == 3 and logits.is_floating_point():
                stack.append(LOSS)
                causal_lm_loss(logits, ids)  # a classifier's pooled logits save next to nothing
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return found
