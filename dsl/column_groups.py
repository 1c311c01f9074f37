"""The groups a forward views a column-split layer's output in, globally and at one rank's shapes
(E0224).

A column split gives rank r the r-th contiguous 1/tp of a layer's output features. A forward that
views those features as groups, ``reshape(..., G, -1)``, meant group g to be features
[g W/G, (g+1) W/G); rank r's slice is then groups [r G/tp, (r+1) G/tp), whole, and its forward
must view its W/tp features as G/tp groups of the same width. The local-shape proof
(dsl/own_tp_proof.py) shows only that the shapes fit: a forward that holds G as a constant
(CodeGen's ``mp_num = 4``) views the local features as G groups of half the width, runs, and mixes
the columns of two groups into one (training silently differs, gradients off by 150%). So the
view of each split output is recorded in the whole forward and in the local one, and compared:
the split is right when the local view is the global one with its outer factor (after the parts
of a ``fused = k`` split) divided by tp.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

__all__ = ["Grouping", "misaligned", "recording_groups"]

Grouping = tuple[int, ...]  # the factors the output's last dim is viewed as, outermost first
_VIEWS = frozenset({"view", "reshape", "unflatten"})


@contextlib.contextmanager
def recording_groups(model: nn.Module, layers: Sequence[str]) -> Iterator[dict[str, list[Grouping]]]:
    """While open, each view of a ``layers`` output (the tensor the layer returns) that splits its
    last dim into two or more factors is recorded, in order: layer -> [factors, ...]."""
    import torch
    from torch.overrides import TorchFunctionMode

    found: dict[str, list[Grouping]] = {path: [] for path in layers}
    outputs: dict[int, tuple[str, Any]] = {}  # id of a layer's output -> (layer, the tensor, kept alive)

    def keep(path: str) -> Any:
        def hook(_module: Any, _inputs: Any, output: Any) -> None:
            if isinstance(output, torch.Tensor) and output.dim() > 0:
                outputs[id(output)] = (path, output)
        return hook

    class Views(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
            result = func(*args, **(kwargs or {}))
            if getattr(func, "__name__", "") in _VIEWS and args and id(args[0]) in outputs \
                    and isinstance(result, torch.Tensor):
                path, x = outputs[id(args[0])]
                grouping = _trailing_factors(tuple(int(n) for n in result.shape), int(x.shape[-1]))
                if grouping is not None:
                    found[path].append(grouping)
            return result

    handles = [model.get_submodule(path).register_forward_hook(keep(path)) for path in layers]
    try:
        with Views():
            yield found
    finally:
        for h in handles:
            h.remove()


def _trailing_factors(shape: Grouping, width: int) -> Grouping | None:
    """The trailing dims of ``shape`` whose product is ``width``, when there are two or more."""
    for j in range(len(shape) - 1):
        if math.prod(shape[j:]) == width:
            factors = shape[j:]
            while len(factors) > 1 and factors[0] == 1:  # an unsqueeze in front is no grouping
                factors = factors[1:]
            return factors if len(factors) > 1 else None
    return None


def misaligned(whole: Mapping[str, Sequence[Grouping]], local: Mapping[str, Sequence[Grouping]],
               fused: Mapping[str, int], tp: int) -> tuple[str, Grouping, Grouping] | None:
    """(layer, its global grouping, the local one) for the first column-split layer whose local
    forward views its features in groups other than its 1/tp of the global ones; None when all line
    up. ``fused``: layer -> k of its ``fused = k`` split (1 for a plain column)."""
    for path, k in fused.items():
        for g, l in zip(whole.get(path, ()), local.get(path, ())):
            outer = 1 if k > 1 and len(g) >= 2 and g[0] == k else 0  # the parts of a fused split stay whole
            expect = g[:outer] + (g[outer] // tp,) + g[outer + 1:] if g[outer] % tp == 0 else None
            if l != expect:
                return path, tuple(g), tuple(l)
    return None
