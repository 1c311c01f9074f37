"""Check proves a tensor-parallel split of the own forward before launch (E0426).

A class no family claims brings no knowledge of which attributes its forward reads (head counts,
widths): the split is right when the forward runs on every rank's local shapes. The model is
built on meta, each split layer gets the weight shapes one rank holds (a column split 1/tp of its
outputs, a row split 1/tp of its inputs, a vocab split 1/tp of the rows; a gathered column stays
whole, as its output is; a column split divided part by part, dsl/kv_parts.py, the rows one rank
computes), and the whole forward then the task's loss run on meta. A forward that
reads a global head count or width meets a local tensor and fails: that failure is the diagnostic.
Shapes that fit can still mix columns: the groups the forward views each column-split output in
are compared with the whole forward's (dsl/column_groups.py, E0224).
A split layer must be a plain ``nn.Linear`` / ``Conv1D`` / ``nn.Embedding``: the runtime replaces
it by a split layer with the plain forward, which would drop anything a subclass adds (Gemma's
embedding scale).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from ppdsl.core.own_tp import Parts, is_plain_linear

from .diagnostics import Diagnostic, error
from .families import by_name
from .kv_parts import kv_parts
from ppdsl.core.meta_values import meta_values
from .patterns import match
from .spec import Spec

if TYPE_CHECKING:
    from ppdsl.dsl.introspect import ModelInfo
    from torch import nn

__all__ = ["LayerSplit", "Unproven", "check_local_shapes", "local_heads", "prove_local_shapes"]


@attrs.frozen
class LayerSplit:
    """How one layer is split, as lowering records it (`TpReplacement`'s fields the proof reads)."""

    style: str
    gather_output: bool = False
    kv_parts: Parts = ()
    fused: int | None = None


@attrs.frozen
class Unproven:
    """Why a split is not proven: ``layer`` (``path`` cannot be replaced by a split layer),
    ``forward`` (the forward fails at local shapes, in ``path`` when known), ``groups`` (``path``'s
    columns fall out of line with the groups the forward views them in), ``carried`` (a rank's share
    of what a boundary carries is not the whole's shape) or ``sequence`` (the forward fails with
    its blocks on 1/tp of the sequence)."""

    kind: str
    path: str
    problem: str


def _proof(spec: Spec, info: ModelInfo | None, tp: int) -> tuple[dict[str, Any], Any] | None:
    """The proof's answer for ``spec``'s model split over ``tp`` (cached with the model's facts:
    a warm check, and lowering after check, read it back), with the splits it proved; None when
    there is nothing to prove (a family's model, tp = 1, no layer split)."""
    from ppdsl.core.build import build, quiet_transformers

    from .tp_dataflow import _seq_len

    traced = by_name(spec.model.family).layout_from_trace
    if not traced or info is None or tp <= 1:
        return None
    modules = [p for p in info.modules if p]
    splits: dict[str, Any] = {}
    for rule in spec.tensor_parallel.rules:  # the last rule naming a module decides, as lowering
        for path in match(rule.pattern, modules):
            splits[path] = rule
    if not any(r.style != "replicate" for r in splits.values()):
        return None
    seq = spec.train.seq_len if isinstance(spec.train.seq_len, int) else _seq_len(dict(spec.model.config))
    layers = {path: LayerSplit(rule.style, rule.gather_output,
                               kv_parts(spec, info, path, rule, tp), rule.fused)
              for path, rule in splits.items()}
    layout = getattr(info, "own_layout", None)
    # what the stage boundaries carry besides the hidden state, as lowering sizes them from the whole
    # model's trace (T5's position bias): a rank's share must have those shapes, where pp may be more than 1
    from .own_check import is_one

    carried = getattr(layout, "carried", ()) if not is_one(spec.mesh.pp) else ()
    inputs, sp = getattr(layout, "inputs", None), spec.tensor_parallel.sequence_parallel
    source = spec.model.source

    def prove() -> dict[str, Any]:  # builds the model: torch and transformers imported
        model, _ = build(source.kind, source.target, dict(spec.model.config), "meta", ())
        local: list[list[Any]] = []
        with quiet_transformers():
            found = prove_local_shapes(model, spec.pipeline.blocks, layers, tp, seq, inputs, carried, sp, local)
        return {"unproven": [found.kind, found.path, found.problem]} if found is not None else {"local_heads": local}

    # the verdict depends on the model's facts and these alone: a warm check reads it back
    from .model_facts_cache import cached_answer

    question = {"proof": "local shapes", "answer": 2, "blocks": spec.pipeline.blocks, "tp": tp, "seq": seq,
                "inputs": inputs, "sequence_parallel": bool(sp),
                "carried": [[[j, list(dims)] for j, dims in row] for row in carried],
                "splits": [[path, l.style, l.gather_output, [list(part) for part in l.kv_parts], l.fused]
                           for path, l in sorted(layers.items())]}
    return cached_answer(source.kind, source.target, dict(spec.model.config), question, prove), splits


def local_heads(spec: Spec, info: ModelInfo | None, tp: int) -> list[tuple[str, list[tuple[str, int, int]], bool]]:
    """The modules whose heads the proof made local at ``tp``, as (path, [(attribute, whole,
    local)], takes per-head inputs): what the runtime sets, read from the plan. Empty when there
    is nothing to make local. ValueError when the split is not proven: check refuses such a spec
    at the tp it states (E0426), and lowering meets it only at a tp check could not name."""
    proof = _proof(spec, info, tp)
    if proof is None:
        return []
    answer = proof[0]
    if "unproven" in answer:
        kind, path, problem = answer["unproven"]
        raise ValueError(f"the own forward's split over tp = {tp} is not proven ({kind}{' at ' + path if path else ''}): "
                         f"{problem}")
    return [(path, [(a, w, l) for a, w, l in changes], bool(sliced)) for path, changes, sliced in answer["local_heads"]]


def check_local_shapes(spec: Spec, info: ModelInfo | None) -> list[Diagnostic]:
    """E0426 when the own forward of ``spec``'s model (layout and declared rules inferred) fails at
    one rank's local shapes; nothing for a family's model or at tp = 1."""
    tp = spec.mesh.tp
    if info is None or not getattr(tp, "is_Integer", False):
        return []
    tp = int(tp)
    modules = [p for p in info.modules if p]
    splits: dict[str, Any] = {}
    for rule in spec.tensor_parallel.rules:
        for path in match(rule.pattern, modules):
            splits[path] = rule
    shared = [p for p, r in splits.items() if r.style != "replicate"
              and any(p == s or p.startswith(s + ".") for s in spec.pipeline.shared)]
    if shared and by_name(spec.model.family).layout_from_trace and tp > 1:
        # one tensor on every pipeline rank, its gradients summed over pp: kept whole
        return [error("E0426", splits[shared[0]].span or spec.span("tensor_parallel"),
                      f"{info.class_name} cannot run its own forward split over tp = {tp}: '{shared[0]}' is held by "
                      "every stage (its parameters reach every block), and ppdsl keeps such a module whole",
                      label="a module every stage holds",
                      hint="leave it whole (drop the rule, or `path : replicate`)")]
    proof = _proof(spec, info, tp)
    if proof is None or "unproven" not in proof[0]:
        return []
    answer, splits = proof
    found = Unproven(*answer["unproven"])
    path, problem = found.path, found.problem
    if found.kind == "carried":
        from .own_check import carried_refusal

        return [carried_refusal(info.class_name, spec.span("mesh.tp") or spec.span("tensor_parallel"), problem,
                                "keep the layers it is computed from whole, or set tp = 1, or pp = 1",
                                label="each rank's share of what a boundary carries")]
    if found.kind == "sequence":
        return [error("E0426", spec.span("tensor_parallel.sequence_parallel") or spec.span("tensor_parallel"),
                      f"{info.class_name} cannot run its own forward split along the sequence over tp = {tp}: with "
                      f"its blocks on 1/tp of the tokens between their split layers it fails: {problem.rstrip('.')}",
                      label="each rank's blocks hold 1/tp of the sequence outside their split layers",
                      hint="set sequence_parallel = false (tensor parallelism works without it)")]
    if found.kind == "groups":
        rule = splits[path]
        return [error("E0224", rule.span or spec.span("tensor_parallel"),
                      f"{info.class_name}: '{path}': {problem}",
                      label="each rank's columns would not be whole groups of the forward's view",
                      hint="keep this layer whole, and the row split its output feeds (drop both rules), or set "
                           "tp = 1; the other layers can still split")]
    if found.kind == "layer":  # a layer the split would replace by a plain one
        return [error("E0426", splits[path].span or spec.span("tensor_parallel"),
                      f"{info.class_name} cannot run its own forward split over tp = {tp}: '{path}': {problem}",
                      label="replaced by a split layer on every rank",
                      hint="leave it whole (drop the rule, or `path : replicate`): ppdsl splits plain nn.Linear, "
                           "Conv1D and nn.Embedding layers")]
    return [error("E0426", spec.span("mesh.tp") or spec.span("tensor_parallel"),
                  f"{info.class_name} cannot run its own forward split over tp = {tp}: its forward fails at one "
                  f"rank's local shapes: {problem.rstrip('.')}",
                  label="each rank runs the forward on its share of the split layers",
                  hint="the module named reads a whole width or head count the generic rule does not know: leave "
                       "its layers whole, or set tp = 1 (a family folder, core/families/, can localise it by hand)")]


def prove_local_shapes(model: nn.Module, blocks: str, splits: Mapping[str, LayerSplit], tp: int,
                       seq_len: int, kind: str | None = None,
                       carried: Sequence[Sequence[tuple[int, tuple[int, ...]]]] = (),
                       sequence_parallel: bool = False, local_heads: list[list[Any]] | None = None) -> Unproven | None:
    """Why the forward of ``model`` (built on meta; changed in place) is not proven at one rank's
    local shapes under ``splits`` (module path -> `LayerSplit`); None when it runs there and every
    column-split output keeps its groups, and each block's output a stage boundary carries
    (``carried``: `OwnLayout.carried`, -1 the sequence) has the whole model's shape at this batch
    and ``seq_len`` (kind ``carried`` otherwise: the plan sizes the boundaries from the whole).
    ``sequence_parallel``: the blocks run on 1/tp of the sequence between their split layers, as the
    runtime runs them (`sequence_split_hooks`). ``local_heads`` receives, per module whose heads
    become local, [path, [(attribute, whole, local)], whether it slices per-head inputs]: what the
    plan carries for the runtime to set (`LocalHeads`)."""
    import torch

    from ppdsl.core import own_cut
    from ppdsl.core.build import exc_text
    from ppdsl.core.task_loss import own_task, task_loss

    from ppdsl.core.own_tp import (divided_widths, kv_heads_by_parent, localize_generic, slice_per_head_inputs,
                                   unknown_head_count)

    from .block_sample import over_sampled_blocks, repeated_entries
    from .column_groups import misaligned, recording_groups

    from ppdsl.core.model_inputs import kind_of, meta_inputs
    from ppdsl.core.task_loss import CLASSIFICATION_TASKS

    kind = kind or kind_of(model) or "tokens"  # the traced layout's (an image-text model on its tokens alone: tokens)
    task = own_task(type(model).__name__, kind)
    given = meta_inputs(model, 2, seq_len, kind=kind)
    ids = given.get("input_ids")
    inputs = own_cut.model_inputs(model, ids, token_type_ids=torch.zeros_like(ids)
                                  if task == "sequence_classification" else None, pixel_values=given.get("pixel_values"),
                                  labels=given.get("decoder_input_ids", ids) if "decoder_input_ids" in given else None,
                                  input_features=given.get("input_features"))
    labels = torch.zeros((2,), dtype=torch.long, device="meta") if task in CLASSIFICATION_TASKS \
        else given.get("decoder_input_ids", ids)
    model.train()  # as the stages run it

    def run() -> None:
        with meta_values():
            logits, _ = own_cut.run_forward(model, inputs)
            task_loss(task, model.config, logits, labels)

    # the column splits whose views are compared (kv-replicated parts follow their own rows)
    columns = {path: rule.fused or 1 for path, rule in splits.items()
               if rule.style == "column" and not rule.gather_output and not rule.kv_parts}

    def recorded() -> dict[str, list[Any]]:  # one forward, recording the views of the columns the model holds now
        held = {p for p, _ in model.named_modules()}
        with recording_groups(model, [p for p in columns if p in held]) as found:
            run()
        return {path: list(groupings) for path, groupings in found.items()}

    def sampled() -> dict[str, list[Any]]:  # over the first blocks, each view a module's own (ppdsl.dsl.block_sample)
        return over_sampled_blocks(model, blocks, recorded, lambda found, reps: repeated_entries(found, blocks, reps),
                                   extra=split_kinds, complete=lambda found: set(columns) <= set(found))

    # blocks alike are of one kind only when split alike
    split_kinds = _split_kinds(model, blocks, splits)
    whole: dict[str, list[tuple[int, ...]]] = {}
    if columns:
        try:
            whole = sampled()
        except Exception:  # the whole forward's failures are check's trace's to report
            whole = {}

    widths = divided_widths(splits.items(), model.get_submodule, lambda parent: parent.startswith(blocks + "."))
    kv_heads = kv_heads_by_parent(splits.items())
    for path, rule in splits.items():
        problem = _localize(model.get_submodule(path), rule, tp)
        if problem is not None:
            return Unproven("layer", path, problem)
    for parent, found in widths.items():  # the runtime's generic rule for local heads (block modules)
        problem = unknown_head_count(model.get_submodule(parent), found, tp)
        if problem is not None:
            return Unproven("forward", "", f"in '{parent}' ({type(model.get_submodule(parent)).__name__}): {problem}")
        changes = localize_generic(model.get_submodule(parent), found, tp, kv_heads.get(parent, 0))
        sliced = slice_per_head_inputs(model.get_submodule(parent), tp, 0)
        if local_heads is not None and (changes or sliced):
            local_heads.append([parent, [list(c) for c in changes], sliced])
    running, handles = _tracking(model)
    sent: dict[tuple[int, int], tuple[int, ...]] = {}  # (block, output index) -> its shape at local shapes
    wanted = {(i - 1, j) for i, row in enumerate(carried) for j, _ in row}
    for i, entry in enumerate(model.get_submodule(blocks) if wanted else ()):
        def record(_: Any, __: Any, output: Any, i: int = i) -> None:
            for j, v in enumerate(output if isinstance(output, (tuple, list)) else ()):
                if (i, j) in wanted and isinstance(v, torch.Tensor):
                    sent.setdefault((i, j), tuple(v.shape))
        handles.append(entry.register_forward_hook(record).remove)
    try:
        if wanted:  # what each block returns is compared: every block runs
            with recording_groups(model, list(columns)) as local:
                run()
        else:
            local = sampled()
    except Exception as exc:  # any failure of library code at local shapes
        return Unproven("forward", "", _where(model, running) + exc_text(exc))
    finally:
        for remove in handles:
            remove()
    for i, row in enumerate(carried):
        for j, dims in row:
            expected = own_cut.carried_at(dims, seq_len)
            got = sent.get((i - 1, j))
            if got is None or tuple(got[1:]) != expected:
                return Unproven("carried", "", f"output {j} of block {i - 1}, of shape {expected} per sample in the whole "
                                               f"model, is {tuple(got[1:]) if got else 'not returned'} on one of "
                                               f"{tp} tp ranks")
    off = misaligned(whole, local, columns, tp)
    if off is None:
        return _sequence_split(model, blocks, splits, tp, run) if sequence_parallel else None
    path, g, l = off
    constant = f" (the forward holds the count {g[0]} as a constant)" if l[0] == g[0] else ""
    return Unproven("groups", path, f"the forward views its {math.prod(g)} output features as {_groups(g)}; split "
                                    f"over tp = {tp}, each rank's {math.prod(l)} columns are viewed as {_groups(l)}"
                                    f"{constant}, so a group mixes columns of different groups of the whole layer")


def _split_kinds(model: nn.Module, blocks: str, splits: Mapping[str, LayerSplit]) -> list[Any]:
    """Per block of ``blocks``, its layers' splits by path within the block (`ppdsl.dsl.block_sample`'s
    ``extra``); [] when ``blocks`` is not a module of the model."""
    from .block_sample import index_in

    try:
        count = len(model.get_submodule(blocks)) if blocks else 0
    except (AttributeError, TypeError):
        return []
    kinds: list[list[Any]] = [[] for _ in range(count)]
    for path, split in splits.items():
        i = index_in(path, blocks)
        if i is not None and i < count:
            kinds[i].append((path.split(".", blocks.count(".") + 2)[-1], repr(split)))
    return [tuple(sorted(k)) for k in kinds]


def _sequence_split(model: nn.Module, blocks: str, splits: Mapping[str, LayerSplit], tp: int,
                    run: Any) -> Unproven | None:
    """Kind ``sequence`` when the forward, proven at local shapes, fails with the blocks on 1/tp of
    the sequence (OPT's blocks flatten the tokens before their MLP)."""
    from ppdsl.core.build import exc_text

    running, undo = _tracking(model)
    undo += sequence_split_hooks(model, blocks, splits, tp)
    try:
        run()
    except Exception as exc:
        return Unproven("sequence", "", _where(model, running) + exc_text(exc))
    finally:
        for step in reversed(undo):
            step()
    return None


def _tracking(model: nn.Module) -> tuple[list[str], list[Any]]:
    """(the modules whose forward is under way, innermost last; what removes the hooks that keep it)."""
    running: list[str] = []

    def leave(*_: Any) -> None:  # a hook's return value would replace the module's output
        running.pop()

    undo: list[Any] = []
    for name, m in model.named_modules():
        undo.append(m.register_forward_pre_hook(lambda *_, name=name: running.append(name)).remove)
        undo.append(m.register_forward_hook(leave).remove)
    return running, undo


def _where(model: nn.Module, running: Sequence[str]) -> str:
    """The innermost module under way when the forward failed, for the message."""
    inner = running[-1] if running else ""
    return f"in '{inner}' ({type(model.get_submodule(inner)).__name__}): " if inner else ""


def sequence_split_hooks(model: nn.Module, blocks: str, splits: Mapping[str, LayerSplit], tp: int) -> list[Any]:
    """What the runtime does under sequence parallelism, at one rank's shapes on meta: the first
    block takes 1/tp of the sequence, each gathered region (`ppdsl.core.sequence_regions`) and
    each column split outside one all-gather their input, each row split in a block
    reduce-scatters its output, and the last block's output is the whole sequence again (dim 1
    throughout, as runtime/parallel/tp's layers). Returns what removes the hooks."""
    import torch

    from ppdsl.core import own_cut
    from ppdsl.core.sequence_regions import gathered_regions

    def part(x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 2 or x.shape[1] % tp:
            raise ValueError(f"sequence parallelism splits dim 1 of a {tuple(x.shape)} tensor over tp = {tp}")
        return x.narrow(1, 0, x.shape[1] // tp)

    def whole(x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 2:
            raise ValueError(f"sequence parallelism gathers dim 1 of a {tuple(x.shape)} tensor")
        return torch.cat([x] * tp, dim=1)

    def gather_input(_m: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        if args and isinstance(args[0], torch.Tensor):
            return (whole(args[0]), *args[1:]), kwargs
        if isinstance(kwargs.get("hidden_states"), torch.Tensor):
            return args, {**kwargs, "hidden_states": whole(kwargs["hidden_states"])}
        raise ValueError(f"{type(_m).__name__} got no hidden-states tensor to all-gather")

    gathered: list[Any] = []  # the autograd node of each region's gathered input, innermost last

    def enter_region(m: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        args, kwargs = gather_input(m, args, kwargs)
        x = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs["hidden_states"]
        gathered.append(x.grad_fn)
        return args, kwargs

    def leave_region(*_: Any) -> None:
        gathered.pop()

    def from_gathered() -> Any:
        """A column split in a region takes the gathered sequence as it is (no communication of its
        own, runtime/parallel/tp/layers.py): its input must be computed from it, or its gradient would reach
        a replicated input (DeBERTa's relative embeddings) from this rank's heads alone."""
        def hook(_m: Any, args: tuple[Any, ...]) -> None:
            node = gathered[-1] if gathered else None
            if node is not None and args and isinstance(args[0], torch.Tensor) \
                    and not _reaches(args[0].grad_fn, node):
                raise ValueError("it takes an input other than the sequence its module gathers, whose gradient "
                                 "would be this rank's part only")
        return hook

    entries = list(model.get_submodule(blocks))
    undo: list[Any] = [*own_cut.hook_hidden_in(entries[0], part), *own_cut.hook_hidden_out(entries[-1], whole)]
    columns = {p for p, r in splits.items() if r.style == "column"}
    split = {p for p, r in splits.items() if r.style != "replicate"}
    for i in range(len(entries)):
        prefix = f"{blocks}.{i}"
        by_path = dict(model.get_submodule(prefix).named_modules(prefix=prefix))
        regions = gathered_regions(prefix, lambda path: tuple(f"{path}.{c}" for c, _ in by_path[path].named_children()),
                                   columns, split)
        for path in regions:
            undo.append(by_path[path].register_forward_pre_hook(enter_region, with_kwargs=True).remove)
            undo.append(by_path[path].register_forward_hook(leave_region, always_call=True).remove)
        for path in by_path:
            if path in columns and any(path.startswith(r + ".") for r in regions):
                undo.append(by_path[path].register_forward_pre_hook(from_gathered()).remove)
            elif path in columns:
                undo.append(by_path[path].register_forward_pre_hook(gather_input, with_kwargs=True).remove)
            elif path in split and splits[path].style == "row":
                undo.append(by_path[path].register_forward_hook(lambda _m, _a, out: part(out)).remove)
    return undo


def _reaches(start: Any, target: Any) -> bool:
    """Whether autograd node ``start`` is ``target`` or computed from it (breadth first, so an input
    computed from the gathered sequence is found in a few steps)."""
    seen, frontier = set(), [start]
    while frontier:
        step = []
        for node in frontier:
            if node is None or id(node) in seen:
                continue
            if node is target:
                return True
            seen.add(id(node))
            step.extend(n for n, _ in node.next_functions)
        frontier = step
    return False


def _groups(factors: Sequence[int]) -> str:
    return f"{factors[0]} groups of {' x '.join(map(str, factors[1:]))}"


def _localize(module: nn.Module, rule: LayerSplit, tp: int) -> str | None:
    """Give ``module`` one rank's weight shapes under ``rule``, or say why it cannot be split."""
    from torch import nn

    style = rule.style
    if style == "replicate" or (style == "column" and rule.gather_output and is_plain_linear(module)):
        return None  # whole on every rank (a gathered column's output is whole)
    if style == "vocab":
        if type(module) is not nn.Embedding:
            return (f"a vocab split replaces the embedding by a plain nn.Embedding, but it is a "
                    f"{type(module).__name__}, whose own forward would be lost")
        _set(module, "weight", (module.weight.shape[0] // tp, module.weight.shape[1]))
        return None
    if not is_plain_linear(module):
        return (f"a {style} split replaces the layer by a plain linear one, but it is a {type(module).__name__}, "
                "whose own forward would be lost")
    conv = type(module).__name__ == "Conv1D"  # transformers' GPT-2 layer: weight [in, out]
    out_dim, in_dim = (1, 0) if conv else (0, 1)
    shape = list(module.weight.shape)
    if style == "column":
        from ppdsl.core.own_tp import part_rows

        rows = sum(end - start for start, end in part_rows(rule.kv_parts, tp, 0)) if rule.kv_parts \
            else shape[out_dim] // tp
        shape[out_dim] = rows
        if module.bias is not None:
            _set(module, "bias", (rows,))
    elif style == "row":
        shape[in_dim] //= tp
    _set(module, "weight", tuple(shape))
    for name, dim in (("out_features", out_dim), ("in_features", in_dim), ("nf", out_dim)):
        if isinstance(getattr(module, name, None), int):
            setattr(module, name, shape[dim])
    return None


def _set(module: nn.Module, name: str, shape: Sequence[int]) -> None:
    import torch
    from torch import nn

    old = getattr(module, name)
    module._parameters[name] = nn.Parameter(torch.empty(tuple(shape), dtype=old.dtype, device="meta"),
                                            requires_grad=old.requires_grad)
