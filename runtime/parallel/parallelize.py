"""The one composer of a rank's parallelisms (torchtitan's ``parallelize_llama``):
`parallelize` takes the stages `build_stages` made, holding the whole model's weights (their
init, or the pretrained ones), and divides them, one function per technique, in this order:

1. tensor and sequence parallelism (`apply_tp`: column / row / vocab splits, localised
   attention, replicated key/value heads, and with sequence parallelism the split regions of
   each block), then the ties re-made (`retie`);
2. expert parallelism (`runtime.parallel.expert.apply_ep`);
3. context parallelism (`runtime.parallel.context.apply_cp`);
4. activation checkpointing (`apply_ac`: each stage recomputes its blocks);
5. compilation (`apply_compile`: each block through torch.compile);
6. ZeRO-3 through FSDP2 (`runtime.parallel.fsdp.apply_fsdp`), after recording what the plain
   parameters tell (`ParamFacts`), which FSDP's DTensors no longer do;
7. the dropout RNG regions under tp (`runtime.parallel.rng`).

ZeRO-1 is not a change to the modules: the trainer's optimizer step does it
(`runtime.parallel.zero`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch
from torch import nn

from ppdsl.runtime.stage.adapters.base import StageAdapter
from ppdsl.lowering.plan import Plan, TpReplacement

from ppdsl.core.module_paths import under, under_any
from ppdsl.runtime.parallel.context import apply_cp
from ppdsl.runtime.parallel.expert import apply_ep
from ppdsl.runtime.parallel.fsdp import StageCopy, apply_fsdp, untie_across_stages
from ppdsl.runtime.parallel.groups import ProcessGroups
from ppdsl.runtime.parallel.rng import (
    TensorParallelRng, install_sequence_parallel_regions, install_tensor_parallel_regions,
)
from ppdsl.runtime.stage.adapters import stage_adapter
from ppdsl.runtime.stage.module import StageModule
from ppdsl.runtime.stage.params import is_tp_sharded, owner_modules
from ppdsl.runtime.stage.build import tied_parameter_groups


@attrs.frozen
class ParamFacts:
    """What a rank's plain parameters tell, by name, recorded before FSDP2 turns them into
    DTensors: whether each is a tensor-parallel shard, and which are replicated over tp inside
    the sequence-split region (their partial gradients are summed over tp)."""

    tp_sharded: dict[str, bool]
    sequence_parallel: frozenset[str]


@attrs.frozen
class Parallelized:
    """What `parallelize` made that training keeps using."""

    facts: ParamFacts
    fsdp_roots: list[Any]  # ZeRO-3: the stage modules, now FSDP modules; else empty
    stage_copies: list[StageCopy]  # ZeRO-3: a tie within this rank, split into copies
    tp_rng: TensorParallelRng | None  # tp > 1: each tp rank's own stream for its heads
    sp_rng: TensorParallelRng | None  # sequence parallelism: each tp rank's own tokens


def parallelize(stages: Sequence[StageModule], plan: Plan, groups: ProcessGroups,
                device: torch.device) -> Parallelized:
    """Apply every parallelism the plan names to this rank's ``stages``, in place."""
    train = plan.train
    if plan.mesh.tp > 1:
        apply_tp(stages, plan, groups.tp)
    if plan.experts:  # the experts divided over ep (check refused ZeRO with ep: E0241)
        apply_ep(stages, plan, groups.ep, groups.ep_rank)
    if plan.mesh.cp > 1:  # each sequence split over cp, attention over the whole of it
        apply_cp(stages, plan.context_attention, groups.cp, plan.mesh.cp, groups.cp_rank, train.seq_len)
    apply_ac(stages, bool(train.activation_checkpointing))
    if train.compile:
        for stage in stages:
            apply_compile(stage)
    stage_copies: list[StageCopy] = []
    fsdp_roots: list[Any] = []
    sharded = train.zero == 3 and groups.layout.dp > 1
    if sharded:
        stage_copies = untie_across_stages(stages)
    facts = param_facts(stages, plan.mesh.tp)
    if sharded:
        fsdp_roots = apply_fsdp(stages, groups.mesh["dp"], train.reshard_after_forward)
    tp_rng = sp_rng = None
    if groups.layout.tp > 1:
        tp_rng = install_tensor_parallel_regions(stages, groups.tp_rank, device)
        if plan.sequence_parallel:
            sp_rng = install_sequence_parallel_regions(stages, groups.tp_rank, device)
    return Parallelized(facts, fsdp_roots, stage_copies, tp_rng, sp_rng)


def param_facts(stages: Sequence[StageModule], tp: int) -> ParamFacts:
    sharded: dict[str, bool] = {}
    sequence_parallel: set[str] = set()
    for stage in stages:
        owners = owner_modules(stage)
        for name, p in stage.named_parameters(remove_duplicate=False):
            owner, local = owners[id(p)]
            sharded.setdefault(name, is_tp_sharded(p, owner, local, tp))
            if getattr(p, "sequence_parallel", False):
                sequence_parallel.add(name)
    return ParamFacts(sharded, frozenset(sequence_parallel))


def _shard(module: nn.Module, r: TpReplacement, group: Any, sequence_parallel: bool = False) -> nn.Module | None:
    """``sequence_parallel``: the layer sits in a block, where the hidden states are split along
    the sequence (column: all-gather its input; row: reduce-scatter its output)."""
    from ppdsl.runtime.parallel.tp import shard_column, shard_row, shard_vocab_embedding

    if r.style == "column":
        if sequence_parallel and r.gather_output:
            raise ValueError(
                f"{r.path}: a column split with gather_output inside a block cannot be combined with "
                "sequence_parallel (its output would be the whole sequence in the sequence-split region)"
            )
        return shard_column(
            module, group, fused=r.fused, gather_output=r.gather_output, pad_to=r.pad_to,
            sequence_parallel=sequence_parallel,
        )
    if r.style == "row":
        return shard_row(module, group, sequence_parallel=sequence_parallel)
    if r.style == "vocab":
        return shard_vocab_embedding(module, group, pad_to=r.pad_to)
    return None  # replicate: every rank keeps the full module


def apply_tp(stages: Sequence[StageModule], plan: Plan, group: Any) -> None:
    """Tensor (and sequence) parallelism over the tp ``group``: each stage's replacements, then
    the ties this rank holds made one Parameter again."""
    import torch.distributed as dist

    if dist.get_world_size(group) != plan.mesh.tp:
        raise ValueError(f"the tensor-parallel group has {dist.get_world_size(group)} ranks, the plan tp = {plan.mesh.tp}")
    adapter = stage_adapter(plan.model.family)
    tied = tied_parameter_groups(plan, stages)
    for stage in stages:
        stage.sequence_parallel = bool(plan.sequence_parallel)
        _tp_stage(stage, plan, adapter, group)
    retie(stages, tied)


def _tp_stage(stage: StageModule, plan: Plan, adapter: StageAdapter, group: Any) -> None:
    from ppdsl.runtime.parallel.tp import SUPPORTED_ATTENTION, ColumnParallelLinear, localize_attention, replace_module

    stage.tp_group = group
    mine = [r for r in plan.tp if under_any(r.path, _held_paths(stage))]
    for r in mine:
        if r.kv_parts:  # a column divided part by part (the plan says how): the layer stays whole
            from ppdsl.runtime.parallel.tp.kv_replicated import replicate_rows

            replicate_rows(stage.get_submodule(r.path), r.kv_parts, group)
            continue
        in_block = stage.sequence_parallel and under_any(r.path, stage.block_names)
        new = _shard(stage.get_submodule(r.path), r, group, sequence_parallel=in_block)
        if new is not None:
            replace_module(stage, r.path, new)
    # heads become local only where a projection's output stays split (a gathered one is whole)
    column_paths = [r.path for r in mine if r.style == "column" and not r.gather_output]
    if adapter.own_forward:
        import torch.distributed as dist

        _localize_heads(stage, plan, dist.get_rank(group))
        _mark_partial(stage, plan.tp_partial)
    for block_name in () if adapter.own_forward else stage.block_names:  # the own forward: the generic rule
        for sub_path, sub in stage.get_submodule(block_name).named_modules(prefix=block_name):
            if type(sub).__name__ not in SUPPORTED_ATTENTION:
                continue
            if any(type(c).__name__ in SUPPORTED_ATTENTION for c in sub.children()):
                continue  # a wrapper (BertAttention): its inner module is localised
            if any(under(p, sub_path) for p in column_paths):
                localize_attention(sub, plan.mesh.tp)
                _mark_head_local_params(sub)
    if stage.sequence_parallel:
        for block_name in stage.block_names:
            _sequence_parallel_block(stage.get_submodule(block_name), block_name, group)
    if stage.is_last:
        # the head: the last module of the last stage, whose split without gather_output makes the
        # loss vocab-parallel (check's head rules hold it to the labels and the vocabulary)
        head = stage.get_submodule(plan.stages[-1].last[-1])
        if isinstance(head, ColumnParallelLinear) and not head.gather_output:
            stage.head_partition = head.partition


def _localize_heads(stage: StageModule, plan: Plan, tp_rank: int) -> None:
    """The own forward's local heads, as the plan says: check's proof ran the forward at one
    rank's local shapes with these attributes (`LocalHeads`), so the runtime sets them, never
    re-deriving them."""
    from ppdsl.core.own_tp import slice_per_head_inputs

    if plan.tp_local_heads is None:
        raise ValueError("the plan does not say which modules' heads become local under tp (a plan from an older "
                         "ppdsl): lower the spec again (`ppdsl plan`, or `ppdsl run SPEC`)")
    held = _held_paths(stage)
    for entry in plan.tp_local_heads:
        if not under_any(entry.path, held):
            continue
        module = stage.get_submodule(entry.path)
        for name, whole, local in entry.attributes:
            if getattr(module, name, None) != whole:
                raise ValueError(f"'{entry.path}.{name}' is {getattr(module, name, None)!r} where the plan says {whole}: "
                                 "the plan was lowered for another model")
            setattr(module, name, local)
        if entry.per_head_inputs:
            slice_per_head_inputs(module, plan.mesh.tp, tp_rank)


def _gather_input_hook(group: Any) -> Any:
    from ppdsl.runtime.parallel.tp import gather_seq

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        if args and isinstance(args[0], torch.Tensor):
            return (gather_seq(args[0], group, 1), *args[1:]), kwargs
        if isinstance(kwargs.get("hidden_states"), torch.Tensor):
            return args, {**kwargs, "hidden_states": gather_seq(kwargs["hidden_states"], group, 1)}
        raise ValueError(
            f"sequence_parallel: {type(module).__name__} got no hidden-states tensor (first positional "
            "argument or hidden_states=) to all-gather"
        )

    return hook


def _sequence_parallel_block(block: nn.Module, block_name: str, group: Any) -> None:
    """Set one block up for sequence-split hidden states (Megatron-LM's sequence parallelism).

    * Every outermost module with a column-parallel child (`_is_sp_region`) all-gathers its
      input at entry (forward pre-hook; reduce-scatter of the gradient in backward), and the
      column layers under it take that gathered input as is. A column layer outside such a
      module gathers its own input. Row-parallel layers reduce-scatter their output back onto
      the sequence blocks (set when sharding).
    * Everything else in the block (norms, residual adds, dropout) works on this rank's
      sequence block. Its replicated parameters get only this block's share of the gradient:
      they are marked ``param.sequence_parallel = True`` and the trainer sums their gradients
      over the tp group. Row-parallel biases are exact already (`RowParallelLinear` adds them
      through `copy_to_tp`), and replicated parameters inside a gathered module see the whole
      sequence, as without sequence parallelism.

    A block with no column-parallel layer would run its token mixing (attention) on a part of
    the sequence: refused.
    """
    from ppdsl.core.sequence_regions import gathered_regions

    from ppdsl.runtime.parallel.tp import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

    tp_layers = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)
    by_path = dict(block.named_modules(prefix=block_name))
    columns = {path for path, m in by_path.items() if isinstance(m, ColumnParallelLinear)}
    split = {path for path, m in by_path.items() if isinstance(m, tp_layers)}
    regions = [(path, by_path[path]) for path in gathered_regions(
        block_name, lambda path: tuple(f"{path}.{c}" for c, m in by_path[path].named_children()), columns, split)]
    if not regions and not columns:
        raise ValueError(
            f"sequence_parallel: block '{block_name}' has no column-parallel layer, so its attention "
            "would see only this rank's part of the sequence; split its attention and MLP over tp "
            "or set sequence_parallel = false"
        )
    gathered: set[int] = set()
    for _path, region in regions:
        region.register_forward_pre_hook(_gather_input_hook(group), with_kwargs=True)
        for m in region.modules():
            gathered.add(id(m))
            if isinstance(m, ColumnParallelLinear):
                m.input_gathered = True
    from ppdsl.runtime.parallel.tp import SUPPORTED_ATTENTION

    for path, m in block.named_modules(prefix=block_name):
        attention = type(m).__name__ in SUPPORTED_ATTENTION and not any(
            type(c).__name__ in SUPPORTED_ATTENTION for c in m.children()
        )
        if attention and id(m) not in gathered:
            raise ValueError(
                f"sequence_parallel: the attention '{path}' is not split over tp, so it would see only "
                "this rank's part of the sequence; split its projections (column / row) or set "
                "sequence_parallel = false"
            )
    for m in block.modules():
        if id(m) in gathered or isinstance(m, tp_layers):
            continue
        for p in m.parameters(recurse=False):
            p.sequence_parallel = True  # type: ignore[attr-defined]


def _mark_partial(stage: StageModule, modules: Sequence[str]) -> None:
    """The own forward's attention classes carry no family rule: the modules the plan names
    (`Plan.tp_partial`: beside a split column, fed this rank's share of its output, as check's
    dataflow found: Qwen3's per-head q / k norms) hold replicated parameters with partial
    gradients, summed over tp by the trainer like sequence-parallel ones."""
    held = _held_paths(stage)
    for path in modules:
        if under_any(path, held):
            for p in stage.get_submodule(path).parameters(recurse=False):
                p.sequence_parallel = True  # type: ignore[attr-defined]


def _mark_head_local_params(attention: nn.Module) -> None:
    """A family's localised attention: its replicated parameters outside its split projections
    see only this rank's heads: partial gradients, summed over tp (as `_mark_partial`)."""
    from ppdsl.runtime.parallel.tp import ColumnParallelLinear, RowParallelLinear

    for m in attention.modules():
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
            continue
        for p in m.parameters(recurse=False):
            p.sequence_parallel = True  # type: ignore[attr-defined]


def apply_ac(stages: Sequence[StageModule], enabled: bool) -> None:
    """`train.activation_checkpointing`: each stage recomputes its blocks' activations in
    backward instead of keeping them (`StageModule.activation_checkpointing`)."""
    for stage in stages:
        stage.activation_checkpointing = enabled


def apply_compile(stage: StageModule) -> None:
    """`train.compile`: each block of ``stage`` through ``torch.compile`` (inductor), compiled in
    place as torchtitan's apply_compile does: the blocks repeat one structure, so one graph serves
    them all, and what runs between them (the executor, sends, the head's loss) stays eager.
    Applied after the tp replacements, before FSDP2 wraps the blocks (zero = 3)."""
    for block in stage.blocks():
        block.compile()


def retie(stages: Sequence[StageModule], groups: Sequence[tuple[str, ...]]) -> None:
    """After sharding, make the tied copies this rank holds one Parameter again."""
    for names in groups:
        members = [
            (stage, name)
            for name in names
            for stage in stages
            if under_any(name, _held_paths(stage))
        ]
        if len(members) < 2:
            continue
        first_stage, first_name = members[0]
        shared = first_stage.get_parameter(first_name)
        for stage, name in members[1:]:
            owner_path, _, local = name.rpartition(".")
            owner = stage.get_submodule(owner_path)
            current = getattr(owner, local)
            if current is shared:
                continue
            if current.shape != shared.shape:
                raise ValueError(
                    f"tied parameters {first_name} {tuple(shared.shape)} and {name} {tuple(current.shape)} "
                    "are split differently over tensor-parallel ranks; split both the same way "
                    "(vocab and column, neither padded)"
                )
            setattr(owner, local, shared)


def _held_paths(stage: StageModule) -> tuple[str, ...]:
    """The parameter-holding module paths of a built stage."""
    a = stage.assignment
    return (*a.first, *a.shared, *stage.block_names, *a.last)
