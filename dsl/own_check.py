"""check for the classes that run their own forward (family "own", core/families/own/).

The meta trace of the forward (`ppdsl.dsl.own_layout`, run when the model is built) gives the
layout or the reason the class cannot be cut into stages. `with_inferred_layout` fills
``pipeline.blocks`` / ``first`` / ``last`` from it where the spec leaves them out (lowering
then records them in the plan); `check_own` refuses the class (E0420 to E0422, E0424, E0425) and what
tensor parallelism of the own forward does not run (E0423); with ``hf_plan = true`` the split
rules are the plan the built class declares (`with_inferred_layout` adds them, as written in HF:
a gathered column stays gathered, since nothing proves the modules between it and the next split
work on a slice). `layout_mismatch` says where a written layout is not the one the forward runs
(model_check's E0402). The split itself is proven at each rank's local shapes on meta
(dsl/own_tp_proof.py, E0426).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator

import attrs

from ppdsl.core.families.descriptor import HfSplit, hf_splits_of

from .diagnostics import Diagnostic, error, warning
from .exact import Expr
from .families import by_name
from .patterns import match
from .resolve.tensor_parallel import hf_rules, lost_entries, no_plan
from .rules import tp_split_rules
from .spec import Spec, TpRule

if TYPE_CHECKING:
    from ppdsl.dsl.introspect import ModelInfo

__all__ = ["check_own", "layout_mismatch", "untraced", "with_inferred_layout"]

# the trace's refusal -> (its code, the hint)
_REFUSALS = {
    "cross_block_state": ("E0420", "ppdsl cuts the own forward between blocks, passing the hidden state and what the block "
                          "before returns of the rest; a family folder (core/families/) can run such a model by hand"),
    "not_tokens": ("E0421", "ppdsl pipelines models on token ids (input_ids; encoder-decoders with decoder_input_ids), "
                   "image models on pixel_values (ViT) and speech-to-text models on input_features with "
                   "decoder_input_ids (Whisper); other inputs (input_values, ...) are not built yet"),
    "shared_layers": ("E0422", "a stage holds its blocks and nothing else of the block list: shared layers cannot be split"),
    "cut_fails": ("E0425", "ppdsl runs the model's own forward cut between blocks; a class whose forward does not survive the "
                  "cut needs a family folder (core/families/)"),
    "decoder_inputs": ("E0439", "write the token the decoder starts from in the config, a row of its vocabulary: "
                       "config { decoder_start_token_id = ... } (T5's checkpoints use 0, its pad id)"),
    "image_width": ("E0478", "make the projector's output the text model's hidden size: the config key of the "
                    "projector's width (PaliGemma's projection_dim) equal to text_config's "
                    "hidden_size"),
    "untraceable": ("E0424", "name the block list and the modules around it (pipeline.blocks / first / last) of a model whose "
             "forward runs them in sequence, or write it as a python factory"),
}


def _applies(spec: Spec, info: ModelInfo | None) -> bool:
    return by_name(spec.model.family).layout_from_trace and info is not None


def with_inferred_layout(spec: Spec, info: ModelInfo | None) -> Spec:
    """``spec`` with the traced layout where ``pipeline.blocks`` / ``first`` / ``last`` are not
    written, and with ``hf_plan = true`` the class's declared split rules after the written ones."""
    layout = getattr(info, "own_layout", None)
    if not _applies(spec, info) or layout is None or not layout.ok:
        return spec
    p = spec.pipeline
    given = {k: f"pipeline.{k}" in spec.spans for k in ("blocks", "first", "last")}
    tp = spec.tensor_parallel
    written = {r.text for r in tp.rules}  # a rule written in the spec wins over HF's
    declared = [r for r in _declared_rules(spec, info)[0] if r.text not in written]
    return attrs.evolve(spec, pipeline=attrs.evolve(
        p, blocks=p.blocks if given["blocks"] else layout.blocks, first=p.first if given["first"] else layout.first,
        last=p.last if given["last"] else layout.last, shared=layout.shared),
        tensor_parallel=attrs.evolve(tp, rules=(*tp.rules, *declared)))


def _declared_splits(info: ModelInfo | None) -> tuple[HfSplit, ...]:
    layout = info.own_layout
    return hf_splits_of(dict(layout.hf_tp_base), dict(layout.hf_tp_head), layout.base_prefix, pair_gathers=False)


def _declared_rules(spec: Spec, info: ModelInfo | None) -> tuple[list[TpRule], list[HfSplit]]:
    """With ``hf_plan = true``: the class's plan as rules, and its entries that stay replicated."""
    if spec.tensor_parallel.hf_plan is None:
        return [], []
    layout = info.own_layout
    rules, lost = hf_rules(_declared_splits(info), layout.first[0] if layout.first else "",
                           layout.last[-1] if layout.last else "", layout.blocks, spec.model.family, dict(info.config),
                           spec.tensor_parallel.hf_plan)
    # HF's plan names the modules of every config of the class (a MoE layer's router, dense layers
    # the config has none of); what this model lacks, it skips, as HF does
    modules = [p for p in info.modules if p]
    return [r for r in rules if match(r.pattern, modules)], lost


def untraced(spec: Spec, info: ModelInfo | None) -> bool:
    """Whether the class runs its own forward and its trace failed (E0424)."""
    layout = getattr(info, "own_layout", None) if _applies(spec, info) else None
    return _applies(spec, info) and (layout is None or layout.refusal == "untraceable")


def check_own(spec: Spec, info: ModelInfo | None) -> Iterator[Diagnostic]:
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
        what = "cannot make its decoder's input" if layout.refusal == "decoder_inputs" else \
            "cannot be cut into pipeline stages"
        yield error(code, at, f"{info.class_name} {what}: {layout.reason}", hint=hint)
        return
    pp = spec.mesh.pp
    if layout.uncuttable and not (isinstance(pp, Expr) and pp.is_Integer and int(pp) == 1):
        code, hint = _REFUSALS["cross_block_state"]
        yield error(code, spec.span("mesh.pp") or at, f"{info.class_name} cannot be cut into pipeline stages: "
                    f"{layout.uncuttable}", hint=f"at pp = 1 it runs whole; {hint}")
        return
    # under tp, a rank's share of what the boundaries carry is proven at local shapes (own_tp_proof)
    if any(layout.carried) and not is_one(pp) and not is_one(spec.mesh.cp):
        yield carried_refusal(info.class_name, spec.span("mesh.cp") or at,
                              f"{_carried_text(layout)}: context parallelism does not split it", "set cp = 1, or pp = 1")
        return
    if layout.idle:
        why = f" (its image path cannot run: {layout.image_refused})" if layout.image_refused else ""
        yield warning("W0437", at, f"{info.class_name}'s forward never runs {_listed(layout.idle)} on the inputs ppdsl "
                      f"feeds it ({layout.inputs}{why}): the last stage holds them, and they are not trained",
                      hint="expected for an audio-text model, or an image-text model whose image path ppdsl cannot "
                           "trace, trained on text alone; an image-text model such as LLaVA gets its images")
    hf_at = spec.tensor_parallel.hf_plan
    if hf_at is not None:
        if not _declared_splits(info):
            yield no_plan(info.class_name, hf_at)
        else:
            lost = _declared_rules(spec, info)[1]
            if lost:
                yield lost_entries(info.class_name, lost, hf_at)
    yield from _tensor_parallel(spec, info)


def carried_refusal(class_name: str, at: Any, problem: str, hint: str, label: str = "") -> Diagnostic:
    """E0420 for what a stage boundary carries besides the hidden state (`OwnLayout.carried`),
    which the mesh would split: here for cp, in dsl/own_tp_proof.py for a rank's share under tp."""
    return error(_REFUSALS["cross_block_state"][0], at, f"{class_name}'s stage boundaries carry, besides the hidden "
                 f"state, what a block reads of the block before it: {problem}", label=label, hint=hint)


def is_one(size: Any) -> bool:
    """A mesh size that is 1 whatever the world size."""
    return isinstance(size, Expr) and size.is_Integer and int(size) == 1


def _carried_text(layout: Any) -> str:
    """What the boundaries carry besides the hidden state: "output 1 of each block, (4, seq, seq)
    per sample" (T5's position bias)."""
    first = next(c for c in layout.carried if c)
    return ", ".join(f"output {j} of the block, of shape ({', '.join('seq' if d == -1 else str(d) for d in dims)}) "
                     "per sample" for j, dims in first)


def _listed(paths: tuple[str, ...], most: int = 4) -> str:
    shown = ", ".join(f"'{p}'" for p in paths[:most])
    return shown + (f" and {len(paths) - most} more" if len(paths) > most else "")


def _tensor_parallel(spec: Spec, info: ModelInfo | None) -> Iterator[Diagnostic]:
    """E0423: what tensor parallelism of the own forward does not run yet. The rest of the split
    is check's usual rules on the built model, and the meta run at local shapes (E0426)."""
    tp = spec.mesh.tp
    if isinstance(tp, Expr) and tp.is_Integer and int(tp) == 1:
        return
    at = spec.span("mesh.tp") or spec.span("mesh") or spec.span("model.source")
    if not (isinstance(tp, Expr) and tp.is_Integer):
        yield error("E0423", at, f"{info.class_name} runs its own forward, whose split ppdsl proves at a known tp only "
                    "(its local shapes run on meta before launch)", hint="write tp as a number")
        return
    tp_spec = spec.tensor_parallel
    if tp_spec.hf_plan is not None:  # the declared rules were not there when the spec's rules were decided
        declared = tuple(r for r in tp_spec.rules if r.span is tp_spec.hf_plan)
        only = attrs.evolve(spec, tensor_parallel=attrs.evolve(tp_spec, rules=declared))
        failed = [c.diagnostic(None) for c in tp_split_rules(only) if not c.holds()]
        yield from failed
        if failed:
            return
    if spec.tensor_parallel.sequence_parallel:
        why = _no_sequence_parallel(spec, info)
        if why is not None:
            yield error("E0423", spec.span("tensor_parallel.sequence_parallel") or at,
                        f"{info.class_name} runs its own forward, which ppdsl splits along the sequence only between "
                        f"the blocks of one stack fed token ids: {why}", hint="set sequence_parallel = false")


def _no_sequence_parallel(spec: Spec, info: ModelInfo | None) -> str | None:
    """Why sequence parallelism of the own forward does not run for ``spec``'s model (None: it runs,
    and the meta run at one rank's shapes proves it, dsl/own_tp_proof.py)."""
    from ppdsl.core.model_inputs import DECODER_KINDS, TOKENS

    layout = info.own_layout
    if layout.inputs != TOKENS:
        kind = "an encoder-decoder" if layout.inputs in DECODER_KINDS else f"fed {layout.inputs}"
        return f"it is {kind}"
    if not is_one(spec.mesh.pp) and any(layout.carried):
        return f"its stage boundaries carry {_carried_text(layout)} besides the hidden state"
    tp = int(spec.mesh.tp)
    from .kv_parts import kv_parts

    modules = [p for p in info.modules if p]
    for rule in spec.tensor_parallel.rules:
        for path in match(rule.pattern, modules):
            if kv_parts(spec, info, path, rule, tp):
                return (f"'{path}' holds fewer key/value heads than tp = {tp}, each replicated on several ranks, "
                        "which sequence parallelism does not gather")
    return None


def layout_mismatch(spec: Spec, info: ModelInfo | None) -> tuple[str, str, str] | None:
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
