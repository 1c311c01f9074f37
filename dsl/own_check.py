"""check for the classes that run their own forward (family "own", core/families/own/).

The meta trace of the forward (`ppdsl.dsl.own_layout`, run when the model is built) gives the
layout or the reason the class cannot be cut into stages. `with_inferred_layout` fills
``pipeline.blocks`` / ``first`` / ``last`` from it where the spec leaves them out (lowering
then records them in the plan); `check_own` refuses the class (E0420 to E0422, E0424, E0425), tp > 1
(E0423: not built yet); `layout_mismatch` says where a written layout is not the one the forward
runs (model_check's E0402).
"""

from __future__ import annotations

from typing import Any, Iterator

import attrs

from .diagnostics import Diagnostic, error
from .exact import Expr
from .spec import Spec

__all__ = ["check_own", "layout_mismatch", "with_inferred_layout"]

# the trace's refusal -> (its code, the hint)
_REFUSALS = {
    "cross_block_state": ("E0420", "ppdsl cuts the own forward between blocks, passing the hidden state only; a family folder "
                          "(core/families/) can run such a model by hand"),
    "not_tokens": ("E0421", "ppdsl pipelines decoder-only and encoder-only models on token ids"),
    "shared_layers": ("E0422", "a stage holds its blocks and nothing else of the block list: shared layers cannot be split"),
    "cut_fails": ("E0425", "ppdsl runs the model's own forward cut between blocks; a class whose forward does not survive the "
                  "cut needs a family folder (core/families/)"),
    "untraceable": ("E0424", "name the block list and the modules around it (pipeline.blocks / first / last) of a model whose "
             "forward runs them in sequence, or write it as a python factory"),
}


def _applies(spec: Spec, info: Any) -> bool:
    return spec.model.family == "own" and info is not None


def with_inferred_layout(spec: Spec, info: Any) -> Spec:
    """``spec`` with the traced layout where ``pipeline.blocks`` / ``first`` / ``last`` are not written."""
    layout = getattr(info, "own_layout", None)
    if not _applies(spec, info) or layout is None or not layout.ok:
        return spec
    p = spec.pipeline
    given = {k: f"pipeline.{k}" in spec.spans for k in ("blocks", "first", "last")}
    return attrs.evolve(spec, pipeline=attrs.evolve(
        p, blocks=p.blocks if given["blocks"] else layout.blocks, first=p.first if given["first"] else layout.first,
        last=p.last if given["last"] else layout.last))


def check_own(spec: Spec, info: Any) -> Iterator[Diagnostic]:
    """The own forward's refusals; after an error here no other model-level rule is meaningful."""
    if not _applies(spec, info):
        return
    layout = info.own_layout
    at = spec.span("model.source") or spec.span("model")
    if layout is None:
        code, hint = _REFUSALS["untraceable"]
        yield error(code, at, f"{info.class_name}: its own forward was not traced", hint=hint)
        return
    if not layout.ok:
        code, hint = _REFUSALS[layout.refusal]
        yield error(code, at, f"{info.class_name} cannot be cut into pipeline stages: {layout.reason}", hint=hint)
        return
    tp = spec.mesh.tp
    if not (isinstance(tp, Expr) and tp.is_Integer and int(tp) == 1):
        yield error("E0423", spec.span("mesh.tp") or spec.span("mesh") or at,
                    f"{info.class_name} runs its own forward, which ppdsl runs at tp = 1 only (tensor parallelism for "
                    "classes outside the registered families is not built yet)",
                    hint="set tp = 1 and use the ranks for pp and dp")
        return


def layout_mismatch(spec: Spec, info: Any) -> tuple[str, str, str] | None:
    """(key, message, hint) when a written pipeline.blocks / first / last is not what the own
    forward runs (model_check reports it as E0402, like a family's layout); None otherwise."""
    layout = getattr(info, "own_layout", None)
    if not _applies(spec, info) or layout is None or not layout.ok:
        return None
    p = spec.pipeline
    for key, got, want in (("blocks", (p.blocks,), (layout.blocks,)), ("first", p.first, layout.first),
                           ("last", p.last, layout.last)):
        if set(got) != set(want):
            return (key, f"{info.class_name}'s forward runs {', '.join(want) or 'no module'} as pipeline.{key}, "
                         f"not {', '.join(got) or 'none'}", f"leave pipeline.{key} out: ppdsl finds it in the model's forward")
    return None
