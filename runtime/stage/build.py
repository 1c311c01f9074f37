"""Build only this rank's part of the model: one `StageModule` per virtual stage.

Recipe (`build_stages`), one module per step:

1. (`runtime.stage.skeleton`) Build the whole model as a *skeleton*: every parameter on the meta device (nothing
   allocated), every buffer real on the CPU (RoPE ``inv_freq``, BERT ``position_ids`` are
   computed at construction and are not in any checkpoint, so they must not be meta).
2. (`runtime.stage.split`) For each virtual stage of this pipeline rank keep: the plan's ``first`` modules (first stage),
   blocks ``[block_start, block_stop)``, the ``last`` modules (last stage), and a copy of every
   parameter-free module outside the block list (Llama's ``model.rotary_emb``, GPT-2's
   ``transformer.drop``, BERT's ``dropout``) since any stage may need one.
3. Materialise the kept parameters on ``device`` and fill them with `init_module_params`, keyed
   by full parameter name: the union of all ranks' parts equals `build_reference_model`, bit for
   bit. Tied parameters (GPT-2 wte / lm_head) are filled under their canonical name.
4. For ``hf_pretrained`` models read the rank's parameters from the directory's safetensors
   (`ppdsl.runtime.stage.weights.load_pretrained`): only the tensors its stages hold.

The stages then hold the whole model's weights for their modules; `runtime.parallel.parallelize`
divides them (tensor, sequence, expert, context parallelism, FSDP). Each tp rank reads the
whole tensors of its stages: they are materialised whole before the split anyway (the init is
placement-independent because it is computed whole), so reading slices would save reads, not memory.

A `StageModule` registers its modules under the same paths as in the full model
(``transformer.h.5.attn.c_attn``), so parameter names, state-dict keys and TP paths are the full
model's; the block list becomes an ``nn.ModuleDict`` keyed by the original indices.

Tied parameters: within one rank the copies are one ``nn.Parameter`` object (also across that
rank's stages, e.g. rank 0 under a V schedule holds both wte and lm_head), so its gradient is
already the sum; between ranks the executor all-reduces the gradients of each group of
`tied_parameter_groups` over the pipeline ranks `tied_parameter_ranks` names.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ppdsl.lowering.plan import ModelRef, Plan, StageAssignment
from ppdsl.runtime.stage.adapters import stage_adapter as get_adapter
from ppdsl.runtime.stage.init import init_module_params
from ppdsl.runtime.train.optim import parameter_dtype
from ppdsl.runtime.stage.weights import load_pretrained

from ppdsl.core.module_paths import under_any
from ppdsl.runtime.stage.skeleton import build_skeleton, check_paths, check_request, check_sequence_split, tied_groups, tied_map
from ppdsl.runtime.stage.module import MicroBatch, StageModule
from ppdsl.runtime.stage.split import assemble_stage, materialize

__all__ = [
    "MicroBatch",
    "StageModule",
    "activation_dtype",
    "activation_shape",
    "boundary_shapes",
    "build_reference_model",
    "build_skeleton",
    "build_stages",
    "rank_named_parameters",
    "stage_module_paths",
    "tied_parameter_groups",
    "tied_parameter_ranks",
]


# ---------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------


def build_stages(plan: Plan, pp_rank: int, device: torch.device, seed: int) -> list[StageModule]:
    """This pipeline rank's stages, in model order, materialised on ``device`` and holding the
    whole model's weights for them: initialised deterministically from ``seed``, then the
    pretrained ones read where the model is ``hf_pretrained``. Nothing is divided yet:
    `runtime.parallel.parallelize.parallelize` applies the plan's parallelisms to them."""
    check_request(plan, pp_rank)
    adapter = get_adapter(plan.model.family)
    adapter.check_layout(plan)
    skeleton = build_skeleton(plan.model)
    check_paths(skeleton, plan)
    rule = adapter.init_rule(skeleton, plan.model)
    tied = tied_map(skeleton, plan.model.tied or ())  # before the stages change the skeleton
    memo: dict[int, nn.Parameter] = {}  # one materialised Parameter per meta Parameter (keeps ties)
    stages = [assemble_stage(plan, a, adapter, skeleton) for a in plan.stages_of(pp_rank)]
    for stage in stages:
        adapter.prepare(stage, plan, skeleton)
    for stage in stages:
        materialize(stage, torch.device(device), memo, parameter_dtype(plan.train.precision))
    for stage in stages:
        init_module_params("", stage, seed, rule, tied)
    if plan.model.kind == "hf_pretrained":
        for stage in stages:
            report = load_pretrained(stage, plan.model.target, skeleton, tied)
            _refuse_blocks_without_weights(report.kept, plan.blocks, plan.model.target)
            stage.pretrained_kept = tuple(report.kept)
    return stages


def build_reference_model(model: ModelRef, device: torch.device, seed: int,
                          dtype: torch.dtype = torch.float32) -> nn.Module:
    """The whole model in one process with the same per-parameter init as `build_stages`
    (ties kept as one Parameter): the single-process reference of the equivalence tests.
    ``dtype``: the parameters' (`parameter_dtype` of the plan's precision)."""
    adapter = get_adapter(model.family)
    skeleton = build_skeleton(model)
    tied = tied_map(skeleton, tied_groups(skeleton))
    materialize(skeleton, torch.device(device), {}, dtype)
    init_module_params("", skeleton, seed, adapter.init_rule(skeleton, model), tied)
    if model.kind == "hf_pretrained":
        report = load_pretrained(skeleton, model.target, skeleton, tied)
        blocks = get_adapter(model.family).blocks
        if blocks is not None:
            _refuse_blocks_without_weights(report.kept, blocks, model.target)
    return skeleton


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


def tied_parameter_groups(plan: Plan, stages: Sequence[nn.Module]) -> list[tuple[str, ...]]:
    """Names of parameters that are one tensor in the full model (canonical name first): they
    must hold equal values and, after backward, the sum of their gradients. The model's ties, as
    check found them (`ModelRef.tied`), then each trained parameter of a module every stage holds
    (`pipeline.shared`), alone: one tensor on every pipeline rank. ``stages``: this rank's (each
    holds the shared modules, so every rank names the same ones)."""
    ties = plan.model.tied or ()
    in_ties = {n for names in ties for n in names}
    shared = plan.stages[0].shared if plan.stages else ()
    alone = sorted({n for stage in stages for n, param in stage.named_parameters(remove_duplicate=False)
                    if under_any(n, shared) and n not in in_ties and param.requires_grad})
    return [*ties, *((n,) for n in alone)]


def tied_parameter_ranks(plan: Plan, names: Sequence[str]) -> tuple[int, ...]:
    """The pipeline ranks holding any of ``names`` (ascending): the ranks whose gradients for a
    tied group must be all-reduced. A single rank means nothing to reduce."""
    ranks = set()
    for assignment in plan.stages:
        paths = stage_module_paths(plan, assignment)
        if any(under_any(name, paths) for name in names):
            ranks.add(assignment.rank)
    return tuple(sorted(ranks))


def stage_module_paths(plan: Plan, assignment: StageAssignment) -> tuple[str, ...]:
    """The parameter-holding module paths of one virtual stage: first, shared, blocks, last."""
    blocks = tuple(f"{plan.blocks}.{i}" for i in range(assignment.block_start, assignment.block_stop))
    return (*assignment.first, *assignment.shared, *blocks, *assignment.last)


def activation_shape(plan: Plan) -> tuple[int, ...]:
    """Shape of the tensor a stage sends to the next for one microbatch: (microbatch_size,
    seq_len, hidden). The same for every stage boundary. With sequence parallelism a stage sends
    its tp rank's block of the sequence: seq_len / tp; with context parallelism its cp rank's
    tokens: seq_len / cp."""
    hidden = plan.model.hidden
    if hidden is None:
        raise ValueError(f"the plan does not say the width of {plan.model.target}'s hidden state: ppdsl cannot tell it "
                         "from the model's config or its first module")
    seq = plan.train.seq_len // plan.mesh.cp  # context parallelism: this cp rank's tokens
    if plan.sequence_parallel and plan.mesh.tp > 1:
        check_sequence_split(plan)
        seq //= plan.mesh.tp
    return (plan.train.microbatch_size, seq, hidden)


def boundary_shapes(plan: Plan) -> tuple[tuple[int, ...], ...]:
    """The shape of what each stage sends to the next, by sending stage: the plan's boundaries as
    check's trace measured them (`Plan.boundaries`), else (a family's model)
    `activation_shape` at every boundary."""
    stages = len(plan.stages)
    if plan.boundaries:  # several tensors travel as one, flattened per sample (core/own_cut.py pack_boundary)
        return tuple(tuple(b.tensors[0].shape) if len(b.tensors) == 1 else (b.tensors[0].shape[0], b.numel //
                     b.tensors[0].shape[0]) for b in plan.boundaries)
    return (tuple(activation_shape(plan)),) * (stages - 1)


def activation_dtype(plan: Plan) -> torch.dtype:
    """The dtype of the tensors passed between stages: the parameters'. Lower precision runs
    under autocast over fp32 parameters, where the residual stream (embeddings, residual adds,
    LayerNorm outputs) stays fp32 in every supported family."""
    return parameter_dtype(plan.train.precision)


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
