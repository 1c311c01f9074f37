"""The tensor_parallel block: the split rules written (`path : style(options)`), and with
``hf_plan = true`` the ones the HF class declares, as ppdsl rules."""

from __future__ import annotations

import attrs

from .. import ast, schema
from ppdsl.core.families.descriptor import HfSplit

from ..diagnostics import Diagnostic, error, warning
from ..families import fused_parts
from ..span import Span
from ..spec import PatternIndex, PatternSegment, TensorParallelSpec, TpRule
from .coerce import bool_value, call_args
from .scope import Scope, did_you_mean


def resolve_tensor_parallel(scope: Scope) -> TensorParallelSpec:
    block = scope.blocks.get("tensor_parallel")
    rules: list[TpRule] = []
    seq_par = False
    hf_at = None
    if block is not None:
        for entry in block.entries:
            if isinstance(entry, ast.TpRule):
                rule = _tp_rule(scope, entry)
                if rule is not None:
                    rules.append(rule)
        sp = scope.entries["tensor_parallel"].get("sequence_parallel")
        if sp is not None:
            seq_par = bool_value(scope, sp)
        hf = scope.entries["tensor_parallel"].get("hf_plan")
        if hf is not None and bool_value(scope, hf):
            hf_at = hf.span
            written = {r.text for r in rules}  # a rule written in the spec wins over HF's
            rules.extend(r for r in _hf_plan_rules(scope, hf) if r.text not in written)
    return TensorParallelSpec(tuple(rules), seq_par, hf_at)


def _hf_plan_rules(scope: Scope, assign: ast.Assign) -> list[TpRule]:
    """`hf_plan = true`: the split rules the HF class declares, as ppdsl rules (colwise ->
    column, rowwise -> row, embedding_rowwise -> vocab, colwise_gather_output ->
    column(gather_output = true)); entries with no ppdsl equivalent stay replicated (W0223)."""
    family, hf_class = scope.family, scope.hf_class
    if family is not None and family.layout_from_trace:
        # a class no family claims: its plan is read from the built model, with the traced layout
        # (dsl/own_check.py), which this step does not have
        return []
    splits = family.hf_splits(hf_class) if family is not None else None
    if not splits:
        scope.diags.append(no_plan(hf_class, assign.span))
        return []
    config = {**family.defaults(hf_class), **scope.config}
    rules, lost = hf_rules(splits, family.first[0], family.last[-1], family.blocks, family.name, config, assign.span)
    if lost:
        scope.diags.append(lost_entries(hf_class, lost, assign.span))
    return rules


def hf_rules(splits: tuple[HfSplit, ...], embedding: str, head: str, blocks: str, family: str,
             config: dict[str, object], span: Span | None) -> tuple[list[TpRule], list[HfSplit]]:
    """An HF plan's splits as ppdsl rules, and the entries that stay replicated (no ppdsl style).
    A head tied to an embedding HF keeps whole stays whole too."""
    if config.get("tie_word_embeddings") and not any(s.pattern == embedding and s.style for s in splits):
        # one tensor with the embedding, which HF's plan keeps whole: the head stays whole too
        splits = tuple(attrs.evolve(s, style=None, hf_style=f"{s.hf_style}, tied to the whole {embedding}")
                       if s.pattern == head else s for s in splits)
    out = []
    in_block = blocks + "[*]."
    for s in splits:
        if s.style is None:
            continue
        segs = tuple(PatternSegment(seg[:-3], PatternIndex("all")) if seg.endswith("[*]") else PatternSegment(seg)
                     for seg in s.pattern.split("."))
        # a fused projection (Phi-3's qkv_proj, gate_up_proj) splits each of its parts
        fused = fused_parts(family, s.pattern[len(in_block):]) \
            if s.style == "column" and s.pattern.startswith(in_block) else 1
        out.append(TpRule(segs, s.pattern, s.style, fused, s.gather_output, None, span))
    return out, [s for s in splits if s.style is None]


def no_plan(hf_class: str | None, span: Span | None) -> Diagnostic:
    """E0223: `hf_plan = true` for a class that declares no tp plan."""
    return error("E0223", span, f"hf_plan: {hf_class or 'the model'} declares no tensor-parallel plan",
                 hint="write the split rules (`path : column` ...) in tensor_parallel")


def lost_entries(hf_class: str | None, lost: list[HfSplit], span: Span | None) -> Diagnostic:
    """W0223: the plan's entries no ppdsl style expresses."""
    return warning(
        "W0223", span,
        f"hf_plan: {len(lost)} entr{'y' if len(lost) == 1 else 'ies'} of {hf_class}'s tensor-parallel plan "
        "cannot be expressed and stay replicated: " + ", ".join(f"{s.pattern} ({s.hf_style})" for s in lost),
        hint="write a rule for them yourself if a ppdsl split style fits")


def _tp_rule(scope: Scope, entry: ast.TpRule) -> TpRule | None:
    if entry.style not in schema.TP_STYLES:
        scope.unknown_choice(entry.style_span, f"unknown split style '{entry.style}'",
                  hint=did_you_mean(entry.style, schema.TP_STYLES) or f"styles: {', '.join(schema.TP_STYLES)}")
        return None
    opts = call_args(scope, entry.style, entry.args, entry.kwargs, schema.TP_STYLE_ARGS[entry.style], entry.style_span)
    if opts is None:
        return None
    segs = tuple(PatternSegment(s.name, None if s.index is None else PatternIndex(s.index.kind, s.index.start, s.index.stop))
                 for s in entry.pattern.segments)
    if opts.get("fused", 1) < 1:
        scope.bad_value(entry.span, "fused must be at least 1")
        return None
    if opts.get("pad_to") is not None and opts["pad_to"] < 1:
        scope.bad_value(entry.span, "pad_to must be at least 1")
        return None
    return TpRule(segs, entry.pattern.text, entry.style, opts.get("fused", 1), opts.get("gather_output", False),
                  opts.get("pad_to"), entry.span)
