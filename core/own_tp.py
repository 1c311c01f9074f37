"""The generic rule that makes an attention module of the own forward work on local heads.

A registered family names the attributes its attention reads (its ``attention_changes``). A class
no family claims has no such knowledge, so the rule reads the module: once its projections are
split over tp, an attribute with a head-count name (``num_heads``, ``num_key_value_heads``, ...)
whose value is a split projection's whole width / ``head_dim``, and an attribute with a width name
(``hidden_size``, ``embed_dim``, ``all_head_size``, ...) whose value is a split projection's whole
width, take the local value (divided by tp). Ratios (``num_key_value_groups``) and ``head_dim``
keep theirs. Check runs the forward at the local shapes with this rule applied (dsl/own_tp_proof.py),
the runtime applies the same rule to the real modules (runtime/parallelize.py).

Importing this module is torch-free.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["HEAD_COUNT_NAMES", "WIDTH_NAMES", "localize_generic", "split_width"]

HEAD_COUNT_NAMES = ("num_heads", "num_attention_heads", "num_key_value_heads", "num_kv_heads", "n_heads", "n_head",
                    "n_kv_heads", "num_kv")
WIDTH_NAMES = ("hidden_size", "embed_dim", "all_head_size", "inner_dim", "attention_hidden_size", "d_model",
               "kv_dim", "q_dim", "hidden_size_per_partition")
_MARK = "_ppdsl_generic_tp"


def split_width(layer: Any, style: str) -> int:
    """The whole width a split divides: a column's outputs, a row's inputs (``nn.Linear`` stores
    [out, in], transformers' ``Conv1D`` [in, out])."""
    out_dim = 1 if type(layer).__name__ == "Conv1D" else 0
    return int(layer.weight.shape[out_dim if style == "column" else 1 - out_dim])


def localize_generic(module: Any, split_widths: Iterable[int], tp: int) -> list[tuple[str, int, int]]:
    """Rewrite ``module``'s head-count and width attributes for local heads, in place: those equal
    to one of ``split_widths`` (the whole widths its split projections divide: a column's outputs,
    a row's inputs) or, for head counts, to such a width / ``module.head_dim``. Returns the
    (attribute, global, local) changes; a module is changed once (a second call changes nothing)."""
    if tp <= 1 or getattr(module, _MARK, None) is not None:
        return []
    if not any(type(getattr(module, n, None)) is int for n in HEAD_COUNT_NAMES):
        return []  # not an attention module (an MLP): nothing of it counts heads
    widths = {int(w) for w in split_widths if int(w) % tp == 0}
    head_dim = getattr(module, "head_dim", None)
    heads = {w // head_dim for w in widths if isinstance(head_dim, int) and head_dim > 0 and w % head_dim == 0}
    changes = []
    for names, values in ((HEAD_COUNT_NAMES, heads), (WIDTH_NAMES, widths)):
        for name in names:
            value = getattr(module, name, None)
            if type(value) is int and value in values and value % tp == 0:
                changes.append((name, value, value // tp))
    for name, _, local in changes:
        setattr(module, name, local)
    setattr(module, _MARK, tp)
    return changes
