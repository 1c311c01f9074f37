"""Model-level checks: the spec against the real module tree (built on the meta device)."""

from __future__ import annotations

import difflib
import re
from collections import defaultdict
from typing import TYPE_CHECKING, Any, Iterator

from .blocks import block_count, range_problems
from .diagnostics import Diagnostic, error, warning
from .exact import Expr
from .forward_check import check_forward
from .own_check import check_own, layout_mismatch, untraced
from .families import HF_ATTENTION_CLASSES, by_name, fused_parts, run_refusal
from .kv_parts import kv_parts, unequal_parts
from .patterns import block_index, match
from .rules import experts_per_rank, splits_the_head, vocab_rows
from .spec import Spec
from .tp_pairing import check_pairing, check_pairing_per_block
from ppdsl.core.families.descriptor import DIM_ALIASES
from ppdsl.core.module_paths import above
from ppdsl.core.phrasing import not_divisible_by_tp

if TYPE_CHECKING:
    from ppdsl.dsl.introspect import ModelInfo


def _int(v: object) -> int | None:
    return int(v) if isinstance(v, Expr) and v.is_Integer else None


def _near(path: str, modules: list[str]) -> str:
    close = difflib.get_close_matches(path, modules, n=1, cutoff=0.5)
    return f"did you mean '{close[0]}'?" if close else ""


def check_model(spec: Spec, info: ModelInfo | None) -> Iterator[Diagnostic]:
    """`info` is a ppdsl.dsl.introspect.ModelInfo."""
    yield from _experts(spec, info)
    yield from _context(spec, info)
    from .packing_check import check_packing_model  # E0472: packing = documents

    yield from check_packing_model(spec, info)
    forward = list(check_forward(spec, info))  # a forward that fails on meta on a shape (E0428)
    own = list(check_own(spec, info))  # a class running its own forward: what its trace refuses
    if forward and untraced(spec, info):  # the own forward's trace failed the same way: the config at fault
        own = forward
    if spec.model.dims.get("layers") == 0 and untraced(spec, info):
        return  # no blocks to find: E0308 says so at the config's layer count
    yield from own
    if any(d.is_error for d in own):
        return
    yield from forward
    modules = [p for p in info.modules if p]
    p = spec.pipeline
    blocks_span = spec.span("pipeline.blocks") or spec.span("pipeline") or spec.span("model")
    mismatch = layout_mismatch(spec, info)
    if mismatch is not None:
        key, message, hint = mismatch
        yield error("E0402", spec.span(f"pipeline.{key}") or spec.span("pipeline") or spec.span("model.source"),
                    message, hint=hint)
        return
    if p.blocks not in info.modules:
        yield error("E0402", blocks_span, f"the model has no module '{p.blocks}' to cut into stages",
                    hint=_near(p.blocks, modules) or "blocks names the repeated layer list, e.g. transformer.h")
        return
    n_blocks = block_count(p.blocks, spec.model.dims, info)
    assert n_blocks is not None  # the model has the module
    if n_blocks == 0:
        if info.modules[p.blocks].type_name == "ModuleList" and spec.model.dims.get("layers") == 0:
            return  # an empty layer list of a config with 0 layers: E0308 says so at the config
        yield error("E0402", blocks_span, f"'{p.blocks}' is not a list of layers", label=info.modules[p.blocks].type_name)
        return
    for key, paths in (("first", p.first), ("last", p.last)):
        for path in paths:
            if path not in info.modules:
                yield error("E0402", spec.span(f"pipeline.{key}") or blocks_span, f"the model has no module '{path}'",
                            hint=_near(path, modules))
    dropped = list(_coverage(spec, info, n_blocks))  # a module no stage holds says more than the layout
    yield from dropped
    family = by_name(spec.model.family)
    problem = family.layout_problem(p.blocks, p.first, p.last)
    if not dropped and problem is not None and run_refusal(spec.model.source.kind, family.name, info.class_name) is None:
        yield error("E0402", spec.span("pipeline.first") or spec.span("pipeline.last") or blocks_span, problem,
                    hint=f"leave blocks / first / last out: the defaults are {family.name}'s "
                         f"({family.blocks}; {', '.join(family.first)}; {', '.join(family.last)})")
        return
    yield from _stage_count(spec, n_blocks)
    yield from _hidden(spec, info)
    yield from _tp(spec, info, modules)
    yield from _zero3(spec, info)


def _zero3(spec: Spec, info: ModelInfo | None) -> Iterator[Diagnostic]:
    """E0409: FSDP2 shards every parameter along its first dimension, so a 0-dim one cannot
    be sharded (fully_shard refuses it)."""
    if spec.train.zero != 3 or _int(spec.mesh.dp) == 1:
        return
    chunks = _int(spec.pipeline.chunks)
    if spec.pipeline.shared and (chunks is None or chunks > 1):
        yield error("E0427", spec.span("train.zero"),
                    f"zero = 3 with '{spec.pipeline.shared[0]}', which every stage holds, and "
                    f"{'several stages' if chunks else 'maybe several stages'} per rank (chunks = {spec.pipeline.chunks}): "
                    "FSDP2 would shard the one module two stages of a rank share under both",
                    label="FSDP2 (fully_shard)",
                    hint="use chunks = 1 (one stage per rank), or zero = 1")
    scalars = [f"{path}.{name}" if path else name for path, m in info.modules.items() for name in m.scalar_params]
    if not scalars:
        return
    what = (f"'{scalars[0]}' is a scalar (0-dim) parameter" if len(scalars) == 1 else
            f"'{scalars[0]}' and {len(scalars) - 1} more are scalar (0-dim) parameters")
    yield error("E0409", spec.span("train.zero"),
                f"zero = 3 shards every parameter along its first dimension over dp, but {what}, which FSDP2 "
                "cannot shard",
                label="FSDP2 (fully_shard)",
                hint="use zero = 1 (the optimizer state sharded), or make the parameter a 1-element tensor "
                     "(shape [1]) in the model")


def _coverage(spec: Spec, info: ModelInfo | None, n_blocks: int) -> Iterator[Diagnostic]:
    """Every module holding parameters must be on some stage: nothing is silently dropped."""
    p = spec.pipeline
    held = (p.blocks, *p.first, *p.last, *p.shared)
    order = list(info.modules)
    blocks_at = order.index(p.blocks)
    layout = getattr(info, "own_layout", None)
    traced = layout is not None and layout.ok
    split = above(p.blocks)  # split across the stages: the first holds their own parameters
    for path in split:
        m = info.modules.get(path)
        late = next((x for x in layout.above_late if x.rpartition(".")[0] == path), "") if traced else ""
        if m is None or not m.num_params or (traced and not late):
            continue
        # the first stage holds them (runtime/stage/split.py) where the trace proves the forward
        # reads them before the blocks only (Blip2's query_tokens, LLaVA-NeXT's image_newline)
        why = (f"its forward reads '{late}' once the blocks have begun, but the first stage holds them" if traced
               else "no trace of its forward shows they are read before the blocks only, where the first stage "
                    "would hold them")
        where = f"module '{path}'" if path else f"the model root ({m.type_name})"
        yield error("E0404", spec.span("model.source") or spec.span("model"),
                    f"{where} holds {m.num_params} parameters of its own, above the blocks its submodules split "
                    f"into: {why}",
                    hint="move those parameters into a submodule (e.g. an nn.Embedding or a small nn.Module) and list "
                         "it in pipeline.first or pipeline.last")
    for path, m in info.modules.items():
        if path in split or m.num_params == 0:
            continue
        if any(path == h or path.startswith(h + ".") for h in held):
            continue
        key = "first" if order.index(path) < blocks_at else "last"
        yield error("E0404", spec.spans.get(f"pipeline.{key}") or spec.span("pipeline") or spec.span("model"),
                    f"module '{path}' holds {m.num_params} parameters but no stage holds it",
                    hint=f"add it to pipeline.{key} (Megatron-LM #468/#1304: layers silently dropped)")
        return


def _experts(spec: Spec, info: ModelInfo | None) -> Iterator[Diagnostic]:
    """ep > 1 needs experts modules (ppdsl.core.experts) whose counts ep divides."""
    ep = _int(spec.mesh.ep)
    if ep is None or ep <= 1:
        return
    counts = sorted({m.experts for m in info.modules.values() if m.experts})
    if not counts:
        yield error("E0242", spec.span("mesh.ep"),
                    f"ep = {ep}, but {info.class_name} has no experts: it is a dense model",
                    label="expert parallelism divides a mixture-of-experts layer's experts",
                    hint="set ep = 1 (or drop it): a dense model has no experts to divide")
        return
    if "experts" in spec.model.dims:
        return  # the config's count was checked (rules.py)
    for n in counts:
        rule = experts_per_rank(spec, n)
        if not rule.holds():
            yield rule.diagnostic(None)


def _context(spec: Spec, info: ModelInfo | None) -> Iterator[Diagnostic]:
    """E0246: cp > 1 needs a causal LM whose every block attends through transformers' attention
    interface (which the runtime points at its all-gather attention) without a sliding window, and
    whose stages give the blocks the tokens' global positions."""
    cp = _int(spec.mesh.cp)
    if cp is None or cp <= 1:
        return
    why = context_refusal(spec, info)
    if why is not None:
        yield error("E0246", spec.span("mesh.cp"), f"cp = {cp} cannot split {info.class_name}: {why}",
                    label="context parallelism splits each sequence over cp ranks",
                    hint="set cp = 1 (context parallelism supports causal decoders whose attention goes through "
                         "transformers' attention interface, full causal masks, no padding)")


def context_refusal(spec: Spec, info: ModelInfo | None) -> str | None:
    """Why context parallelism cannot run this model, or None (the probe: dsl/attention_probe.py)."""
    family = by_name(spec.model.family)
    if spec.model.source.kind == "python" or family.task != "causal_lm":
        return "it splits the sequences of causal language models only" + (
            "; a sequence classifier pools one token of the whole sequence" if family.task != "causal_lm" else "")
    probe = info.attention
    if probe is None:
        return f"its forward could not be run through the probe attention ({info.attention_error or 'not traced'})"
    if family.layout_from_trace:
        if not probe.takes_position_ids:
            return "its forward takes no position_ids, so a rank's tokens would lose their global positions"
    elif not family.positions_from_microbatch:
        return f"ppdsl's {family.name} stages do not pass the tokens' positions to the blocks"
    if not probe.calls:
        return "its attention does not go through transformers' attention interface (config._attn_implementation)"
    blocks = spec.pipeline.blocks or getattr(info.own_layout, "blocks", "")
    n = sum(1 for c in info.modules[blocks].children if c.isdigit()) if blocks in info.modules else 0
    missing = [i for i in range(n) if not any(c.module.startswith(f"{blocks}.{i}.") for c in probe.calls)]
    if missing:
        return (f"block {blocks}.{missing[0]} computes its attention outside transformers' attention interface, "
                "where it would see only its rank's tokens")
    for call in probe.calls:
        if not call.causal:
            return f"{call.module} attends in both directions (context parallelism splits causal attention)"
        seq = spec.train.seq_len if isinstance(spec.train.seq_len, int) else _int(spec.train.seq_len)
        if call.sliding_window is not None and (seq is None or call.sliding_window < seq):
            return (f"{call.module} uses a sliding window of {call.sliding_window} tokens, shorter than seq_len = "
                    f"{spec.train.seq_len} (only full causal attention)")
        if not call.same_length:
            return f"{call.module} attends to another sequence than its own (cross attention or a cache)"
    return None


def _stage_count(spec: Spec, n_blocks: int) -> Iterator[Diagnostic]:
    p = spec.pipeline
    dims_layers = spec.model.dims.get("layers")
    if dims_layers is not None and dims_layers != n_blocks:
        yield warning("W0403", spec.span("model"), f"the config says {dims_layers} layers but '{p.blocks}' has {n_blocks}")
    if p.split is not None:  # without them, E0308 is a rule decided on these n_blocks (dsl/check.py)
        yield from check_split(spec, n_blocks)


def _hidden(spec: Spec, info: ModelInfo) -> Iterator[Diagnostic]:
    """E0481: the stages send, and the step's FLOPs count, the hidden state at the width lowering
    gives the plan (`ppdsl.core.hidden_width`, the one rule); refused here when nothing tells it."""
    from ppdsl.core.hidden_width import hidden_width

    first = info.modules.get(spec.pipeline.first[0]) if spec.pipeline.first else None
    traced = getattr(info.own_layout, "width", None) if info.own_layout is not None else None
    if hidden_width(traced, spec.model.dims.get("hidden"), info.config,
                    first.embedding_dim if first is not None and first.kind == "embedding" else None) is None:
        what = f"'{spec.pipeline.first[0]}' is not an embedding" if first is not None else "no module runs before the blocks"
        yield error("E0481", spec.span("model.source") or spec.span("model"),
                    f"cannot tell the width of the hidden state the blocks pass on: the config has no hidden size "
                    f"({', '.join(DIM_ALIASES['hidden'])}) and {what}",
                    hint=f"write the width in `config {{ }}` under one of {', '.join(DIM_ALIASES['hidden'])} (for a python "
                         "factory, an argument of that name), or make the first module an nn.Embedding")


def check_split(spec: Spec, n_blocks: int) -> Iterator[Diagnostic]:
    """Explicit ranges cover [0, n_blocks) exactly once, in order, none empty (dsl/blocks.py's
    rule, which lowering holds too)."""
    split = spec.pipeline.split
    assert split is not None
    for problem in range_problems(split, n_blocks):
        span = spec.span("pipeline.split" if problem.index is None else f"pipeline.split.{problem.index}")
        yield error(problem.code, span, problem.message, hint=problem.hint)


def _tp(spec: Spec, info: ModelInfo | None, modules: list[str]) -> Iterator[Diagnostic]:
    tp = _int(spec.mesh.tp)
    effective: dict[str, Any] = {}  # module path -> the rule that decides its split (the last one, as lowering)
    columns: dict[int, list[str]] = defaultdict(list)  # block -> its column-split module paths
    gathering: list[Any] = []  # column rules with gather_output inside the blocks
    misplaced = False  # a rule that names nothing, or the wrong kind of module: pairing is moot
    shape_errors: set[int] = set()  # rules already reported for a size problem
    for rule in spec.tensor_parallel.rules:
        paths = match(rule.pattern, modules)
        if not paths:
            near = _near(rule.text.replace("[*]", ".0"), modules)
            if near and "[*]" in rule.text:
                near = re.sub(r"\.0(?=\.|'|$)", "[*]", near, count=rule.text.count("[*]"))
            yield error("E0402", rule.span, f"'{rule.text}' matches no module of the model", hint=near)
            misplaced = True
            continue
        reported = False
        for path in paths:
            effective[path] = rule
            m = info.modules[path]
            d = None if reported else _split_problem(rule, m, tp)
            parts = kv_parts(spec, info, path, rule, tp)
            if d is not None and d[0] in ("E0209", "E0211") and parts:
                d = None  # divided part by part (column_parts judged the sizes; kv heads replicated)
            if d is not None and d[0] == "E0209" and splits_the_head(rule, spec.model.dims):
                d = None  # the head rule (E0208) says it, at the same rule

            if d is not None:
                yield error(d[0], rule.span, f"{path}: {d[1]}", hint=d[2])
                reported = True
                shape_errors.add(id(rule))
                misplaced = misplaced or d[0] == "E0405"
            bi = block_index(path, spec.pipeline.blocks)
            splits = rule.style in ("column", "row") and (tp is None or tp > 1)
            refusal = _split_refusal(spec, path, bi) if splits and bi is not None and not reported and not parts \
                else None
            if refusal is not None:
                yield error("E0407", rule.span, f"{path}: {spec.model.family} models cannot split this module with "
                            f"{', '.join(f'{k} = {_dsl(v)}' for k, v in refusal.when.items())}: {refusal.why}")
                reported = True
    if misplaced:
        return
    for path, rule in effective.items():  # what the runtime applies: the last rule naming a module
        bi = block_index(path, spec.pipeline.blocks)
        if bi is not None and rule.style == "column":
            if rule.gather_output:
                if rule not in gathering:
                    gathering.append(rule)
            else:
                columns[bi].append(path)
    if spec.tensor_parallel.sequence_parallel and (tp is None or tp > 1):
        yield from _sequence_parallel(spec, info, columns, gathering,
                                      {p for p, r in effective.items() if r.style != "replicate"})
    if info.dataflow is None:
        yield from check_pairing_per_block(spec, info, effective)
    else:
        replicated = frozenset(path for path, rule in effective.items()
                               if (parts := kv_parts(spec, info, path, rule, tp)) and all(h == 1 for _, h in parts))
        yield from check_pairing(effective, info.dataflow, shape_errors, replicated)
    yield from _fused(spec, info, effective, shape_errors)
    yield from _unequal_parts(spec, info, effective, tp)
    yield from _tied(info, effective)


def _sequence_parallel(spec: Spec, info: ModelInfo | None, columns: dict[int, list[str]], gathering: list[Any],
                       split: set[str]) -> Iterator[Diagnostic]:
    """With sequence parallelism a block holds 1/tp of the tokens between its split layers:
    whatever mixes tokens (attention) must sit behind a column split, which gathers them, and what
    runs on the rank's part of the sequence must treat each position alone
    (`ppdsl.core.sequence_regions`, the rule the runtime applies)."""
    from ppdsl.core.sequence_regions import gathered_regions, unproven_positions

    sp_span = spec.span("tensor_parallel.sequence_parallel") or spec.span("tensor_parallel")
    for rule in gathering[:1]:
        yield error("E0218", rule.span or sp_span,
                    f"'{rule.text}' gathers its output, which sequence parallelism cannot split back over tp",
                    hint="pair the column split with a row split in the same block, or set sequence_parallel = false")
    blocks = spec.pipeline.blocks

    def children_of(path: str) -> tuple[str, ...]:
        m = info.modules.get(path)
        return tuple(f"{path}.{c}" for c in m.children) if m is not None else ()

    def kind_of(path: str) -> str:
        m = info.modules[path]
        if m.position_wise or m.experts or any(info.modules[c].experts for c in children_of(path)):
            return "position_wise"  # a mixture of experts routes each token on its own (ppdsl.core.experts)
        return "container" if m.kind == "container" else "other"

    for bi in range(block_count(blocks, spec.model.dims, info) or 0):
        prefix = f"{blocks}.{bi}"
        if not columns.get(bi):
            yield error("E0215", sp_span, f"sequence_parallel: block {bi} ('{prefix}') has no column split, so its "
                        "attention would see only 1/tp of the sequence",
                        hint="split every block's attention and MLP (column + row), or set sequence_parallel = false")
            return
        for path, m in info.modules.items():
            if not path.startswith(prefix + ".") or m.type_name not in HF_ATTENTION_CLASSES:
                continue
            if not any(c.startswith(path + ".") for c in columns[bi]):
                yield error("E0215", sp_span, f"sequence_parallel: the attention '{path}' is not split over tp, so "
                            "it would see only 1/tp of the sequence",
                            hint="split its projections (column + row), or set sequence_parallel = false")
                return
        regions = gathered_regions(prefix, children_of, set(columns[bi]), split)
        unproven = unproven_positions(prefix, children_of, kind_of, set(regions), split)
        if unproven is not None:
            yield error("E0215", sp_span, f"sequence_parallel: '{unproven}' ({info.modules[unproven].type_name}) is "
                        "not split over tp, so it would run on 1/tp of the sequence, and ppdsl knows only linear "
                        "layers, norms over the features, dropouts and activations to treat each position alone",
                        hint="split it (a column split entering it, a row split leaving it), or set "
                             "sequence_parallel = false")
            return


def _split_refusal(spec: Spec, path: str, block: int) -> Any:
    """The family's refusal of splitting this module under the model's config, if any."""
    relative = path[len(f"{spec.pipeline.blocks}.{block}."):]
    for refusal in by_name(spec.model.family).split_refusals:
        if refusal.path == relative and refusal.applies(spec.model.resolved_config):
            return refusal
    return None


def _dsl(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else repr(value)


def _split_problem(rule: Any, m: Any, tp: int | None) -> tuple[str, str, str] | None:
    if rule.style == "replicate":
        return None
    if rule.style in ("column", "row") and m.kind not in ("linear", "conv1d"):
        return ("E0405", f"a {m.type_name} is not a linear layer: it cannot be split by {rule.style}",
                "column and row apply to nn.Linear and GPT-2 Conv1D")
    if rule.style == "vocab" and m.kind != "embedding":
        return ("E0405", f"a {m.type_name} is not an embedding: it cannot be split by vocab", "vocab applies to nn.Embedding")
    if tp is None or tp <= 1:
        return None
    if rule.style == "column":
        out = m.out_features
        if out % rule.fused:
            return ("E0211", f"out_features = {out} does not split into {rule.fused} fused parts",
                    f"fused = {rule.fused} needs out_features to be a multiple of {rule.fused}: equal parts such as q, k, v")
        part = out // rule.fused
        if part % tp:
            what = f"each of its {rule.fused} fused parts ({part})" if rule.fused > 1 else f"out_features = {out}"
            return ("E0211" if rule.fused > 1 else "E0209", not_divisible_by_tp(what, tp),
                    "choose tp dividing the output size")
    if rule.style == "row" and m.in_features % tp:
        return ("E0210", not_divisible_by_tp(f"in_features = {m.in_features}", tp), "choose tp dividing the input size")
    if rule.style == "vocab":
        rows = vocab_rows(rule, m.num_embeddings, tp)
        if not rows.holds():
            d = rows.diagnostic(None)
            return (d.code, d.message, d.hint)
    return None


def _fused(spec: Spec, info: ModelInfo | None, effective: dict[str, Any], shape_errors: set[int]) -> Iterator[Diagnostic]:
    """`column(fused = k)` exactly where the forward splits the output into k equal parts."""
    flow = info.dataflow
    reported: set[int] = set()
    for path, rule in effective.items():
        if rule.style != "column" or id(rule) in reported or id(rule) in shape_errors:
            continue
        bi = block_index(path, spec.pipeline.blocks)
        rel = path.split(".", len(spec.pipeline.blocks.split(".")) + 1)[-1] if bi is not None else ""
        known = fused_parts(spec.model.family, rel) if bi is not None else 1
        if flow is not None:
            # the trace sees split/chunk; a forward that slices the output (Phi-3's qkv[..., :q])
            # is known to the family
            parts = flow.fused_parts.get(path, 1)
            if parts == 1:
                parts = known
        else:
            parts = known
            if parts == 1:
                continue  # unknown: only a known fused projection can be judged without a trace
        if parts == rule.fused or (rule.gather_output and rule.fused == 1):
            continue  # a plain gathered column's output is the whole one, in the forward's order
        if by_name(spec.model.family).layout_from_trace and unequal_parts(info, path):
            continue  # judged by _unequal_parts
        reported.add(id(rule))
        if parts > 1:
            yield error("E0221", rule.span, f"{path}: the forward splits this output into {parts} equal parts "
                        f"(such as q, k, v), but the column split {'has' if rule.fused > 1 else 'has no'} "
                        f"fused = {parts}{'' if rule.fused == 1 else f' (it says {rule.fused})'}: each rank would hold "
                        "the wrong columns of each part",
                        hint=f"write {rule.text} : column(fused = {parts}"
                             f"{', gather_output = true' if rule.gather_output else ''})")
        else:
            yield error("E0221", rule.span, f"{path}: fused = {rule.fused} splits the output as {rule.fused} "
                        "stacked parts, but the forward uses it as one tensor: each rank would hold columns "
                        "from every part",
                        hint=f"fused is for projections that compute several tensors at once (GPT-2's c_attn: "
                             f"q, k, v); write {rule.text} : column")


def _unequal_parts(spec: Spec, info: ModelInfo | None, effective: dict[str, Any], tp: int | None) -> Iterator[Diagnostic]:
    """The own forward splits some column outputs into unequal parts (q | k | v of a multi-query
    attention): the split says so (``fused`` = their number) and each part divides over tp, or
    holds fewer heads than tp dividing it (each head then replicated: dsl/kv_parts.py)."""
    if not by_name(spec.model.family).layout_from_trace:
        return
    reported: set[int] = set()
    for path, rule in effective.items():
        widths = unequal_parts(info, path)
        if rule.style != "column" or not widths or id(rule) in reported or (rule.gather_output and rule.fused == 1):
            continue
        shown = ", ".join(map(str, widths))
        if rule.fused != len(widths) or rule.gather_output:
            reported.add(id(rule))
            yield error("E0221", rule.span, f"{path}: the forward splits this output into {len(widths)} parts of "
                        f"widths {shown} (such as q, k, v), but the column split "
                        f"{'gathers them' if rule.gather_output else f'has fused = {rule.fused}'}: each rank would "
                        "hold the wrong rows of each part",
                        hint=f"write {rule.text} : column(fused = {len(widths)})")
        elif tp is not None and not kv_parts(spec, info, path, rule, tp):
            reported.add(id(rule))
            yield error("E0221", rule.span, f"{path}: its output's parts of widths {shown} cannot each be split "
                        f"over tp = {tp}: a part must hold a multiple of tp heads, or fewer heads than tp dividing "
                        "it (each head then replicated)",
                        hint=f"choose tp dividing each part's heads, or leave it whole ({rule.text} : replicate)")


def _tied(info: ModelInfo | None, effective: dict[str, Any]) -> Iterator[Diagnostic]:
    """Tied parameters are one tensor: split both alike (vocab embedding + column head, neither
    padded), or neither."""
    for first, second in info.tied:
        a, b = first.rpartition(".")[0], second.rpartition(".")[0]
        ra, rb = effective.get(a), effective.get(b)
        sa = _tied_shape(ra)
        sb = _tied_shape(rb)
        if sa == sb:
            continue
        rule = max((r for r in (ra, rb) if r is not None),
                   key=lambda r: (r.span.line, r.span.column) if r.span else (0, 0))
        def what(path: str, r: Any) -> str:
            if r is None or r.style == "replicate":
                return f"{path} stays whole"
            pad = (f" (pad_to = {r.pad_to})" if r.pad_to else " (no pad_to)") if sa[0] == sb[0] else ""
            return f"'{r.text}' splits {path} by {r.style}{pad}"
        yield error("E0222", rule.span,
                    f"{first} and {second} are one tied parameter, but {what(a, ra)} while {what(b, rb)}",
                    hint="split the embedding by vocab (without pad_to) and the head by column, or split neither: "
                         "`column` takes no pad_to, so a tied pair needs a vocabulary tp divides")
        return


def _tied_shape(rule: Any) -> tuple[str, int | None]:
    """How a tied weight is sharded over its rows: ("whole", None) or ("rows", pad_to)."""
    if rule is None or rule.style == "replicate":
        return ("whole", None)
    if rule.style in ("vocab", "column"):
        return ("rows", rule.pad_to)
    return (rule.style, None)
