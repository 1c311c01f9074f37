"""CheckedSpec + world size -> Plan. Pure Python: model facts come in as plain data.

Lowering refuses nothing: every spec check accepts (with dsl/plan_needs.py's E0429 for what a plan
needs beyond a valid spec) lowers. Where lowering relies on a fact check proved, it states it as
an `assert` that names the code proving it; one that fails is a bug in ppdsl, which the command
line reports as `ppdsl: internal error` (tests/test_lowering_refusals.py holds that lowering
raises no other error).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

from ppdsl.dsl.exact import Expr
from ppdsl.dsl.families import by_name
from ppdsl.dsl.blocks import block_count
from ppdsl.dsl.kv_parts import kv_parts
from ppdsl.dsl.patterns import expand, match
from ppdsl.dsl.spec import WORLD, Spec
from .plan import (
    CheckpointPlan, DataPlan, EvalPlan, ExpertModule, LocalHeads, LrSchedulePlan, MeshLayout, ModelRef, OptimizerPlan, OwnForward, Plan,
    PredictedStep, StageAssignment, TpReplacement, TrainPlan,
)
from .boundaries import boundaries
from .costs import CostProfile, Layout, measured_schedule, measured_split, predict
from .rank_memory import predicted_memory
from ppdsl.core.config_tree import frozen
from ppdsl.core.hidden_width import hidden_width
from ppdsl.core.labels import is_classification
from ppdsl.core.task_loss import own_task
from ppdsl.core.schedules import Schedule, generate
from .stages import check_ranges, cost_split, even_split
from .tp_partial import tp_partial

if TYPE_CHECKING:
    from ppdsl.dsl.introspect import ModelInfo


def _at(v: Any, world: int, what: str) -> int:
    if isinstance(v, Expr):
        v = v.subs(WORLD, world)
        # E0110, E0202 and E0302 prove the mesh and batch sizes whole at every world check accepts
        assert isinstance(v, Expr) and v.is_Integer, f"{what} is not a whole number at world = {world}: {v}"
        return int(v)
    return int(v)


def lower(spec: Spec, world: int, model_info: ModelInfo | None = None, split: Sequence[tuple[int, int]] | None = None) -> Plan:
    """`model_info` (a ppdsl.dsl.introspect.ModelInfo) gives real block counts, module paths and
    costs, and each rank's predicted memory (`Plan.memory`); without it, block counts come from
    the config and patterns expand structurally. `split`: block ranges per virtual stage that
    replace the spec's (`ppdsl tune`'s measured split)."""
    tp, pp, dp, ep, cp = (_at(getattr(spec.mesh, k), world, f"mesh.{k}") for k in ("tp", "pp", "dp", "ep", "cp"))
    mesh = MeshLayout(world, dp, pp, tp, ep, cp)
    p = spec.pipeline
    own = _own_forward(spec, model_info)
    chunks = _at(p.chunks, world, "chunks")
    m = _at(p.microbatches, world, "microbatches")
    num_blocks = _num_blocks(spec, model_info)
    num_stages = pp * chunks
    train = _train(spec, world)
    profile = _profile(spec, num_blocks)
    if split is not None or p.split is not None:
        ranges = list(split if split is not None else p.split)
        check_ranges(ranges, num_blocks, num_stages)
    elif p.balance == "measured":
        assert profile is not None, "balance = measured without pipeline.profile (E0313)"
        ranges = measured_split(profile, num_stages, train.microbatch_size, tp, train.activation_checkpointing)
    elif p.balance == "cost":
        costs, first, last = _costs(spec, model_info, num_blocks)
        ranges = cost_split(costs, num_stages, first, last)
    else:
        ranges = even_split(num_blocks, num_stages)
    layout = Layout(tp, pp, dp, p.style, chunks, m, train.activation_checkpointing,
                    spec.tensor_parallel.sequence_parallel and tp > 1, zero=train.zero,
                    reshard_after_forward=train.reshard_after_forward, cp=cp, ep=ep)
    # with a profile, the zero-bubble styles order their actions on its measured costs; the
    # workers run the plan's action lists, so they never regenerate them
    schedule = (generate(p.style, pp, m, chunks) if profile is None
                else measured_schedule(profile, layout, train.global_batch, world, ranges))
    policy = _tp_policy(spec, model_info, num_blocks, tp) if tp > 1 else ()
    stages = []
    for s, (a, b) in enumerate(ranges):
        rank = schedule.stage_ranks[s]
        chunk = sum(1 for t in range(s) if schedule.stage_ranks[t] == rank)
        stages.append(StageAssignment(
            stage=s, rank=rank, chunk=chunk, block_start=a, block_stop=b,
            first=p.first if s == 0 else (), last=p.last if s == num_stages - 1 else (), shared=p.shared))
    plan = Plan(
        spec_file=spec.file,
        model=ModelRef(spec.model.source.kind, spec.model.source.target,
                       tuple(sorted((k, _plain(v)) for k, v in spec.model.config.items())), spec.model.family,
                       tuple(sorted(spec.model.dims.items())),
                       document_masks=spec.train.packing == "documents" and bool(getattr(model_info, "document_masks", False)),
                       hidden=_hidden(spec, model_info, own), tied=_tied(model_info), task=_task(spec, model_info)),
        mesh=mesh, blocks=p.blocks, num_blocks=num_blocks, stages=tuple(stages),
        tp=policy,
        sequence_parallel=spec.tensor_parallel.sequence_parallel and tp > 1,
        schedule=schedule, train=train,
        predicted=None if profile is None else _predicted(spec.pipeline.profile or "", profile, layout, train,
                                                          world, ranges, schedule),
        own_forward=own,
        experts=_experts(spec, model_info, ep),
        context_attention=_context_attention(model_info, cp),
        tp_partial=tp_partial(policy, model_info) if own is not None else (),
        tp_local_heads=_local_heads(spec, model_info, tp) if own is not None and tp > 1 else None,
    )
    plan = attrs.evolve(plan, boundaries=boundaries(model_info, plan.stages, mesh, train, plan.sequence_parallel,
                                                    spec.model.dims.get("hidden")) if own is not None else ())
    return attrs.evolve(plan, memory=predicted_memory(plan, model_info, spec.model.dims.get("hidden")))


def _experts(spec: Spec, info: ModelInfo | None, ep: int) -> tuple[ExpertModule, ...]:
    """ep > 1: the experts modules check found on the built model (E0242 / E0243 proved them);
    none without the model (`ppdsl schedule`, `plan --no-model`: a plan the runtime refuses)."""
    if ep == 1 or info is None:
        return ()
    found = tuple(ExpertModule(path, m.experts) for path, m in info.modules.items() if m.experts)
    assert found and all(e.experts % ep == 0 for e in found), (found, ep)  # E0242, E0243
    return found


def _context_attention(info: ModelInfo | None, cp: int) -> tuple[str, ...]:
    """cp > 1: the attention modules check's probe saw (E0246 proved every block has one); none
    without the model (`ppdsl schedule`, `plan --no-model`: a plan the runtime refuses)."""
    if cp == 1 or info is None:
        return ()
    assert info.attention is not None  # E0246
    return tuple(c.module for c in info.attention.calls)


def _own_forward(spec: Spec, info: ModelInfo | None) -> OwnForward | None:
    """Family "own": what the runtime needs of check's trace of the forward (dsl/own_layout.py)."""
    if not by_name(spec.model.family).layout_from_trace:
        return None
    layout = getattr(info, "own_layout", None)
    # without the model: E0429 (dsl/plan_needs.py); with it, E0424 for a forward not traced
    assert layout is not None and layout.ok and spec.pipeline.blocks, \
        f"{spec.model.source.target}: an own forward without its traced layout (E0429, E0424)"
    return OwnForward(layout.block_output, layout.tuple_len,
                      layout.inputs, tuple(layout.input_shape), layout.width, frozen(layout.block_plain))


def _task(spec: Spec, info: ModelInfo | None) -> str:
    """The task (ppdsl.core.task_loss.TASKS): a class running its own forward by its inputs and
    name, as its trace found them; a family's model by the family and the class."""
    layout = getattr(info, "own_layout", None)
    if by_name(spec.model.family).layout_from_trace and layout is not None:
        return own_task(info.class_name, layout.inputs)
    return "sequence_classification" if is_classification(spec.model.family, spec.model.source.kind, spec.model.source.target,
                                                         spec.model.resolved_config) else "causal_lm"


def _hidden(spec: Spec, info: ModelInfo | None, own: OwnForward | None) -> int | None:
    """The width of the hidden state the blocks pass on (`ppdsl.core.hidden_width`). None
    without the model."""
    if info is None:
        return None
    first = info.modules.get(spec.pipeline.first[0]) if spec.pipeline.first else None
    return hidden_width(own.width if own is not None else None, spec.model.dims.get("hidden"), info.config,
                        first.embedding_dim if first is not None and first.kind == "embedding" else None)


def _local_heads(spec: Spec, info: ModelInfo | None, tp: int) -> tuple[LocalHeads, ...] | None:
    """The own forward's modules whose heads become local at ``tp``, as check's proof set them
    (read back from the model facts' cache). None without the model."""
    if info is None:
        return None
    from ppdsl.dsl.own_tp_proof import local_heads

    return tuple(LocalHeads(path, tuple(tuple(c) for c in changes), sliced)
                 for path, changes, sliced in local_heads(spec, info, tp))


def _tied(info: ModelInfo | None) -> tuple[tuple[str, ...], ...] | None:
    """Each tensor the built model holds under several names: its names, canonical (first in the
    model's parameter order) first. None without the model."""
    if info is None:
        return None
    groups: dict[str, list[str]] = {}
    for canonical, alias in info.tied:
        groups.setdefault(canonical, [canonical]).append(alias)
    return tuple(tuple(names) for names in groups.values())


def _profile(spec: Spec, num_blocks: int) -> CostProfile | None:
    """The measured cost profile of pipeline.profile; check proved it fits (E0314, E0316)."""
    path = spec.pipeline.profile
    if path is None:
        return None
    from ppdsl.dsl.profile_check import load_profile

    problem = ""
    try:
        profile = load_profile(path)
    except ValueError as exc:
        problem = f"cost profile {path} {exc}"
    assert not problem, f"{problem} (E0314 read it at check)"
    assert len(profile.blocks) == num_blocks, \
        f"cost profile {path} has {len(profile.blocks)} blocks, the model has {num_blocks} (E0316)"
    return profile


def _predicted(path: str, profile: CostProfile, layout: Layout, train: TrainPlan, world: int,
               ranges: list[tuple[int, int]], schedule: Schedule) -> PredictedStep:
    pred = predict(profile, layout, train.global_batch, world, split=ranges, schedule=schedule)
    unit = generate(layout.style, layout.pp, layout.microbatches, layout.chunks)
    return PredictedStep(path, pred.step_s, pred.pipeline_s, pred.bubble, pred.stage_s, schedule != unit)


def _plain(v: Any) -> Any:
    return frozen(v)  # lists as tuples, a nested config block as a FrozenDict: the plan stays hashable


def _num_blocks(spec: Spec, info: ModelInfo | None) -> int:
    n = block_count(spec.pipeline.blocks, spec.model.dims, info)
    assert n is not None, f"the number of blocks in '{spec.pipeline.blocks}' is unknown (E0429)"
    return n


def _costs(spec: Spec, info: ModelInfo | None, n: int) -> tuple[list[float], float, float]:
    """Per-block cost (parameters), plus the first and last modules' costs."""
    p = spec.pipeline
    if info is not None:
        from ppdsl.dsl.introspect import params_under

        blocks = [float(params_under(info, f"{p.blocks}.{i}")) for i in range(n)]
        first = float(sum(params_under(info, f) for f in p.first if f in info.modules))
        last = float(sum(params_under(info, f) for f in p.last if f in info.modules))
        # a tied head (GPT-2 lm_head = wte) holds no parameters of its own but costs a vocab matmul
        for a, b in getattr(info, "tied", ()):
            if any(b.startswith(x + ".") for x in p.last):
                last += float(info.modules[a.rpartition(".")[0]].num_params or 0)
        return blocks, first, last
    d = spec.model.dims
    h = d.get("hidden", 1)
    ffn = d.get("ffn", 4 * h)
    block = float(4 * h * h + 2 * h * ffn)
    emb = float(d.get("vocab", 0) * h)
    return [block] * n, emb, emb


def _tp_policy(spec: Spec, info: ModelInfo | None, num_blocks: int, tp: int) -> tuple[TpReplacement, ...]:
    out: dict[str, TpReplacement] = {}
    blocks = spec.pipeline.blocks
    for rule in spec.tensor_parallel.rules:
        if info is not None:
            paths = match(rule.pattern, [k for k in info.modules if k])
        else:
            paths = expand(rule.pattern, lambda path: num_blocks if path == blocks else None)
        for path in paths:
            parts = kv_parts(spec, info, path, rule, tp)
            out[path] = TpReplacement(path, rule.style, rule.fused, rule.gather_output, rule.pad_to, parts)
    return tuple(out.values())


def _train(spec: Spec, world: int) -> TrainPlan:
    t = spec.train
    o, lrs = t.optimizer, t.lr_schedule
    return TrainPlan(
        global_batch=_at(t.global_batch, world, "global_batch"),
        microbatch_size=_at(spec.pipeline.microbatch_size, world, "microbatch_size"), seq_len=t.seq_len,
        steps=t.steps, seed=t.seed,
        optimizer=OptimizerPlan(o.name, o.lr, o.weight_decay, tuple(o.betas), o.eps, o.momentum),
        lr_schedule=LrSchedulePlan(lrs.name, lrs.warmup, lrs.min_lr), precision=t.precision,
        grad_clip=t.grad_clip, zero=t.zero, data=DataPlan(t.data.kind, tuple(sorted(t.data.options.items()))),
        checkpoint=CheckpointPlan(t.checkpoint.dir, t.checkpoint.every) if t.checkpoint else None,
        activation_checkpointing=t.activation_checkpointing, compile=t.compile, log_every=t.log_every,
        save_final=t.save_final,
        eval=None if t.eval is None else EvalPlan(
            DataPlan(t.eval.data.kind, tuple(sorted(t.eval.data.options.items()))), t.eval.every, t.eval.batches),
        metrics=t.metrics, peak_tflops=t.peak_tflops,
        trace=t.trace, reshard_after_forward=t.reshard_after_forward, hang_timeout=t.hang_timeout,
        on_nonfinite=t.on_nonfinite, max_nonfinite=t.max_nonfinite,
    )
