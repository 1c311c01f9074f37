"""The spec's rules as symbolic constraints over the spec (and, when free, the world size).

Each rule yields `Constraint`s: an exact condition (ppdsl.dsl.exact.Cond) that must hold, the code, where it points, and
message/hint templates filled with the values involved once the world size is known.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping, Sequence

import attrs

from . import diagnostics as dg, exact
from .exact import Cond, Expr, as_expr
from .families import DIM_ALIASES, by_name
from .spec import WORLD, Spec, TpRule
from .span import Span
from .world import holds, value_at
from ppdsl.core.phrasing import not_divisible_by_tp
from ppdsl.core.schedules import STYLES as SCHEDULES
from ppdsl.core.schedules._common import CHUNKS


@attrs.frozen
class Constraint:
    code: str
    condition: Cond  # must be true
    span: Span | None
    message: str  # str.format template over `values` (and `world`)
    hint: str = ""
    label: str = ""
    values: Mapping[str, Expr] = attrs.field(factory=dict)
    summary: str = ""  # what the rule demands, for notes when the world is left free (E0601)
    hint_at_launch: bool = False  # at `ppdsl run` (a Launch), the hint is the command that starts a world that works

    @property
    def depends_on_world(self) -> bool:
        return WORLD in self.condition.free_symbols

    def holds(self) -> bool:
        """Decide a rule over known numbers (model_check's, with the model's sizes)."""
        return holds(self.condition, None)

    def diagnostic(self, world: int | None) -> dg.Diagnostic:
        """This rule's failure at `world` (None: left free), its templates filled with the values."""
        values = {k: value_at(v, world) for k, v in self.values.items()}
        values["world"] = str(world) if world is not None else "world"
        fmt = lambda s: s.format(**values) if s else s  # noqa: E731
        return dg.diagnostic(self.code, self.span, fmt(self.message), label=fmt(self.label), hint=fmt(self.hint))


@attrs.frozen
class Launch:
    """How `ppdsl run` starts the world it checks: E0201's hint (and E0330's) then says the command
    that starts a world the spec splits into, at every node count of `nodes`."""

    spec: str  # the spec's path, as typed
    overrides: tuple[str, ...] = ()  # the --set options, as typed
    nodes: tuple[int, int] = (1, 1)  # --nnodes MIN:MAX

    def hint(self, valid: Sequence[int] | None, described: str | None, otherwise: str = "") -> str:
        """The command that starts such a world, given the world sizes the spec holds for (`valid`,
        `described`; None when no size does); else `otherwise` and why no --nproc works."""
        lo, hi = self.nodes
        nodes = str(lo) if lo == hi else f"{lo}:{hi}"
        sizes = set(valid or ())
        per_node = next((n for n in range(1, max(sizes, default=0) + 1) if all(k * n in sizes for k in range(lo, hi + 1))),
                        None)
        if per_node is None:
            return f"{otherwise}{'; ' if otherwise else ''}no --nproc makes every world of {nodes} node(s) " \
                   f"valid (valid world sizes: {described})" if described else otherwise
        sets = "".join(f" --set {o}" for o in self.overrides)
        node_flag = "" if self.nodes == (1, 1) else f" --nnodes {nodes}"
        rdzv = "" if self.nodes == (1, 1) else " --rdzv-backend c10d --rdzv-endpoint HOST:PORT"
        return (f"start {per_node} process(es) per node: `ppdsl run {self.spec}{sets}{node_flag} --nproc {per_node}"
                f"{rdzv}` or `torchrun{node_flag} --nproc_per_node {per_node}{rdzv} -m ppdsl run {self.spec}{sets}` "
                f"(valid world sizes: {described})")


def _c(code: str, cond: Cond, span: Span | None, message: str, hint: str = "", label: str = "",
       summary: str = "", hint_at_launch: bool = False, **values: object) -> Constraint:
    return Constraint(code, cond, span, message, hint, label, {k: as_expr(v) for k, v in values.items()}, summary,
                      hint_at_launch)


# Conditions are built unevaluated: world.compile_condition decides them exactly, for one world
# size or for thousands.
def _eq(a: object, b: object) -> Cond:
    return exact.relation("eq", as_expr(a), as_expr(b), evaluate=False)


def _ge(a: object, b: object) -> Cond:
    return exact.relation("ge", as_expr(a), as_expr(b), evaluate=False)


def _le(a: object, b: object) -> Cond:
    return exact.relation("le", as_expr(a), as_expr(b), evaluate=False)


def _gt(a: object, b: object) -> Cond:
    return exact.relation("gt", as_expr(a), as_expr(b), evaluate=False)


def _and(*conds: Cond) -> Cond:
    return exact.both(*conds, evaluate=False)


def _or(*conds: Cond) -> Cond:
    return exact.either(*conds, evaluate=False)


def _not(cond: Cond) -> Cond:
    return exact.negate(cond, evaluate=False)


def divides(b: object, a: object) -> Cond:
    return _eq(Expr.node("mod", as_expr(a), as_expr(b)), 0)


def is_whole(x: object) -> Cond:
    return _eq(Expr.node("mod", as_expr(x), exact.ONE), 0)


# E0315: why there is no ZeRO-2 under a pipeline (DeepSpeed refuses it with pipelines too)
ZERO2_HINT = ("ZeRO-2 keeps only gradient shards, which under a pipeline takes a reduce-scatter after every "
              "microbatch; use zero = 1 (optimizer state sharded, gradients reduce-scattered once per step) or "
              "zero = 3 (FSDP2: the weights sharded too)")


# Rules stated against the config here and against the built model by model_check: one function each.


def enough_blocks(spec: Spec, blocks: object) -> Constraint:
    """E0308: every virtual stage holds at least one of the `blocks`: the built model's block count
    (dsl/blocks.py, which lowering cuts), else the config's layer count."""
    stages = spec.mesh.pp * spec.pipeline.chunks
    keys = (*by_name(spec.model.family).config_keys.get("layers", ()), *DIM_ALIASES["layers"]) if spec.model else ()
    layers_key = next((k for k in keys if f"model.config.{k}" in spec.spans), None)
    at = (spec.spans.get("pipeline.chunks") or spec.span("mesh.pp")
          or (spec.spans[f"model.config.{layers_key}"] if layers_key else spec.span("model.config")))
    return _c("E0308", _ge(blocks, stages), at,
              "{layers} blocks cannot fill pp * chunks = {stages} stages: some stage would be empty",
              hint="lower pp or chunks, or use a model with more blocks (ColossalAI silently builds empty stages here)",
              layers=blocks, stages=stages)


def experts_per_rank(spec: Spec, experts: object) -> Constraint:
    """E0243: ep divides each MoE layer's `experts` (the config's count here, the experts modules'
    in model_check): every ep rank holds the same number of whole experts."""
    ep = spec.mesh.ep
    return _c("E0243", _or(_le(ep, 1), divides(ep, experts)), spec.span("mesh.ep") or spec.span("mesh"),
              "{experts} experts do not divide over ep = {ep} ranks: each rank holds experts / ep whole experts",
              hint="choose ep dividing the number of experts", label="ep = {ep}", experts=experts, ep=ep)


def vocab_rows(rule: TpRule, vocab: object, tp: object) -> Constraint:
    """E0203: `rule` (vocab, or column on the head) splits `vocab` rows, padded to its pad_to, over
    tp (the config's vocab_size here, the embedding's rows in model_check)."""
    vocab = as_expr(vocab)
    padded = vocab if rule.pad_to is None else exact.ceiling(vocab / rule.pad_to) * rule.pad_to
    hint = (f"use {rule.style}(pad_to = 64) (any multiple of tp) or set vocab_size to a multiple of tp"
            if rule.style == "vocab" else "set vocab_size to a multiple of tp")
    return _c("E0203", divides(tp, padded), rule.span,
              not_divisible_by_tp("vocab_size = {vocab}" + (" (padded to {padded})" if rule.pad_to else ""), "{tp}"),
              hint=hint, label="splits {padded} vocabulary rows over {tp} ranks", vocab=vocab, padded=padded, tp=tp)


def constraints(spec: Spec, blocks: int | None = None) -> Iterator[Constraint]:
    """`blocks`: the built model's block count (dsl/blocks.py), which the stages are cut from;
    None without the model (the config's layer count stands for it)."""
    yield from _mesh_rules(spec)
    yield from _expert_rules(spec)
    yield from _context_rules(spec)
    yield from _batch_rules(spec)
    yield from _schedule_rules(spec)
    yield from _stage_rules(spec, blocks)
    yield from _tp_rules(spec)
    yield from _train_rules(spec)
    yield from _exact_divisions(spec)
    yield from _requirements(spec)


def _mesh_rules(spec: Spec) -> Iterator[Constraint]:
    tp, pp, dp, cp = spec.mesh.tp, spec.mesh.pp, spec.mesh.dp, spec.mesh.cp
    sizes = (("tp", tp), ("pp", pp)) + ((("cp", cp),) if "mesh.cp" in spec.spans else ())
    for name, v in sizes:
        yield _c("E0202", _and(is_whole(v), _ge(v, 1)), spec.span(f"mesh.{name}"),
                 f"{name} = {{v}} is not a positive whole number", label=f"{name} must be 1, 2, 3, ...", v=v)
    # dp: the world must split into dp replicas of tp * pp (* cp) ranks
    what = "tp * pp * cp" if "mesh.cp" in spec.spans else "tp * pp"
    yield _c("E0201", _and(is_whole(dp), _ge(dp, 1), _eq(WORLD, tp * pp * cp * dp)),
             spec.span("mesh.dp") or spec.span("mesh") or spec.span("mesh.tp"),
             "world = {world} does not split into data-parallel replicas of " + what + " = {tppp} ranks",
             hint="launch a multiple of {tppp} processes", label="dp = {dp}",
             summary="the world must split into data-parallel replicas of " + what + " = {tppp} ranks (dp = {dp})",
             hint_at_launch=True, tppp=tp * pp * cp, dp=dp)


def _expert_rules(spec: Spec) -> Iterator[Constraint]:
    """ep borrows from dp: ep consecutive data-parallel ranks hold one copy of the experts, 1/ep
    each (the model-level rules, experts % ep and a model with experts, are model_check's)."""
    if "mesh.ep" not in spec.spans:
        return
    ep, dp = spec.mesh.ep, spec.mesh.dp
    span = spec.span("mesh.ep")
    yield _c("E0202", _and(is_whole(ep), _ge(ep, 1)), span, "ep = {v} is not a positive whole number",
             label="ep must be 1, 2, 3, ...", v=ep)
    yield _c("E0240", _or(_le(ep, 1), divides(ep, dp)), span,
             "ep = {ep} does not divide dp = {dp}: expert parallelism divides the experts over ep of the "
             "data-parallel ranks, so dp must be a multiple of ep",
             hint="launch a world whose dp is a multiple of ep (world = dp * pp * tp), or lower ep",
             label="borrows ep ranks from dp = {dp}", summary="dp = {dp} must be a multiple of ep = {ep}", ep=ep, dp=dp)
    experts = spec.model.dims.get("experts")
    if isinstance(experts, int) and experts > 0:
        yield experts_per_rank(spec, experts)
    # what the expert all-to-all has not been proven to compose with: refused, never run wrongly
    yield from _unproven_with("E0241", spec, "ep", ep, span, (
        "ZeRO shards gradients over all dp ranks, but expert gradients are summed over the ranks holding the same "
        "experts only",
        "sequence parallelism gives each tp rank other tokens, so the replicated experts' gradients would differ",
        "the experts' all-to-all"))


def _unproven_with(code: str, spec: Spec, axis: str, size: Expr, span: Span | None,
                   why: tuple[str, str, str]) -> Iterator[Constraint]:
    """`code` where `axis` > 1 meets ZeRO, sequence parallelism or a split-backward schedule (each
    `why`: ZeRO's, sequence parallelism's, and what the split backward would have to cross)."""
    style = spec.pipeline.style
    for key, on, reason, instead in (
        ("train.zero", spec.train.zero != 0, why[0], "zero = 0"),
        ("tensor_parallel.sequence_parallel", spec.tensor_parallel.sequence_parallel, why[1],
         "sequence_parallel = false"),
        ("pipeline.style", style in SCHEDULES and SCHEDULES[style].split_backward,
         f"{style} splits the backward in two, and {why[2]} has not been proven under it",
         "style = 1f1b (or interleaved)"),
    ):
        if on:
            yield _c(code, _le(size, 1), spec.span(key) or span,
                     f"{axis} = {{size}} cannot be combined with " + key.split(".")[1] + ": " + reason,
                     hint=f"set {axis} = 1, or {instead}", size=size)


def _context_rules(spec: Spec) -> Iterator[Constraint]:
    """cp is a world factor: the cp ranks of one replica split each of its sequences into 2 * cp
    chunks, two per rank (head-tail); what the attention needs of the model is model_check's."""
    if "mesh.cp" not in spec.spans:
        return
    cp, seq = spec.mesh.cp, spec.train.seq_len
    if seq is None:  # an image model's (dsl/input_check.py refuses cp for it), or unknown without the model
        return
    span = spec.span("mesh.cp")
    yield _c("E0245", _or(_le(cp, 1), divides(2 * cp, seq)), spec.span("train.seq_len") or span,
             "seq_len = {seq} does not split into 2 * cp = {chunks} equal chunks: context parallelism gives each of "
             "the cp ranks two chunks of every sequence (one near its start, one near its end)",
             hint="choose seq_len a multiple of 2 * cp, or another cp", label="cp = {cp} needs a multiple of {chunks}",
             summary="seq_len = {seq} must be a multiple of 2 * cp = {chunks}", seq=seq, chunks=2 * cp, cp=cp)
    yield from _unproven_with("E0244", spec, "cp", cp, span, (
        "ZeRO shards over the dp ranks only, while context-parallel gradients are averaged over dp * cp",
        "sequence parallelism splits the sequence over tp again, which the context-parallel attention does not gather",
        "the key/value all-gather"))
    if "mesh.ep" in spec.spans:
        yield _c("E0244", _or(_le(cp, 1), _le(spec.mesh.ep, 1)), spec.span("mesh.ep") or span,
                 "cp = {cp} cannot be combined with ep = {ep}: expert and context parallelism together have not "
                 "been proven", hint="set cp = 1 or ep = 1", cp=cp, ep=spec.mesh.ep)


def _batch_rules(spec: Spec) -> Iterator[Constraint]:
    p = spec.pipeline
    pp, dp = spec.mesh.pp, spec.mesh.dp
    gb = spec.train.global_batch
    given_m = "pipeline.microbatches" in spec.spans
    given_mbs = "pipeline.microbatch_size" in spec.spans
    if not (given_m or given_mbs):
        yield _c("E0301", _le(pp, 1), spec.span("pipeline") or spec.span("mesh.pp"),
                 "pp = {pp} needs microbatches: a pipeline with one microbatch runs one stage at a time",
                 hint="add `microbatches = N` (N >= pp) or `microbatch_size = B` to the pipeline block", pp=pp)
    sizes = {"microbatches": p.microbatches, "microbatch_size": p.microbatch_size}
    valid = {name: _and(is_whole(v), _ge(v, 1)) for name, v in sizes.items()}
    for name, v in sizes.items():
        other = "microbatch_size" if name == "microbatches" else "microbatches"
        if f"pipeline.{name}" in spec.spans:  # the value written: itself a positive whole number
            yield _c("E0302", valid[name], spec.span(f"pipeline.{name}"), f"{name} = {{v}} is not a positive whole number",
                     label=f"{name} must be 1, 2, 3, ...", summary=f"{name} = {{v}} must be a positive whole number", v=v)
            continue
        # the value derived from the batch; when derived from a bad written value, that one is reported
        cond = valid[name] if f"pipeline.{other}" not in spec.spans else _or(_not(valid[other]), valid[name])
        yield _c("E0302", cond, spec.span("train.global_batch"),
                 "global_batch = {gb} does not split into dp = {dp} replicas x {m} microbatches of {mbs} samples",
                 hint="global_batch must equal microbatch_size * microbatches * dp",
                 label=f"{name} = {{{'m' if name == 'microbatches' else 'mbs'}}}",
                 summary="global_batch = {gb} must split into dp = {dp} replicas x " +
                 ("microbatches of {mbs} samples" if name == "microbatches" and f"pipeline.{other}" in spec.spans else
                  "{m} microbatches"), gb=gb, dp=dp, m=p.microbatches, mbs=p.microbatch_size)
    if given_m and given_mbs:
        yield _c("E0302", _eq(gb, p.microbatch_size * p.microbatches * dp), spec.span("train.global_batch"),
                 "global_batch = {gb} but microbatch_size * microbatches * dp = {mbs} * {m} * {dp} = {prod}",
                 hint="give only one of microbatches and microbatch_size", gb=gb, mbs=p.microbatch_size,
                 m=p.microbatches, dp=dp, prod=p.microbatch_size * p.microbatches * dp)


def _schedule_rules(spec: Spec) -> Iterator[Constraint]:
    p = spec.pipeline
    pp, m, v = spec.mesh.pp, p.microbatches, p.chunks
    style_span = spec.span("pipeline.style")  # the style, or else the pipeline block
    given_m = spec.spans.get("pipeline.microbatches") or spec.spans.get("pipeline.microbatch_size")
    yield _c("E0202", _and(is_whole(v), _ge(v, 1)), spec.span("pipeline.chunks"),
             "chunks = {v} is not a positive whole number", label="chunks must be 1, 2, 3, ...", v=v)
    rule = CHUNKS.get(p.style)  # the style's chunk rule, as its generator states it
    if rule is not None and rule.most == 1:
        yield _c("E0303", _eq(v, 1), spec.span("pipeline.chunks"),
                 f"{p.style} runs one model chunk per rank, but chunks = {{v}}",
                 hint="use style = interleaved (or zbv for 2 chunks) to run several chunks", v=v)
    elif rule is not None and rule.most is None:
        yield _c("E0305", _ge(v, rule.least), spec.spans.get("pipeline.chunks") or style_span,
                 f"{p.style} needs chunks >= {rule.least}, got {{v}}",
                 hint=f"set chunks = {rule.least} or use style = 1f1b", v=v)
    elif rule is not None:
        yield _c("E0307", _eq(v, rule.least), spec.spans.get("pipeline.chunks") or style_span,
                 f"{p.style} places exactly {rule.least} chunks per rank in a V, got chunks = {{v}}",
                 hint=f"set chunks = {rule.least}", v=v)
    if spec.train.compile and p.style in SCHEDULES and SCHEDULES[p.style].split_backward:
        yield _c("E0332", _eq(0, 1), spec.span("train.compile"),
                 f"compile = true with style = {p.style}, which splits each backward into B (input gradients) and "
                 "W (weight gradients): a compiled block's backward computes both in one graph",
                 hint="style = 1f1b or interleaved with compile, or compile = false with this style")
    if p.style == "dualpipev":
        yield _c("E0304", _ge(m, 2 * pp), given_m or style_span,
                 "dualpipev needs microbatches >= 2 * pp = {n} (one per virtual stage), got {m}",
                 hint="set microbatches >= {n}, or use style = zbv", n=2 * pp, m=m)
    if p.style == "interleaved":
        yield _c("E0306", divides(pp, m), given_m or style_span,
                 "interleaved needs microbatches to be a multiple of pp = {pp}, got {m}",
                 hint="Megatron's interleaved 1F1B runs microbatches in groups of pp", pp=pp, m=m)


def _stage_rules(spec: Spec, blocks: int | None) -> Iterator[Constraint]:
    p = spec.pipeline
    layers = blocks if blocks is not None else spec.model.dims.get("layers")
    stages = spec.mesh.pp * p.chunks
    if p.split is None:
        if layers is not None:
            yield enough_blocks(spec, layers)
        return
    n = len(p.split)
    yield _c("E0310", _eq(n, stages), spec.span("pipeline.split"),
             "split lists {n} ranges but pp * chunks = {stages} virtual stages need one each",
             hint="give one range per virtual stage, in model order", n=n, stages=stages)


# module names that tell which dimension a split rule divides, to point a diagnostic at it
_DIM_HINTS = {
    "heads": ("attn", "attention", "self_attn", "query", "q_proj", "c_attn", "wq"),
    "kv_heads": ("k_proj", "v_proj", "key", "value", "wk", "wv"),
    "ffn": ("mlp", "feed_forward", "intermediate", "c_fc", "up_proj", "gate_proj", "w1"),
    "hidden": (),
}


def _rule_splitting(dim: str, splits: list) -> object:
    """The split rule that divides `dim` (for the caret), else the first split rule."""
    for rule in splits:
        names = {seg.name for seg in rule.pattern}
        if any(h in names for h in _DIM_HINTS[dim]):
            return rule
    if dim == "hidden":
        return next((r for r in splits if r.style == "row"), splits[0])
    return splits[0]


def splits_the_head(rule: TpRule, dims: Mapping[str, Any]) -> bool:
    """A column split of a classifier head (text or image: `classifier`, `score`), whose
    `num_labels` the head rule E0208 holds to tp (the Shardformer rule), not the layer's width."""
    return rule.style == "column" and rule.pattern[-1].name in ("classifier", "score") and "labels" in dims


def tp_split_rules(spec: Spec) -> Iterator[Constraint]:
    """The divisibility rules of the spec's split rules (heads, widths, vocabulary, labels)."""
    yield from _tp_rules(spec)


def _tp_rules(spec: Spec) -> Iterator[Constraint]:
    tp = spec.mesh.tp
    rules = spec.tensor_parallel.rules
    dims = spec.model.dims
    splits = [r for r in rules if r.style in ("column", "row")]
    if splits:
        family = by_name(spec.model.family)
        for dim, code, what in (("heads", "E0204", "attention heads"), ("kv_heads", "E0205", "key/value heads"),
                                ("ffn", "E0206", "feed-forward size"), ("hidden", "E0207", "hidden size")):
            if dim in dims:
                cond, hint = divides(tp, dims[dim]), f"choose tp dividing {{n}}, or change the model's {what}"
                if dim == "kv_heads" and (family.kv_projections or family.layout_from_trace) \
                        and not spec.tensor_parallel.sequence_parallel:  # or each kv head replicated
                    cond = _or(cond, divides(dims[dim], tp))
                    hint = "choose tp dividing {n} or a multiple of it (each key/value head is then replicated)"
                yield _c(code, cond, _rule_splitting(dim, splits).span,
                         not_divisible_by_tp(f"{what} = {{n}}", "{tp}"), hint=hint,
                         label=f"splits {what} over tp ranks", n=dims[dim], tp=tp)
    for r in rules:
        if r.style == "vocab" or (r.style == "column" and r.pattern[-1].name in ("lm_head", "output")):
            if "vocab" not in dims:
                continue
            yield vocab_rows(r, dims["vocab"], tp)
        if splits_the_head(r, dims):
            yield _c("E0208", divides(tp, dims["labels"]), r.span,
                     not_divisible_by_tp("num_labels = {n}", "{tp}") + ": the classifier cannot be split",
                     hint="keep the classifier whole (drop its split: it is tiny), or pad num_labels to a multiple of tp "
                          "(dummy labels)",
                     n=dims["labels"], tp=tp)
    if spec.tensor_parallel.sequence_parallel:
        yield _c("E0213", _gt(tp, 1), spec.span("tensor_parallel.sequence_parallel"),
                 "sequence_parallel needs tp > 1, but tp = {tp}", hint="set sequence_parallel = false", tp=tp)
        if spec.train.seq_len is None:  # not tokens (the own forward refuses sequence parallelism, E0423)
            return
        yield _c("E0214", divides(tp, spec.train.seq_len), spec.span("tensor_parallel.sequence_parallel"),
                 "sequence parallelism splits seq_len = {s} over tp = {tp} ranks", hint="make seq_len a multiple of tp",
                 s=spec.train.seq_len, tp=tp)


def _train_rules(spec: Spec) -> Iterator[Constraint]:
    t = spec.train
    zero_hint = (ZERO2_HINT if t.zero == 2 else
                 "0: replicas (gradients all-reduced); 1: optimizer state sharded over dp; "
                 "3: weights, gradients and optimizer state sharded over dp (FSDP2)")
    yield _c("E0315", exact.member(as_expr(t.zero), (0, 1, 3)), spec.span("train.zero"),
             "zero = {z} is not a ZeRO stage ppdsl runs: use 0, 1 or 3", hint=zero_hint, z=t.zero)
    positions = spec.model.dims.get("positions")
    if isinstance(positions, int) and t.seq_len is not None:
        yield _c("E0216", _le(t.seq_len, positions), spec.span("train.seq_len"),
                 "seq_len = {s} is longer than the model's {n} positions", hint="lower seq_len", s=t.seq_len, n=positions)


def _exact_divisions(spec: Spec) -> Iterator[Constraint]:
    for a, b, span in spec.exact_divisions:
        yield _c("E0110", is_whole(a / b), span, "{a} / {b} is not a whole number",
                 hint="`/` must divide exactly; use `//` to round down", a=a, b=b)


def _requirements(spec: Spec) -> Iterator[Constraint]:
    for req in spec.requires:
        msg = req.message or f"requirement `{req.text}` does not hold"
        yield _c("E0501", req.condition, req.span, msg.replace("{", "{{").replace("}", "}}"),
                 hint="" if req.message is None else f"the rule is `{req.text}`")
