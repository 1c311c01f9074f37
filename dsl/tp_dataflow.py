"""Which layer feeds which: a taint analysis of one forward pass on the meta device.

`trace_dataflow` runs the model's forward once on meta tensors (nothing allocated) under a
``TorchFunctionMode``. The output of every linear / Conv1D / embedding is tagged with the
module's path; every torch op gives its outputs the union of its inputs' tags; a layer's
forward-pre-hook records the tags reaching its input. The result, `DataFlow`, is pure data:
for each layer the layers whose outputs reach its input without passing through another layer
(its producers), the number of equal parts the forward splits a layer's output into (GPT-2's
``c_attn`` output is split into q, k, v), the widths of unequal ones (GPTBigCode's multi-query
``c_attn``: q, then one key and one value head), and the layers whose outputs reach the model output.

`ppdsl check` judges tensor-parallel rules on it (`ppdsl.dsl.model_check`): a row split needs
every producer column-split, a column split's consumers must all be row splits, and
``fused = k`` must match the parts the forward really splits the output into.

torch is imported inside the functions only, like `ppdsl.dsl.introspect`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    from torch import nn

__all__ = ["DataFlow", "MetaOnlyFailure", "replays_on_cpu", "trace_dataflow"]

_SPLITS = ("split", "chunk", "tensor_split", "unbind")


@attrs.frozen
class DataFlow:
    """What one forward pass showed. Paths are module paths of linear / Conv1D / embedding layers."""

    producers: Mapping[str, frozenset[str]]  # layer (or watched norm) -> the layers whose outputs reach its input
    fused_parts: Mapping[str, int]  # layer -> k when the forward splits its output into k equal parts
    outputs: frozenset[str]  # layers whose outputs reach the model's output
    watched: frozenset[str] = frozenset()  # the norms among the producers' keys
    # layer -> the widths of the unequal parts the forward splits its output into, in order
    part_widths: Mapping[str, tuple[int, ...]] = attrs.field(factory=dict)

    def consumers(self, path: str) -> list[str]:
        return [c for c, ps in self.producers.items() if path in ps]


def trace_dataflow(model: nn.Module, config: Mapping[str, object], layer_paths: list[str],
                   watched: list[str] | tuple[str, ...] = ()) -> DataFlow:
    """Run ``model`` (on meta) once on a small batch of token ids and follow every tensor.

    ``layer_paths`` are the modules to tag (linear, Conv1D, embedding); ``watched`` modules
    (norms) only record their producers: they normalise over the features, so a split input is
    wrong for them too. Raises whatever the forward raises; the caller treats that as "no
    dataflow known".
    """
    import torch
    from torch.overrides import TorchFunctionMode
    from torch.utils._pytree import tree_flatten

    from ppdsl.core.meta_values import meta_autocast, scalar_reads

    tags: dict[int, frozenset[str]] = {}
    alive: list[Any] = []  # keeps every tagged tensor alive, so that no id is reused
    direct: dict[int, str] = {}  # id of a layer's output tensor -> the layer
    producers: dict[str, frozenset[str]] = {}
    fused: dict[str, int] = {}
    unequal: dict[str, tuple[int, ...]] = {}
    out_width: dict[str, int] = {}  # layer -> the last dim of its output
    norm_width: dict[str, int] = {}  # watched norm -> the last dim it normalises

    def tags_of(tree: Any) -> frozenset[str]:
        out: frozenset[str] = frozenset()
        for leaf in tree_flatten(tree)[0]:
            if isinstance(leaf, torch.Tensor):
                out |= tags.get(id(leaf), frozenset())
        return out

    def put(tree: Any, value: frozenset[str], replace: bool = False) -> None:
        for leaf in tree_flatten(tree)[0]:
            if isinstance(leaf, torch.Tensor):
                alive.append(leaf)
                tags[id(leaf)] = value if replace else tags.get(id(leaf), frozenset()) | value

    def parts_of_split(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], result: Any) -> None:
        name = getattr(func, "__name__", "")
        if name not in _SPLITS or not args or not isinstance(args[0], torch.Tensor) or args[0].dim() == 0:
            return
        x = args[0]
        at = 1 if name == "unbind" else 2  # the position of `dim`: unbind(x, dim), split(x, size, dim)
        dim = kwargs.get("dim", args[at] if len(args) > at else 0)
        if not isinstance(dim, int):
            return
        pieces = [t for t in result if isinstance(t, torch.Tensor)] if isinstance(result, (tuple, list)) else []
        if dim % x.dim() != x.dim() - 1:
            viewed_parts(x, dim % x.dim(), pieces, name == "unbind")
            return
        sizes = [int(t.shape[-1]) for t in pieces]
        source = direct.get(id(args[0]))
        if source is not None and len(pieces) > 1 and len(set(sizes)) == 1:
            fused[source] = len(pieces)
        # unequal parts of one layer's output, reshaped on the way (unsqueeze, view) but whole
        origin = tags.get(id(x), frozenset())
        if len(origin) == 1 and len(set(sizes)) > 1:
            (layer,) = origin
            if out_width.get(layer) == x.shape[-1]:
                unequal.setdefault(layer, tuple(sizes))

    viewed: dict[int, tuple[str, int]] = {}  # id of a view of a layer's output -> (layer, its outer width dim)

    def follow_view(func: Any, args: tuple[Any, ...], result: Any) -> None:
        """A layer's whole output viewed with its width as (k, ...) (ModernBERT's Wqkv: view(..., 3,
        heads, head_dim)) remembers the dim holding k, through transposes and permutes too."""
        name = getattr(func, "__name__", "")
        if not args or not isinstance(args[0], torch.Tensor) or not isinstance(result, torch.Tensor):
            return
        x = args[0]
        if name in ("view", "reshape", "unflatten") and x.dim() > 0:
            origin = tags.get(id(x), frozenset())
            if len(origin) == 1:
                (layer,) = origin
                width = out_width.get(layer)
                if width == x.shape[-1] and result.dim() > x.dim():
                    for j in range(result.dim() - 1):
                        if math.prod(int(n) for n in result.shape[j:]) == width:
                            viewed[id(result)] = (layer, j)
                            alive.append(result)
                            break
        elif id(x) in viewed and name in ("transpose", "swapaxes", "permute", "contiguous"):
            layer, j = viewed[id(x)]
            if name == "permute":
                order = [int(d) % x.dim() for d in (args[1] if len(args) == 2 and isinstance(args[1], (tuple, list))
                                                     else args[1:])]
                j = order.index(j) if j in order else -1
            elif name != "contiguous":
                a, b = (int(d) % x.dim() for d in args[1:3])
                j = b if j == a else a if j == b else j
            if j >= 0:
                viewed[id(result)] = (layer, j)
                alive.append(result)

    def viewed_parts(x: Any, dim: int, pieces: list[Any], unbind: bool) -> None:
        """Such a view taken apart along k: ``unbind(-3)`` or an equal split, k fused parts, as a
        split of the last dim; an unequal split (5.25's Falcon: (heads + 2, head_dim) split into
        heads, 1, 1) unequal parts of those widths."""
        layer, j = viewed.get(id(x), ("", -1))
        if j != dim or len(pieces) < 2:
            return
        sizes = [1] * len(pieces) if unbind else [int(t.shape[dim]) for t in pieces]
        if len(set(sizes)) == 1:
            fused[layer] = len(pieces)
        else:
            inner = math.prod(int(n) for n in x.shape[dim + 1:])
            unequal.setdefault(layer, tuple(s * inner for s in sizes))

    reads = scalar_reads()

    class Taint(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            if func in reads and args and getattr(args[0], "is_meta", False):
                # A data-dependent branch (a mask that may be all ones, a packed sequence):
                # meta tensors hold no values; take the plain path.
                return reads[func]
            try:
                result = func(*args, **kwargs)
            except Exception as exc:
                if replays_on_cpu(func, args, kwargs):
                    raise MetaOnlyFailure(f"{type(exc).__name__}: {_first_line(exc)} (on meta; the same "
                                          f"{getattr(func, '__name__', 'call')} runs on cpu)") from exc
                raise
            incoming = tags_of((args, kwargs))
            if incoming:
                put(result, incoming)
            follow_view(func, args, result)
            parts_of_split(func, args, kwargs, result)
            return result

    def pre_hook(path: str) -> Any:
        def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            producers[path] = producers.get(path, frozenset()) | tags_of((args, kwargs))
            if path in watched and args and isinstance(args[0], torch.Tensor) and args[0].dim() > 0:
                norm_width[path] = int(args[0].shape[-1])
        return hook

    def post_hook(path: str) -> Any:
        def hook(module: Any, args: Any, kwargs: Any, output: Any) -> None:
            put(output, frozenset({path}), replace=True)
            if isinstance(output, torch.Tensor):
                direct[id(output)] = path
                if output.dim() > 0:
                    out_width[path] = int(output.shape[-1])
        return hook

    handles = []
    for path in layer_paths:
        module = model.get_submodule(path)
        handles.append(module.register_forward_pre_hook(pre_hook(path), with_kwargs=True))
        handles.append(module.register_forward_hook(post_hook(path), with_kwargs=True))
    for path in watched:
        handles.append(model.get_submodule(path).register_forward_pre_hook(pre_hook(path), with_kwargs=True))
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), meta_autocast(), Taint():
            out = _call(model, _seq_len(config), config)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    logits = getattr(out, "logits", out)
    # A norm over a part of each producer's output (Qwen3's q/k norm over one head's features)
    # normalises within a head: a split by heads keeps each head whole on one rank.
    per_head = {n for n in watched if n in norm_width and producers.get(n) and all(
        norm_width[n] < out_width.get(p, 0) and out_width[p] % norm_width[n] == 0 for p in producers[n])}
    return DataFlow(producers={k: v for k, v in producers.items() if k not in per_head}, fused_parts=dict(fused),
                    outputs=tags_of(logits), watched=frozenset(watched) - per_head,
                    part_widths=dict(unequal))


class MetaOnlyFailure(RuntimeError):
    """The forward failed on meta in a call that runs on cpu at the same shapes and dtypes: the
    meta kernel's own limit (torch's grouped_mm on meta takes bf16 only), not the model's."""


# the most elements a failed call's tensors may hold for check to run it again on cpu (zeros)
REPLAY_ELEMENTS = 1 << 25


def replays_on_cpu(func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bool:
    """Whether a torch call that failed on meta runs on cpu with zero-filled tensors of the same
    shapes and dtypes (False when it fails there too, or cannot be tried: no meta tensor, too large)."""
    import torch
    from torch.utils._pytree import tree_flatten, tree_map

    tensors = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
    if not any(x.is_meta for x in tensors) or sum(x.numel() for x in tensors) > REPLAY_ELEMENTS:
        return False

    def real(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_meta:
            return torch.zeros(x.shape, dtype=x.dtype, device="cpu")
        if isinstance(x, torch.device) and x.type == "meta" or isinstance(x, str) and x == "meta":
            return torch.device("cpu")
        return x

    try:
        with torch.no_grad():
            func(*tree_map(real, args), **tree_map(real, dict(kwargs)))
    except Exception:
        return False
    return True


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else ""


def _seq_len(config: Mapping[str, object]) -> int:
    limits = [v for k in ("n_positions", "max_position_embeddings", "max_seq_len") if isinstance(v := config.get(k), int)]
    return max(1, min([8, *limits]))


def _call(model: Any, seq: int, config: Mapping[str, object] | None = None, batch: int = 1) -> Any:
    """One forward of ``model`` on meta inputs (`ppdsl.core.model_inputs`: token ids of ``(batch,
    seq)``, or images); a python factory's module takes the ids positionally."""
    import torch

    if hasattr(model, "config") and hasattr(model.config, "to_dict"):  # a transformers model
        from ppdsl.core.model_inputs import meta_inputs

        kwargs = {"use_cache": False} if "use_cache" in model.config.to_dict() else {}
        return model(**meta_inputs(model, batch, seq, config), **kwargs)
    return model(torch.zeros((batch, seq), dtype=torch.long, device="meta"))
