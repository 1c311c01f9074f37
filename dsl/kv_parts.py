"""Which column splits divide their output part by part (check and lowering).

One decision, read by check (dsl/model_check.py: the split's sizes, parts and refusals;
dsl/own_tp_proof.py: the local shapes) and by lowering, which records it in the plan
(`TpReplacement.kv_parts`) for the runtime. A column split of a plain linear layer in the blocks
divides each part of its output alone (`ppdsl.core.own_tp.column_parts`, with the ``head_dim`` of
the layer's module) where

- the own forward splits its output into unequal parts (the trace's ``part_widths``: GPTBigCode's
  multi-query ``c_attn`` is q | k | v of widths E, d, d), or its one part holds fewer heads than
  tp (a ``k_proj`` of one key/value head; of several only in a module with
  ``num_key_value_groups``, whose query heads read them grouped as transformers' ``repeat_kv``
  does);
- a family names it a key / value projection (``kv_projections``) of fewer kv heads than tp, tp a
  multiple of them, or says its output is all query heads then one key and one value head under
  the model's config (its ``multi_query``: Falcon's ``query_key_value``), without sequence
  parallelism.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ppdsl.core.own_tp import Parts, column_parts

from .families import by_name
from .patterns import block_index
from .spec import Spec

if TYPE_CHECKING:
    from ppdsl.dsl.introspect import ModelInfo

__all__ = ["kv_parts", "unequal_parts"]


def unequal_parts(info: ModelInfo | None, path: str) -> tuple[int, ...]:
    """The widths of the unequal parts the forward splits layer ``path``'s output into (() if none)."""
    flow = getattr(info, "dataflow", None)
    return tuple(flow.part_widths.get(path, ())) if flow is not None else ()


def kv_parts(spec: Spec, info: ModelInfo | None, path: str, rule: Any, tp: Any) -> Parts:
    """The parts a column split ``rule`` of ``path`` divides one by one at ``tp`` (() for a plain
    split): a known tp, a layer in the blocks, not gathered; for the own forward a linear layer
    its built model (``info``) shows (check's local-shape proof refuses one that is not plain)."""
    if not isinstance(tp, int) or tp <= 1:
        return ()
    blocks = spec.pipeline.blocks
    bi = block_index(path, blocks)
    if rule.style != "column" or rule.gather_output or bi is None:
        return ()
    family = by_name(spec.model.family)
    if not family.layout_from_trace:  # the family's data and the config's dims: no model needed
        relative = path[len(f"{blocks}.{bi}."):]
        config, dims = spec.model.resolved_config, spec.model.dims
        heads, hidden, kv = dims.get("heads"), dims.get("hidden"), dims.get("kv_heads")
        if not heads or not hidden:
            return ()
        head_dim = config.get("head_dim") if isinstance(config.get("head_dim"), int) else hidden // heads
        if relative in family.kv_projections and kv and family.replicates_kv_heads(
                kv, tp, spec.tensor_parallel.sequence_parallel):
            return ((kv * head_dim, kv),)  # a key / value projection of fewer heads than tp
        when = family.multi_query.get(relative)
        if when is None or spec.tensor_parallel.sequence_parallel or any(config.get(k) != v for k, v in when.items()):
            return ()
        head_dim = hidden // heads
        return column_parts((heads * head_dim, head_dim, head_dim), head_dim, tp)
    m = info.modules.get(path) if info is not None else None
    if m is None or m.kind != "linear" or not m.out_features:
        return ()
    parent = info.modules.get(path.rpartition(".")[0])
    head_dim = parent.head_dim if parent is not None else None
    parts = column_parts(unequal_parts(info, path) or (m.out_features,), head_dim, tp)
    if any(h > 1 for _, h in parts) and (parent is None or parent.kv_groups is None):
        return ()  # several kv heads: rank r's are r // (tp / h) only under repeat_kv's grouping
    return parts
