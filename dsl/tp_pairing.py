"""Column/row pairing judged on the data path (Megatron's f/g pairing), torch-free.

The traced forward (`ppdsl.dsl.tp_dataflow.DataFlow`) says which layers' outputs reach each
layer's input. With the rules in force (the last rule naming a module decides it) every layer
output is either **split** over the tensor-parallel ranks (a column split without
``gather_output``) or **whole** (everything else: a row split and a vocab embedding all-reduce
their output, a gathered column is gathered, a replicated layer computes it all). Then:

- a row split needs every producer split: all whole is E0212, a mix of split and whole (q and k
  split, v whole; one of them gathered or overridden back to whole) is E0220;
- a split output may only reach row splits, or the model output when it is the head's
  (vocab-parallel cross entropy): anything else takes it whole, which is E0219.

Without a traced forward, `check_pairing_per_block` judges the same rule coarsely: a column split
and a row split must at least appear in the same block (with note N0219 when the trace failed on
meta alone; a forward that fails on a shape is E0428, `ppdsl.dsl.forward_check`).

Each diagnostic points at the rule that decided the offending layer: the override that made one
projection whole, the replicate rule of the consumer, or the column split nobody consumes.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from .diagnostics import Diagnostic, error, note
from .forward_check import forward_refused, meta_failure
from .patterns import block_index
from .spec import Spec

if TYPE_CHECKING:
    from ppdsl.dsl.introspect import ModelInfo

__all__ = ["check_pairing", "check_pairing_per_block"]


def _split(rule: Any) -> bool:
    return rule is not None and rule.style == "column" and not rule.gather_output


def _parent(path: str) -> str:
    return path.rpartition(".")[0]


def _names(paths: list[str], limit: int = 3) -> str:
    shown = ", ".join(paths[:limit])
    return shown + (f" and {len(paths) - limit} more" if len(paths) > limit else "")


def _whole_by(path: str, rule: Any) -> str:
    if rule is None:
        return f"{path} has no rule, so it stays whole"
    if rule.style == "column":
        return f"'{rule.text}' gathers the output of {path} (gather_output = true)"
    if rule.style == "replicate":
        return f"'{rule.text}' keeps {path} whole"
    return f"'{rule.text}' splits {path} by {rule.style}, which gives a whole output"


def check_pairing(effective: Mapping[str, Any], flow: Any, reported: set[int] | None = None,
                  replicated: frozenset[str] = frozenset()) -> Iterator[Diagnostic]:
    """``effective``: module path -> the TpRule in force; ``flow``: a DataFlow; ``reported``: ids of
    rules already reported (a size that does not divide): nothing more is said about them;
    ``replicated``: column splits whose every rank computes the whole output (one key / value
    head kept on every rank, `dsl/kv_parts.py`): split for their row split and for a column split,
    whole for a consumer without a split rule inside the same module (Qwen3's k_norm over the one
    head, inside its attention: its gradients are summed over tp like the projection's, and its
    output goes on to the rank's query heads)."""
    reported = set(reported or ())

    def once(rule: Any) -> bool:
        if id(rule) in reported:
            return False
        reported.add(id(rule))
        return True

    order = {path: i for i, path in enumerate(flow.producers)}  # forward order: q before k before v
    for consumer, producers in flow.producers.items():
        rule = effective.get(consumer)
        ordered = sorted(producers, key=lambda p: (order.get(p, -1), p))
        split = [p for p in ordered if _split(effective.get(p))]
        whole = [p for p in ordered if not _split(effective.get(p))]
        if rule is not None and rule.style == "row":
            if not split:
                if once(rule):
                    source = f"its input comes from {_names(whole)}, none of them column-split" if whole \
                        else "its input is the model's input"
                    yield error("E0212", rule.span,
                                f"'{rule.text}' splits {consumer} by row, but {source}: a row split needs its input "
                                "already split over tp",
                                hint="split the layers feeding it by column (q, k, v before the attention output; "
                                     "the up projection before the down one), or do not split it")
            elif whole:
                # a projection made whole by its rule (replicate, gathered) is the odd one out; a row
                # split or an embedding before it is simply another path into the same input
                explicit = [p for p in whole if p in effective and effective[p].style in ("replicate", "column")]
                offender = explicit[0] if explicit else split[0]
                if not once(effective[offender]):
                    continue
                if explicit:
                    message = (f"{_whole_by(offender, effective[offender])}, but {_names(split)}, which "
                               f"feed{'s' if len(split) == 1 else ''} {consumer} (row) with it, "
                               f"{'is' if len(split) == 1 else 'are'} column-split")
                else:
                    message = (f"'{effective[offender].text}' splits {offender} by column, but {_names(whole)}, which "
                               f"feed{'s' if len(whole) == 1 else ''} {consumer} (row) with it, "
                               f"{'is' if len(whole) == 1 else 'are'} whole")
                fix = "" if explicit else f"split {_names(whole)} by column too, or "
                yield error("E0220", effective[offender].span,
                            message + ": layers whose outputs meet before a row split must be split alike",
                            hint=f"{fix}split q, k and v (or gate and up) all by column before the row split, "
                                 "or keep all of them and the row split whole")
            continue
        if rule is None or rule.style == "replicate":  # a whole consumer in the same attention module
            split = [p for p in split if not (p in replicated and _parent(p) == _parent(consumer))]
        if not split:
            continue
        # A split output reaches a layer that takes its input whole.
        if rule is not None and rule.style != "column":
            if once(rule):
                yield error("E0219", rule.span,
                            f"{_whole_by(consumer, rule)}, but its input from {_names(split)} is split over tp "
                            f"by '{effective[split[0]].text}'",
                            hint=f"split {consumer} by row, or gather the column split's output "
                                 "(column(gather_output = true))")
            continue
        producer_rule = effective[split[0]]
        if once(producer_rule):
            gather = f"{producer_rule.text} : column(gather_output = true)"
            if consumer in flow.watched:
                yield error("E0219", producer_rule.span,
                            f"'{producer_rule.text}' leaves the output of {split[0]} split over tp, but the norm "
                            f"{consumer} normalises it over all its features: only a row split can take a split input",
                            hint=f"pair it with a row split before {consumer} (Megatron's column -> row pairing), "
                                 f"or write {gather}")
                continue
            how = "is whole" if rule is None else f"is split by '{rule.text}' again (column)"
            yield error("E0219", producer_rule.span,
                        f"'{producer_rule.text}' leaves the output of {split[0]} split over tp, but {consumer}, "
                        f"which consumes it, {how}: only a row split can take a split input",
                        hint=f"split {consumer} by row (Megatron's column -> row pairing), or write {gather}")
    heads = sorted(p for p in flow.outputs if _split(effective.get(p)))
    if heads and len(flow.outputs) > 1:
        rule = effective[heads[0]]
        if once(rule):
            yield error("E0219", rule.span,
                        f"'{rule.text}' leaves the output of {heads[0]} split over tp, and it reaches the model's "
                        "output mixed with whole tensors",
                        hint="only the head's own output may stay split (vocab-parallel cross entropy); "
                             "pair the column split with a row split")


def check_pairing_per_block(spec: Spec, info: ModelInfo | None, effective: dict[str, Any]) -> Iterator[Diagnostic]:
    """Without a traced forward: column and row splits must at least appear in the same block."""
    per_block: dict[int, list[Any]] = defaultdict(list)
    for path, rule in effective.items():
        bi = block_index(path, spec.pipeline.blocks)
        if bi is not None and rule.style in ("column", "row") and not rule.gather_output:
            per_block[bi].append(rule)
    if not per_block:
        return
    if not forward_refused(spec, info):  # else E0428 says the forward fails (dsl/forward_check.py)
        yield note("N0219", spec.span("tensor_parallel"),
                   f"the model's forward could not be traced on meta ({meta_failure(info.dataflow_error)}): column/row pairing "
                   "is checked per block only", hint="ppdsl verify runs the layout against one process")
    for bi, rules in sorted(per_block.items()):
        styles = [r.style for r in rules]
        if "column" in styles and "row" not in styles:
            rule = rules[styles.index("column")]
            yield error("E0219", rule.span or spec.span("tensor_parallel"),
                        f"'{rule.text}' splits a linear by column but no row split in block {bi} consumes it",
                        hint="pair each column split with a row split in the same block, or set gather_output = true")
            return
        if "row" in styles and "column" not in styles:
            rule = rules[styles.index("row")]
            yield error("E0212", rule.span or spec.span("tensor_parallel"),
                        f"'{rule.text}' splits a linear by row but no column split in block {bi} feeds it",
                        hint="a row-parallel linear expects its input split by a column-parallel one (Megatron f/g pairing)")
            return
