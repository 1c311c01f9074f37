"""Build only this rank's part of the model: one `StageModule` per virtual stage.

Recipe (`build_stages`):

1. Build the whole model as a *skeleton*: every parameter on the meta device (nothing
   allocated), every buffer real on the CPU (RoPE ``inv_freq``, BERT ``position_ids`` are
   computed at construction and are not in any checkpoint, so they must not be meta).
2. For each virtual stage of this pipeline rank keep: the plan's ``first`` modules (first stage),
   blocks ``[block_start, block_stop)``, the ``last`` modules (last stage), and a copy of every
   parameter-free module outside the block list (Llama's ``model.rotary_emb``, GPT-2's
   ``transformer.drop``, BERT's ``dropout``) since any stage may need one.
3. Materialise the kept parameters on ``device`` and fill them with `init_module_params`, keyed
   by full parameter name: the union of all ranks' parts equals `build_reference_model`, bit for
   bit. Tied parameters (GPT-2 wte / lm_head) are filled under their canonical name.
4. Apply the plan's tensor-parallel replacements that fall inside this rank's modules (slices of
   the full init), localise the attention modules whose projections were column-split.
   With ``sequence_parallel`` the split layers inside blocks work on sequence-split hidden
   states (`_sequence_parallel_block`): attention / MLP modules all-gather their input, row
   layers reduce-scatter their output, and the block's replicated parameters (norms) are marked
   ``sequence_parallel`` for the trainer's gradient sum over tp.
5. For ``hf_pretrained`` models read the rank's parameters from the directory's safetensors
   (`ppdsl.runtime.weights.load_pretrained`): only the tensors it holds, and of a
   tensor-parallel layer only its slice.

A `StageModule` registers its modules under the same paths as in the full model
(``transformer.h.5.attn.c_attn``), so parameter names, state-dict keys and TP paths are the full
model's; the block list becomes an ``nn.ModuleDict`` keyed by the original indices.

Tied parameters: within one rank the copies are one ``nn.Parameter`` object (also across that
rank's stages, e.g. rank 0 under a V schedule holds both wte and lm_head), so its gradient is
already the sum; between ranks the executor all-reduces the gradients of each group of
`tied_parameter_groups` over the pipeline ranks `tied_parameter_ranks` names.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import torch
from torch import nn

from ppdsl.lowering.plan import ModelRef, Plan, StageAssignment, TpReplacement
from ppdsl.core.families import run_refusal
from ppdsl.core.families import stage_adapter as get_adapter
from ppdsl.core.families.stage_base import StageAdapter
from ppdsl.core.phrasing import not_divisible_by_tp
from ppdsl.runtime.init import init_module_params
from ppdsl.runtime.weights import load_pretrained

__all__ = [
    "MicroBatch",
    "StageModule",
    "activation_dtype",
    "activation_shape",
    "build_reference_model",
    "build_skeleton",
    "build_stages",
    "rank_named_parameters",
    "stage_module_paths",
    "tied_parameter_groups",
    "tied_parameter_ranks",
]

TP_STYLES = ("column", "row", "vocab", "replicate")


@attrs.frozen
class MicroBatch:
    """One microbatch. ``labels``: token ids (B, S) for causal LMs, class ids (B,) for BERT."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    attention_mask: torch.Tensor | None = None
    token_type_ids: torch.Tensor | None = None

    def to(self, device: torch.device | str) -> MicroBatch:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=True)

        return MicroBatch(
            input_ids=move(self.input_ids),
            labels=move(self.labels),
            attention_mask=move(self.attention_mask),
            token_type_ids=move(self.token_type_ids),
        )


class StageModule(nn.Module):
    """One virtual stage: its modules under their full-model paths, and the family's forward.

    ``forward(x, mb)``: on the first stage ``x`` is None and the tokens come from ``mb``; other
    stages take the hidden states (B, S, H); with ``sequence_parallel`` (B, S / tp, H), this tp
    rank's block of the sequence (the first stage splits its embeddings, the last all-gathers
    before the head). Middle stages return hidden states, the last stage
    the head's output (logits; vocab-local logits when the head is split without gather).
    ``activation_checkpointing`` (set by `build_stages` from the plan's train block): recompute
    each block's forward in backward instead of keeping its activations.
    """

    activation_checkpointing: bool = False
    # Set by `build_stages` from ``plan.sequence_parallel`` (tp > 1): the hidden states between
    # blocks, and between stages, are this tp rank's block of the sequence (dim 1).
    sequence_parallel: bool = False

    def __init__(
        self,
        assignment: StageAssignment,
        num_stages: int,
        adapter: StageAdapter,
        shell: nn.Module,
        tp_group: Any,
        block_names: Sequence[str],
    ) -> None:
        super().__init__()
        self.assignment = assignment
        self.num_stages = num_stages
        self.adapter = adapter
        self.tp_group = tp_group
        self.block_names = tuple(block_names)
        # hf_pretrained: parameters the checkpoint does not hold (a new head), left at their init
        self.pretrained_kept: tuple[str, ...] = ()
        # The partition (start, end of the real entries) of a head split without gather_output.
        self.head_partition: Any = None
        # A shallow copy of the full model's root object that shares this module's children,
        # parameters and buffers: adapters read its config and may call its methods (the
        # generic decoder's embed / head). Stored outside _modules so it is not a submodule.
        shell.__dict__.update(_modules=self._modules, _parameters=self._parameters, _buffers=self._buffers)
        self.__dict__["shell"] = shell

    @property
    def stage(self) -> int:
        return self.assignment.stage

    @property
    def is_first(self) -> bool:
        return self.assignment.stage == 0

    @property
    def is_last(self) -> bool:
        return self.assignment.stage == self.num_stages - 1

    @property
    def config(self) -> Any:
        """The HF config of the model (None for python factories)."""
        return getattr(self.shell, "config", None)

    def blocks(self) -> list[nn.Module]:
        return [self.get_submodule(name) for name in self.block_names]

    def train(self, mode: bool = True) -> StageModule:
        super().train(mode)
        self.shell.training = mode
        return self

    def forward(self, x: torch.Tensor | None, mb: MicroBatch) -> torch.Tensor:
        if self.adapter.own_forward:
            return self.adapter.run_stage(self, x, mb)
        if self.is_first:
            if x is not None:
                raise ValueError(f"stage {self.stage} is the first stage: it takes its input from the microbatch, not x")
            hidden = self.adapter.embed(self, mb)
            if self.sequence_parallel:  # replicated embeddings -> this rank's sequence block
                from ppdsl.runtime.tp import scatter_seq

                hidden = scatter_seq(hidden, self.tp_group, 1)
        else:
            if x is None:
                raise ValueError(f"stage {self.stage} needs the previous stage's hidden states")
            hidden = x
        if self.block_names:
            ctx = self.adapter.context(self, self._full_like(hidden), mb)
            for block in self.blocks():
                hidden = self._run_block(block, hidden, ctx)
        if not self.is_last:
            return hidden
        if self.sequence_parallel:  # the head runs replicated on the whole sequence
            from ppdsl.runtime.tp import gather_seq_replicated

            hidden = gather_seq_replicated(hidden, self.tp_group, 1)
        return self.adapter.head(self, hidden, mb)

    def _full_like(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the adapter's ``context`` sees: under sequence parallelism a stand-in with the
        whole sequence's shape (a zero-stride view: no memory), since the masks, positions and
        rotary tables it builds from ``hidden.shape`` are for the full sequence that the
        attention modules see after their all-gather; otherwise ``hidden`` itself."""
        if not self.sequence_parallel:
            return hidden
        import torch.distributed as dist

        shape = list(hidden.shape)
        shape[1] *= dist.get_world_size(self.tp_group)
        return hidden.new_zeros(()).expand(shape)

    def _run_block(self, block: nn.Module, hidden: torch.Tensor, ctx: Any) -> torch.Tensor:
        """One block through the family adapter; with activation checkpointing (and autograd
        recording) under non-reentrant `torch.utils.checkpoint`: only the block's input is
        kept, its forward is recomputed in backward with the RNG state (dropout masks) and
        autocast state of the original forward. Non-reentrant recomputation happens inside
        whichever backward call first needs the block's saved tensors, once per call, so it
        composes with the executor's split backward (``backward_input`` recomputes, and
        ``backward_weight`` recomputes again for its own ``autograd.grad``)."""
        if self.activation_checkpointing and torch.is_grad_enabled():
            from torch.utils.checkpoint import checkpoint

            return checkpoint(
                self.adapter.run_block, self, block, hidden, ctx, use_reentrant=False, preserve_rng_state=True
            )
        return self.adapter.run_block(self, block, hidden, ctx)

    def loss(self, output: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        """Scalar mean loss of one microbatch (last stage only)."""
        if not self.is_last:
            raise ValueError(f"stage {self.stage} is not the last stage; only the last stage computes the loss")
        return self.adapter.loss(self, output, mb)

    def extra_repr(self) -> str:
        a = self.assignment
        return f"stage={a.stage}, rank={a.rank}, chunk={a.chunk}, blocks=[{a.block_start}, {a.block_stop})"


class _Container(nn.Module):
    """An intermediate path component (``transformer`` on a middle stage); never called."""


# ---------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------


def build_skeleton(model: ModelRef) -> nn.Module:
    """The full model with parameters on the meta device and buffers real on the CPU."""
    from ppdsl.core.build import ModelLoadError, build_model

    with _params_on_meta():
        try:
            # list values back as lists (the plan holds them as tuples; strict HF configs refuse those)
            config = {k: _as_lists(v) for k, v in model.config_dict.items()}
            return build_model(model.kind, model.target, config, device="cpu")
        except ModelLoadError as exc:
            raise ValueError(str(exc)) from None


def _as_lists(value: Any) -> Any:
    return [_as_lists(v) for v in value] if isinstance(value, tuple) else value


def build_stages(plan: Plan, pp_rank: int, tp_group: Any, device: torch.device, seed: int) -> list[StageModule]:
    """This pipeline rank's stages, in model order, materialised on ``device`` and initialised
    deterministically from ``seed``; tensor-parallel replacements applied when ``plan.mesh.tp``
    > 1 (``tp_group`` is then this rank's tensor-parallel group; None means tp = 1)."""
    _check_request(plan, pp_rank, tp_group)
    refusal = run_refusal(plan.model.kind, plan.model.family, plan.model.target)
    if refusal is not None:  # the launcher refuses first; a hand-made plan gets the same answer
        raise ValueError(refusal)
    adapter = get_adapter(plan.model.family)
    adapter.check_layout(plan)
    skeleton = build_skeleton(plan.model)
    _check_paths(skeleton, plan)
    rule = adapter.init_rule(skeleton, plan.model)
    groups = list(_skeleton_facts(plan, skeleton).tied_groups)  # before the stages change the skeleton
    tied = _tied_map(skeleton, groups)
    memo: dict[int, nn.Parameter] = {}  # one materialised Parameter per meta Parameter (keeps ties)
    stages = [_assemble_stage(plan, a, adapter, skeleton) for a in plan.stages_of(pp_rank)]
    for stage in stages:
        adapter.prepare(stage, plan, skeleton)
    for stage in stages:
        stage.activation_checkpointing = bool(plan.train.activation_checkpointing)
        stage.sequence_parallel = bool(plan.sequence_parallel) and plan.mesh.tp > 1
    for stage in stages:
        _materialize(stage, torch.device(device), memo)
    for stage in stages:
        init_module_params("", stage, seed, rule, tied)
    if plan.mesh.tp > 1:
        for stage in stages:
            _apply_tensor_parallel(stage, plan, adapter, tp_group)
        _retie(stages, groups)
    if plan.model.kind == "hf_pretrained":  # after sharding: a tp rank reads only its slices
        for stage in stages:
            report = load_pretrained(stage, plan.model.target, skeleton, tied)
            _refuse_blocks_without_weights(report.kept, plan.blocks, plan.model.target)
            stage.pretrained_kept = tuple(report.kept)
    return stages


def build_reference_model(model: ModelRef, device: torch.device, seed: int) -> nn.Module:
    """The whole model in one process with the same per-parameter init as `build_stages`
    (ties kept as one Parameter): the single-process reference of the equivalence tests."""
    adapter = get_adapter(model.family)
    skeleton = build_skeleton(model)
    tied = _tied_map(skeleton, _tied_groups(skeleton))
    _materialize(skeleton, torch.device(device), {})
    init_module_params("", skeleton, seed, adapter.init_rule(skeleton, model), tied)
    if model.kind == "hf_pretrained":
        report = load_pretrained(skeleton, model.target, skeleton, tied)
        blocks = get_adapter(model.family).blocks
        if blocks is not None:
            _refuse_blocks_without_weights(report.kept, blocks, model.target)
    return skeleton


@attrs.frozen
class _SkeletonFacts:
    """What the rest of a rank asks of the whole (meta) model, read once from the skeleton
    `build_stages` builds, before its stages take the skeleton's modules over."""

    tied_groups: tuple[tuple[str, ...], ...]
    hidden: int | None
    hidden_error: str | None  # why the hidden size cannot be told (raised when asked)

    def hidden_size(self) -> int:
        if self.hidden is None:
            raise ValueError(self.hidden_error)
        return self.hidden


_FACTS: dict[Plan, _SkeletonFacts] = {}  # one meta model build per plan and process


def _skeleton_facts(plan: Plan, skeleton: nn.Module | None = None) -> _SkeletonFacts:
    facts = _FACTS.get(plan)
    if facts is None:
        skeleton = skeleton if skeleton is not None else build_skeleton(plan.model)
        try:
            hidden, error = get_adapter(plan.model.family).hidden_size(skeleton, plan), None
        except ValueError as exc:
            hidden, error = None, str(exc)
        facts = _SkeletonFacts(tuple(_tied_groups(skeleton)), hidden, error)
        if len(_FACTS) >= 8:
            _FACTS.pop(next(iter(_FACTS)))
        _FACTS[plan] = facts
    return facts


def _refuse_blocks_without_weights(kept: Sequence[str], blocks: str, directory: str) -> None:
    """A new head may start from its init; a block may not (a config with more layers than the
    checkpoint, or keys named otherwise): that would be a silently half-random model."""
    missing = [n for n in kept if n.startswith(blocks + ".")]
    if missing:
        raise ValueError(
            f"hf_pretrained: the checkpoint in '{directory}' holds no tensor for {len(missing)} parameter(s) of the "
            f"blocks, e.g. {', '.join(missing[:3])}: does the config ask for more layers than it has, or does "
            "it name its tensors differently?"
        )


def tied_parameter_groups(plan: Plan) -> list[tuple[str, ...]]:
    """Names of parameters that are one tensor in the full model (canonical name first): they
    must hold equal values and, after backward, the sum of their gradients."""
    return list(_skeleton_facts(plan).tied_groups)


def tied_parameter_ranks(plan: Plan, names: Sequence[str]) -> tuple[int, ...]:
    """The pipeline ranks holding any of ``names`` (ascending): the ranks whose gradients for a
    tied group must be all-reduced. A single rank means nothing to reduce."""
    ranks = set()
    for assignment in plan.stages:
        paths = stage_module_paths(plan, assignment)
        if any(_under_any(name, paths) for name in names):
            ranks.add(assignment.rank)
    return tuple(sorted(ranks))


def stage_module_paths(plan: Plan, assignment: StageAssignment) -> tuple[str, ...]:
    """The parameter-holding module paths of one virtual stage: first, blocks, last."""
    blocks = tuple(f"{plan.blocks}.{i}" for i in range(assignment.block_start, assignment.block_stop))
    return (*assignment.first, *blocks, *assignment.last)


def activation_shape(plan: Plan) -> tuple[int, ...]:
    """Shape of the tensor a stage sends to the next for one microbatch: (microbatch_size,
    seq_len, hidden). The same for every stage boundary. With sequence parallelism a stage sends
    its tp rank's block of the sequence: seq_len / tp."""
    hidden = _skeleton_facts(plan).hidden_size()
    seq = plan.train.seq_len
    if plan.sequence_parallel and plan.mesh.tp > 1:
        _check_sequence_split(plan)
        seq //= plan.mesh.tp
    return (plan.train.microbatch_size, seq, hidden)


def activation_dtype(plan: Plan) -> torch.dtype:
    """The dtype of the tensors passed between stages. Parameters are kept in fp32 and lower
    precision runs under autocast, where the residual stream (embeddings, residual adds,
    LayerNorm outputs) stays fp32 in every supported family."""
    return torch.float32


def rank_named_parameters(stages: Sequence[nn.Module]) -> dict[str, nn.Parameter]:
    """All parameters of a rank's stages, each once (a Parameter shared by two stages, such as
    a tied embedding under a V schedule, appears under its first name): for the optimizer."""
    out: dict[str, nn.Parameter] = {}
    seen: set[int] = set()
    for stage in stages:
        for name, param in stage.named_parameters():
            if id(param) not in seen:
                seen.add(id(param))
                out[name] = param
    return out


# ---------------------------------------------------------------------------------------------
# Skeleton
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _params_on_meta() -> Iterator[None]:
    """Every parameter registered while active is moved to the meta device right away (its
    CPU allocation lives only until then); buffers and everything else stay real. Like
    accelerate's ``init_empty_weights(include_buffers=False)``."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and not param.is_meta:
            p = module._parameters[name]
            module._parameters[name] = type(p)(p.to("meta"), requires_grad=p.requires_grad)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def _tied_groups(model: nn.Module) -> list[tuple[str, ...]]:
    by_id: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
    return [tuple(names) for names in by_id.values() if len(names) > 1]


def _tied_map(model: nn.Module, groups: Sequence[tuple[str, ...]]) -> dict[str, tuple[str, nn.Module]]:
    """Every non-canonical tied name -> (canonical name, the canonical owner module)."""
    out = {}
    for names in groups:
        canonical = names[0]
        owner = model.get_submodule(canonical.rpartition(".")[0])
        for name in names[1:]:
            out[name] = (canonical, owner)
    return out


def _check_request(plan: Plan, pp_rank: int, tp_group: Any) -> None:
    if not 0 <= pp_rank < plan.mesh.pp:
        raise ValueError(f"pipeline rank {pp_rank} is outside the plan's pp = {plan.mesh.pp}")
    if not plan.stages_of(pp_rank):
        raise ValueError(f"the plan assigns no stage to pipeline rank {pp_rank}")
    if plan.sequence_parallel and plan.mesh.tp > 1:
        _check_sequence_split(plan)
    if plan.mesh.tp > 1:
        if tp_group is None:
            raise ValueError(f"the plan has tp = {plan.mesh.tp}: build_stages needs the tensor-parallel group")
        import torch.distributed as dist

        if dist.get_world_size(tp_group) != plan.mesh.tp:
            raise ValueError(
                f"the tensor-parallel group has {dist.get_world_size(tp_group)} ranks, the plan tp = {plan.mesh.tp}"
            )
    for r in plan.tp:
        if r.style not in TP_STYLES:
            raise ValueError(f"{r.path}: unknown tensor-parallel style '{r.style}'")


def _check_sequence_split(plan: Plan) -> None:
    if plan.train.seq_len % plan.mesh.tp != 0:
        raise ValueError(
            "sequence_parallel: " + not_divisible_by_tp(f"seq_len = {plan.train.seq_len}", plan.mesh.tp)
        )


def _check_paths(skeleton: nn.Module, plan: Plan) -> None:
    blocks = _submodule(skeleton, plan.blocks, "blocks")
    if not isinstance(blocks, (nn.ModuleList, nn.Sequential)):
        raise ValueError(f"blocks '{plan.blocks}' is a {type(blocks).__name__}, not an nn.ModuleList / nn.Sequential")
    if plan.num_blocks != len(blocks):
        raise ValueError(f"the plan counts {plan.num_blocks} blocks, '{plan.blocks}' has {len(blocks)}")
    for a in plan.stages:
        if not 0 <= a.block_start <= a.block_stop <= len(blocks):
            raise ValueError(f"stage {a.stage}: blocks [{a.block_start}, {a.block_stop}) outside 0..{len(blocks)}")
        for path in (*a.first, *a.last):
            _submodule(skeleton, path, f"stage {a.stage}")
            if path == plan.blocks or _under(path, plan.blocks) or _under(plan.blocks, path):
                raise ValueError(f"stage {a.stage}: '{path}' overlaps the block list '{plan.blocks}'")
    for r in plan.tp:
        _submodule(skeleton, r.path, "tensor_parallel")


def _submodule(model: nn.Module, path: str, where: str) -> nn.Module:
    try:
        return model.get_submodule(path)
    except AttributeError:
        raise ValueError(f"{where}: {type(model).__name__} has no module '{path}'") from None


def _under(path: str, prefix: str) -> bool:
    return path.startswith(prefix + ".")


def _under_any(name: str, paths: Sequence[str]) -> bool:
    return any(name == p or _under(name, p) for p in paths)


# ---------------------------------------------------------------------------------------------
# Assembling and materialising a stage
# ---------------------------------------------------------------------------------------------


def _has_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _assemble_stage(plan: Plan, assignment: StageAssignment, adapter: StageAdapter, skeleton: nn.Module) -> StageModule:
    block_ids = range(assignment.block_start, assignment.block_stop)
    shell = copy.copy(skeleton)
    stage = StageModule(
        assignment,
        num_stages=len(plan.stages),
        adapter=adapter,
        shell=shell,
        tp_group=None,  # set by _apply_tensor_parallel when tp > 1
        block_names=[f"{plan.blocks}.{i}" for i in block_ids],
    )
    keep = set(assignment.first) | set(assignment.last)
    _populate(stage, skeleton, "", keep, plan.blocks, block_ids, adapter.own_forward)
    for name, buf in skeleton._buffers.items():
        if buf is not None:
            stage.register_buffer(name, buf, persistent=name not in skeleton._non_persistent_buffers_set)
    return stage


def _populate(dst: nn.Module, src: nn.Module, prefix: str, keep: set[str], blocks: str, block_ids: range,
              real_containers: bool = False) -> None:
    """Copy into ``dst`` the part of ``src``'s subtree this stage needs (see module docstring).
    ``real_containers`` (the own forward, which calls them): an intermediate module is a shallow
    copy of the real one holding only the stage's part, not a `_Container`."""
    if any(p is not None for p in src._parameters.values()):
        where = f"'{prefix}'" if prefix else f"the model root ({type(src).__name__})"
        raise ValueError(f"{where} has parameters of its own, but its submodules are split across stages")
    for name, child in src.named_children():
        path = f"{prefix}.{name}" if prefix else name
        if path in keep:
            dst.add_module(name, child)
        elif path == blocks:
            if len(block_ids):
                dst.add_module(name, nn.ModuleDict({str(i): child[i] for i in block_ids}))
        elif not _has_params(child):
            dst.add_module(name, copy.deepcopy(child))
        elif any(_under(k, path) for k in keep) or (_under(blocks, path) and len(block_ids)):
            sub = _real_container(child) if real_containers else _Container()
            for buf_name, buf in child._buffers.items():
                if buf is not None:
                    sub.register_buffer(buf_name, buf, persistent=buf_name not in child._non_persistent_buffers_set)
            _populate(sub, child, path, keep, blocks, block_ids, real_containers)
            dst.add_module(name, sub)


def _real_container(module: nn.Module) -> nn.Module:
    """A shallow copy of ``module`` with its own, empty, module / parameter / buffer / hook tables."""
    sub = copy.copy(module)
    for table in ("_modules", "_parameters", "_buffers", "_forward_hooks", "_forward_pre_hooks",
                  "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called",
                  "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks", "_load_state_dict_pre_hooks"):
        if table in module.__dict__:
            sub.__dict__[table] = type(module.__dict__[table])()
    sub.__dict__["_non_persistent_buffers_set"] = set()
    return sub


def _materialize(module: nn.Module, device: torch.device, memo: dict[int, nn.Parameter]) -> None:
    """Replace meta parameters by uninitialised ones on ``device`` (one per meta Parameter, via
    ``memo``, so tied parameters stay one object); move buffers to ``device``."""
    for m in module.modules():
        for name, param in list(m._parameters.items()):
            if param is None:
                continue
            new = memo.get(id(param))
            if new is None:
                assert param.is_meta, f"parameter {name} of {type(m).__name__} is not on meta"
                new = nn.Parameter(torch.empty_like(param, device=device), requires_grad=param.requires_grad)
                memo[id(param)] = new
            m._parameters[name] = new
        for name, buf in list(m._buffers.items()):
            if buf is not None:
                assert not buf.is_meta, f"buffer {name} of {type(m).__name__} is on meta"
                m._buffers[name] = buf.to(device)


# ---------------------------------------------------------------------------------------------
# Tensor parallelism
# ---------------------------------------------------------------------------------------------


def _shard(module: nn.Module, r: TpReplacement, group: Any, sequence_parallel: bool = False) -> nn.Module | None:
    """``sequence_parallel``: the layer sits in a block, where the hidden states are split along
    the sequence (column: all-gather its input; row: reduce-scatter its output)."""
    from ppdsl.runtime.tp import shard_column, shard_row, shard_vocab_embedding

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


def _apply_tensor_parallel(stage: StageModule, plan: Plan, adapter: StageAdapter, group: Any) -> None:
    from ppdsl.runtime.tp import SUPPORTED_ATTENTION, ColumnParallelLinear, localize_attention, replace_module

    stage.tp_group = group
    mine = [r for r in plan.tp if _under_any(r.path, _held_paths(stage))]
    kv_heads = _replicated_kv_heads(stage, adapter, plan)
    for r in mine:
        if kv_heads and r.style == "column" and _is_kv_projection(r.path, stage.block_names, adapter):
            from ppdsl.runtime.tp.kv_replicated import replicate_kv_heads

            replicate_kv_heads(stage.get_submodule(r.path), kv_heads, group)
            continue
        in_block = stage.sequence_parallel and _under_any(r.path, stage.block_names)
        new = _shard(stage.get_submodule(r.path), r, group, sequence_parallel=in_block)
        if new is not None:
            replace_module(stage, r.path, new)
    # heads become local only where a projection's output stays split (a gathered one is whole)
    column_paths = [r.path for r in mine if r.style == "column" and not r.gather_output]
    for block_name in stage.block_names:
        for sub_path, sub in stage.get_submodule(block_name).named_modules(prefix=block_name):
            if type(sub).__name__ not in SUPPORTED_ATTENTION:
                continue
            if any(type(c).__name__ in SUPPORTED_ATTENTION for c in sub.children()):
                continue  # a wrapper (BertAttention): its inner module is localised
            if any(_under(p, sub_path) for p in column_paths):
                localize_attention(sub, plan.mesh.tp)
                _mark_head_local_params(sub)
    if stage.sequence_parallel:
        for block_name in stage.block_names:
            _sequence_parallel_block(stage.get_submodule(block_name), block_name, group)
    if stage.is_last:
        head = stage.get_submodule(adapter.head_path(plan))
        if isinstance(head, ColumnParallelLinear) and not head.gather_output:
            stage.head_partition = head.partition


def _is_sp_region(module: nn.Module) -> bool:
    """A module whose forward starts tensor-parallel work: it has a column-parallel child (an
    attention module, an MLP). Such modules read the sequence length from their input
    (``hidden.shape[:-1]`` to split heads and merge them back), so under sequence parallelism
    their input is all-gathered at their entry rather than inside each column layer."""
    from ppdsl.runtime.tp import ColumnParallelLinear

    return any(isinstance(c, ColumnParallelLinear) for c in module.children())


def _gather_input_hook(group: Any) -> Any:
    from ppdsl.runtime.tp import gather_seq

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
    from ppdsl.runtime.tp import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

    regions: list[tuple[str, nn.Module]] = []

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            path = f"{prefix}.{name}"
            if _is_sp_region(child):
                regions.append((path, child))
            elif not isinstance(child, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)):
                visit(path, child)

    visit(block_name, block)
    if not regions and not any(isinstance(m, ColumnParallelLinear) for m in block.modules()):
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
    from ppdsl.runtime.tp import SUPPORTED_ATTENTION

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
    tp_layers = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)
    for m in block.modules():
        if id(m) in gathered or isinstance(m, tp_layers):
            continue
        for p in m.parameters(recurse=False):
            p.sequence_parallel = True  # type: ignore[attr-defined]


def _replicated_kv_heads(stage: StageModule, adapter: StageAdapter, plan: Plan) -> int | None:
    """The model's kv head count when the family replicates kv heads at this tp (else None)."""
    config = stage.config
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None) or heads
    if not isinstance(kv, int) or not adapter.descriptor.replicates_kv_heads(kv, plan.mesh.tp, stage.sequence_parallel):
        return None
    return kv


def _is_kv_projection(path: str, block_names: Sequence[str], adapter: StageAdapter) -> bool:
    return any(path == f"{b}.{rel}" for b in block_names for rel in adapter.descriptor.kv_projections)


def _mark_head_local_params(attention: nn.Module) -> None:
    """Replicated parameters inside a localised attention, outside its split projections (Qwen3's
    per-head q / k RMSNorms), see only this rank's heads: their gradients are partial sums over
    tp, summed by the trainer like sequence-parallel ones (``param.sequence_parallel``)."""
    from ppdsl.runtime.tp import ColumnParallelLinear, RowParallelLinear

    for m in attention.modules():
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
            continue
        for p in m.parameters(recurse=False):
            p.sequence_parallel = True  # type: ignore[attr-defined]


def _retie(stages: Sequence[StageModule], groups: Sequence[tuple[str, ...]]) -> None:
    """After sharding, make the tied copies this rank holds one Parameter again."""
    for names in groups:
        members = [
            (stage, name)
            for name in names
            for stage in stages
            if _under_any(name, _held_paths(stage))
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
                    "(vocab and column with the same pad_to)"
                )
            setattr(owner, local, shared)


def _held_paths(stage: StageModule) -> tuple[str, ...]:
    """The parameter-holding module paths of a built stage."""
    a = stage.assignment
    return (*a.first, *stage.block_names, *a.last)
