"""The generic rule that makes an attention module of the own forward work on local heads.

A registered family names the attributes its attention reads (its ``attention_changes``). A class
no family claims has no such knowledge, so the rule reads the module: once its projections are
split over tp, an attribute with a head-count name (``num_heads``, ``num_key_value_heads``, ...)
whose value is a split projection's whole width / one head's width (``head_dim``, BERT-like
``attention_head_size``: `head_width`), and an attribute with a width name
(``hidden_size``, ``embed_dim``, ``all_head_size``, ...) whose value is a split projection's whole
width, take the local value (divided by tp). Ratios (``num_key_value_groups``) and ``head_dim``
keep theirs, except where a split projection holds fewer key/value heads than tp (below). A
module that counts heads but names no head width is refused (`unknown_head_count`): a forward
viewing the local width as (global count, -1) would run without a shape error on heads of the
wrong width. An input built outside the blocks for every head (BLOOM's ALiBi biases,
`PER_HEAD_INPUTS`) is sliced to the rank's heads on its way in. Check runs the forward at the
local shapes with this rule applied (dsl/own_tp_proof.py), the runtime applies the same rule to
the real modules (runtime/parallel/parallelize.py).

A column split's output may hold parts side by side that the forward splits apart (GPTBigCode's
multi-query ``c_attn``: q | k | v of widths E, d, d), and a part may hold fewer heads than tp (one
key/value head). `column_parts` says how each part divides: evenly over tp, or, with h heads
dividing tp, head ``rank // (tp / h)`` on each rank (its query heads read that kv head under
transformers' ``repeat_kv``); `part_rows` gives one rank's output rows. Such a layer stays whole on
every rank and computes only its rows (runtime/parallel/tp/kv_replicated.py), its gradients summed over tp.

Importing this module is torch-free.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

__all__ = ["HEAD_COUNT_NAMES", "HEAD_WIDTH_NAMES", "PER_HEAD_INPUTS", "WIDTH_NAMES", "Parts", "column_parts",
           "divided_widths", "head_width", "is_plain_linear", "kv_heads_by_parent", "localize_generic", "part_rows",
           "replicated_heads", "slice_per_head_inputs", "split_width", "unknown_head_count"]

# (width, heads) per part of a column split's output, in order: heads 0 where the part divides
# evenly over tp, else its head count (fewer than tp, dividing it): each head replicated
Parts = tuple[tuple[int, int], ...]

HEAD_COUNT_NAMES = ("num_heads", "num_attention_heads", "num_key_value_heads", "num_kv_heads", "n_heads", "n_head",
                    "n_kv_heads", "num_kv")
HEAD_WIDTH_NAMES = ("head_dim", "attention_head_size", "head_size", "d_head")  # one head's width, kept by the split
WIDTH_NAMES = ("hidden_size", "embed_dim", "all_head_size", "inner_dim", "attention_hidden_size", "d_model", "dim",
               "kv_dim", "q_dim", "hidden_size_per_partition", "split_size")
_MARK = "_ppdsl_generic_tp"
# module class -> (keyword, layout) of the inputs it takes that the model builds for every head
# before the blocks: each rank takes its heads' rows. "batch*heads": dim 0 is batch-major batch x
# heads; "heads": dim 0 is the heads
PER_HEAD_INPUTS: dict[str, tuple[tuple[str, str], ...]] = {
    "BloomAttention": (("alibi", "batch*heads"),),  # BloomModel's build_alibi_tensor: (batch * n_head, 1, keys)
    "MptAttention": (("position_bias", "heads"),),  # MptModel's build_mpt_alibi_tensor: (n_heads, 1, keys)
}


def head_width(module: Any) -> int | None:
    """One head's width as ``module`` names it (``head_dim``; BERT-like ``attention_head_size``)."""
    for name in HEAD_WIDTH_NAMES:
        value = getattr(module, name, None)
        if type(value) is int and value > 0:
            return value
    return None


def split_width(layer: Any, style: str) -> int:
    """The whole width a split divides: a column's outputs, a row's inputs (``nn.Linear`` stores
    [out, in], transformers' ``Conv1D`` [in, out])."""
    out_dim = 1 if type(layer).__name__ == "Conv1D" else 0
    return int(layer.weight.shape[out_dim if style == "column" else 1 - out_dim])


def is_plain_linear(layer: Any) -> bool:
    """torch's ``nn.Linear`` or transformers' ``Conv1D``: the layers a split replaces in place."""
    cls = type(layer)
    return (cls.__name__ == "Linear" and cls.__module__ == "torch.nn.modules.linear"
            or cls.__name__ == "Conv1D" and cls.__module__.startswith("transformers."))


def column_parts(widths: Sequence[int], head_dim: int | None, tp: int) -> Parts:
    """How a column split over ``tp`` divides an output holding parts of ``widths`` side by side,
    for a module whose heads are ``head_dim`` wide: () where a plain split is right (one part that
    divides evenly); otherwise (width, heads) per part (`Parts`). () too where a part neither
    divides by heads over tp nor holds fewer heads than tp dividing it: check's usual rules judge
    that split."""
    parts = []
    for w in widths:
        heads = w // head_dim if head_dim and w % head_dim == 0 else None
        if heads is not None and heads < tp and tp % heads == 0:
            parts.append((w, heads))
        elif (heads is None and w % tp == 0) or (heads is not None and heads % tp == 0):
            parts.append((w, 0))
        else:
            return ()
    if len(parts) == 1 and parts[0][1] == 0:
        return ()
    if len(parts) > 1 and parts[0][1]:
        return ()  # the first of several parts holds the query heads: fewer than tp is not a kv layout
    return tuple(parts)


def part_rows(parts: Parts, tp: int, rank: int) -> tuple[tuple[int, int], ...]:
    """The [start, end) output rows tp rank ``rank`` computes of a layer whose output holds
    ``parts``: its 1/tp of each evenly divided part, and head ``rank // (tp / h)`` of a part of h
    heads."""
    rows, offset = [], 0
    for width, heads in parts:
        if heads == 0:
            share = width // tp
            rows.append((offset + rank * share, offset + (rank + 1) * share))
        else:
            size, head = width // heads, rank // (tp // heads)
            rows.append((offset + head * size, offset + (head + 1) * size))
        offset += width
    return tuple(rows)


def replicated_heads(parts: Parts) -> int:
    """The head count of the replicated parts of ``parts`` (0: none): the key/value heads."""
    return max((h for _, h in parts), default=0)


def kv_heads_by_parent(splits: Iterable[tuple[str, Any]]) -> dict[str, int]:
    """Module -> the key/value heads its split children replicate (`replicated_heads` of their
    ``kv_parts``), for `localize_generic`'s ``kv_heads``."""
    found: dict[str, int] = {}
    for path, rule in splits:
        if heads := replicated_heads(getattr(rule, "kv_parts", ())):
            found[path.rpartition(".")[0]] = heads
    return found


def divided_widths(splits: Iterable[tuple[str, Any]], module_at: Callable[[str], Any],
                   in_blocks: Callable[[str], bool]) -> dict[str, list[int]]:
    """Block module -> the whole widths its split children divide, for `localize_generic`:
    ``splits`` are (layer path, rule with ``style``, ``gather_output`` and ``kv_parts``); a row
    split divides its inputs, a column split not gathered its outputs (with parts, each part
    divided evenly); read before the layers are split. Only plain layers (`is_plain_linear`) in a
    module under the blocks (``in_blocks(parent path)``) count."""
    widths: dict[str, list[int]] = {}
    for path, rule in splits:
        parent = path.rpartition(".")[0]
        if not (rule.style == "row" or (rule.style == "column" and not rule.gather_output)) or not in_blocks(parent):
            continue
        layer = module_at(path)
        if not is_plain_linear(layer):
            continue
        parts = getattr(rule, "kv_parts", ())
        if parts:
            widths.setdefault(parent, []).extend(w for w, heads in parts if heads == 0)
        else:
            widths.setdefault(parent, []).append(split_width(layer, rule.style))
    return widths


def slice_per_head_inputs(module: Any, tp: int, rank: int) -> bool:
    """Slice the `PER_HEAD_INPUTS` of ``module`` (one whose heads are local) to tp rank ``rank``'s
    heads on each call, by a forward pre-hook: rows [rank * h, (rank + 1) * h) of each batch entry's
    heads, h = heads / tp, the heads a column split of its projections gives the rank. Returns
    whether the module takes such an input."""
    names = PER_HEAD_INPUTS.get(type(module).__name__)
    if tp <= 1 or not names:
        return False

    def hook(_: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        hidden = args[0] if args else kwargs["hidden_states"]
        for name, layout in names:
            x = kwargs.get(name)
            if x is None:
                continue
            batch = hidden.shape[0] if layout == "batch*heads" else 1
            local = x.shape[0] // batch // tp
            kwargs[name] = x.reshape(batch, tp, local, *x.shape[1:])[:, rank].reshape(batch * local, *x.shape[1:])
        return args, kwargs

    module.register_forward_pre_hook(hook, with_kwargs=True)
    return True


def unknown_head_count(module: Any, split_widths: Iterable[int], tp: int) -> str | None:
    """Why the generic rule cannot make ``module``'s heads local, or None: it holds a head count
    (a `HEAD_COUNT_NAMES` attribute, a multiple of tp dividing a split width) but names no head
    width, so the rule cannot tell the count from a width / head ratio, and a forward that views
    the local width as (count, -1) would run on heads of the wrong width without a shape error."""
    if tp <= 1 or head_width(module) is not None:
        return None
    widths = [int(w) for w in split_widths]
    for name in HEAD_COUNT_NAMES:
        value = getattr(module, name, None)
        if type(value) is int and value > 1 and value % tp == 0 and any(w % value == 0 for w in widths):
            return (f"it counts {value} heads ('{name}') but names no head width ({', '.join(HEAD_WIDTH_NAMES)}), "
                    "so ppdsl cannot tell whether its forward needs that count made local")
    return None


def localize_generic(module: Any, split_widths: Iterable[int], tp: int, kv_heads: int = 0) -> list[tuple[str, int, int]]:
    """Rewrite ``module``'s head-count and width attributes for local heads, in place: those equal
    to one of ``split_widths`` (the whole widths its split projections divide: a column's outputs,
    a row's inputs) or, for head counts, to such a width / ``module.head_dim``. ``kv_heads``: its
    projections hold that many key/value heads, fewer than tp, each rank one of them
    (`column_parts`): ``num_key_value_groups`` becomes the rank's query heads per kv head. Returns
    the (attribute, global, local) changes; a module is changed once (a second call changes nothing)."""
    if tp <= 1 or getattr(module, _MARK, None) is not None:
        return []
    groups = getattr(module, "num_key_value_groups", None)
    if not any(type(getattr(module, n, None)) is int for n in HEAD_COUNT_NAMES) and not (kv_heads and type(groups) is int):
        return []  # not an attention module (an MLP): nothing of it counts heads
    widths = {int(w) for w in split_widths if int(w) % tp == 0}
    head_dim = head_width(module)
    heads = {w // head_dim for w in widths if head_dim and w % head_dim == 0}
    changes = []
    for names, values in ((HEAD_COUNT_NAMES, heads), (WIDTH_NAMES, widths)):
        for name in names:
            value = getattr(module, name, None)
            if type(value) is int and value in values and value % tp == 0:
                changes.append((name, value, value // tp))
    if kv_heads and type(groups) is int and groups * kv_heads % tp == 0:
        changes.append(("num_key_value_groups", groups, groups * kv_heads // tp))  # local heads / 1 kv head
    for name, _, local in changes:
        setattr(module, name, local)
    setattr(module, _MARK, tp)
    return changes
