"""One rank's memory at the step's peak: the one estimate `ppdsl plan` prints per rank
(ppdsl/views/report.py) and `ppdsl check` proves against `train.device_memory`
(lowering/fit.py).

peak = model state (`memory.state_bytes`: weights, gradients and optimizer state under the spec's
ZeRO stage, of the parameters the rank holds, `rank_params`) + activations (`activation_bytes`).

Activations: what check's meta trace measured the model's training forward to save for backward
(`ModelInfo.saved`, dsl/saved_activations.py), per microbatch of each stage the rank holds, times
the schedule's peak in-flight microbatches of the rank (spread evenly over its stages), plus the
largest temporary the trace saw in the rank's modules. A stage
holds what its blocks save, what its first modules save (stage 0), its last modules and the loss
(the last stage), and what the model's code outside every listed module saves (every stage: a
rotary table, a mask). Approximations:

- tensor parallelism divides by tp exactly the saved tensors a column-split layer produced (the
  trace files each under its last producer): projections of heads, attention scores, the MLP's
  inner activations, the vocab-parallel logits; norms' inputs, the residual stream and a column
  layer's own input stay whole (no sequence parallelism is credited);
- context parallelism: a rank's s / cp queries against the whole sequence's keys, so the linear
  term at s / cp and the s^2 term / cp;
- sizes are the trace's fp32 ones (x 2 under fp64); bf16 / fp16 autocast is not credited (its half
  precision copies are taken as fp32);
- activation checkpointing: a checkpointed block keeps only its input (b * s * h values) per
  microbatch in flight, plus one block's saved tensors while its backward recomputes it;
- the largest temporary: the trace also counts, per module, the most bytes alive that are
  neither saved nor parameters' gradients while the module runs or backward uses its saved
  tensors (a backward's gradients of activations, the loss's gradient the size of the logits);
  the rank adds the largest of its stages' modules once (one forward or backward runs at a time),
  undivided by tp (an upper bound under tensor parallelism);
- not counted: the optimizer step's temporaries (activations are freed by then, so it is the peak
  only where they are small), receive buffers, MoE routing imbalance (experts taken as the trace
  ran them).

Without a trace (check --no-model, a forward that failed on meta) the figure is Megatron's
formula: 34 * b * s * h bytes per block and microbatch / tp (Korthikanti et al. 2022, without the
attention-score term; 68 under fp64), known to be 4x low on a SwiGLU model with eager attention.

Pure Python: the model comes in as `dsl.introspect.ModelInfo` data.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from ppdsl.dsl.saved_activations import LOSS

from .memory import BYTES, Resharded, StateBytes, optimizer_slots, resharded, state_bytes, value_bytes
from .plan import Plan, PredictedMemory, StageAssignment
from .rank_params import held_paths, params_of, rank_params

HIDDEN_KEYS = ("hidden_size", "n_embd", "dim", "d_model")


@attrs.frozen
class RankMemory:
    """What a rank holds at the peak of a step (bytes), and the parameters behind it."""

    params: int | None  # at tp-local shapes, 1/ep of the experts; None without the model
    experts: int  # parameters of the experts in its blocks, all of them (0 without experts)
    state: StateBytes | None  # None without the model
    activations: int
    replicas: int | None  # the same rank's peak with zero = 0
    reshard: Resharded | None  # zero 3 + reshard_after_forward

    @property
    def peak(self) -> int | None:
        return None if self.state is None else self.state.peak + self.activations

    def terms(self) -> list[tuple[str, int]]:
        """The peak's terms, largest first."""
        if self.state is None:
            return [("activations", self.activations)]
        terms = [("weights", self.state.weights), ("gradients", self.state.grads),
                 ("optimizer state", self.state.optimizer), ("activations", self.activations)]
        return sorted(terms, key=lambda t: -t[1])


def hidden_size(plan: Plan, info: Any = None, hidden: int | None = None) -> int:
    """The model's hidden size: `hidden` (the spec's model dims) or the config's."""
    # the built model's config holds what an hf_pretrained directory's config.json adds
    cfg = {**(info.config if info is not None else {}), **plan.model.config_dict}
    return hidden or next((cfg[k] for k in HIDDEN_KEYS if isinstance(cfg.get(k), int)), 0)


def rank_memory(plan: Plan, info: Any, pp_rank: int, peaks: Sequence[int], hidden: int,
                cache: dict | None = None) -> RankMemory:
    """The memory of a rank of pipeline coordinate `pp_rank` (the other coordinates hold the
    same). `peaks`: the schedule's peak in-flight microbatches per pipeline rank
    (`simulate(plan.schedule).peak_activations`); `hidden`: `hidden_size`; `cache`: a dict
    kept across calls of one model (parameter counts by stages and tp)."""
    t = plan.train
    m = plan.mesh
    stages = plan.stages_of(pp_rank)
    value = value_bytes(t.precision)
    seq = t.seq_len // m.cp  # context parallelism: the rank's tokens of each sequence
    params, experts = _counts(plan, stages, info, cache)
    if params is not None:  # at its tp-local shapes, experts whole (replicated over tp): 1/ep of them
        params = params - experts + experts // m.ep
    act = activation_bytes(plan, info, stages, peaks[pp_rank], hidden, cache)
    slots = optimizer_slots(t.optimizer.name, t.optimizer.momentum)
    reshard = _resharded(plan, stages, info) if t.zero == 3 and t.reshard_after_forward else None
    state = replicas = None
    if params is not None:
        state = state_bytes(params, m.dp, t.zero, slots, reshard, value)  # check refused zero with cp (E0244)
        replicas = state_bytes(params, m.dp, 0, slots, value=value).peak + act
    return RankMemory(params, experts, state, act, replicas, reshard)


def predicted_memory(plan: Plan, info: Any, hidden: int | None = None, cache: dict | None = None,
                     peaks: Sequence[int] | None = None) -> PredictedMemory | None:
    """Every pipeline rank's `rank_memory` as the plan carries it (`Plan.memory`); None without the
    model (`info` None: nothing to count the parameters of). `hidden`: the spec's model dims'
    (`hidden_size`); `peaks`: the schedule's in-flight peaks per pipeline rank, simulated when
    not given."""
    if info is None:
        return None
    if peaks is None:
        from ppdsl.core.schedules.simulate import simulate

        peaks = simulate(plan.schedule).peak_activations
    h = hidden_size(plan, info, hidden)
    ranks = [rank_memory(plan, info, pp, peaks, h, cache) for pp in range(plan.mesh.pp)]
    if any(r.peak is None for r in ranks):
        return None
    return PredictedMemory(tuple(int(r.peak) for r in ranks), tuple(int(r.activations) for r in ranks),  # type: ignore[arg-type]
                           getattr(info, "saved", None) is not None)


def activation_bytes(plan: Plan, info: Any, stages: Sequence[StageAssignment], in_flight: int, hidden: int,
                     cache: dict | None = None) -> int:
    """Bytes of activations a rank holding `stages` keeps at its peak, with `in_flight`
    microbatches in flight (see the module doc); `cache`: as `rank_memory`'s."""
    t = plan.train
    m = plan.mesh
    value = value_bytes(t.precision)
    seq = t.seq_len // m.cp  # context parallelism: the rank's tokens of each sequence
    saved = getattr(info, "saved", None)
    if saved is None:
        blocks_held = sum(s.num_blocks for s in stages)
        return int(in_flight * (blocks_held / max(1, len(stages))) * 34 * t.microbatch_size * seq * hidden // m.tp
                   * value // BYTES)
    split = {r.path for r in plan.tp if r.style == "column" and not r.gather_output}

    def at(groups: Sequence[Any]) -> float:
        # the s^2 term: the rank's seq / cp queries against all t.seq_len keys
        return saved.bytes_at(groups, t.microbatch_size, t.seq_len) / m.cp * value / BYTES

    def saved_bytes(groups: Sequence[Any]) -> float:
        return at([g for g in groups if g.producer not in split]) + at([g for g in groups if g.producer in split]) / m.tp

    parts, temps = (_grouped(plan, which, groups, cache) for which, groups in
                    (("saved", saved.groups), ("temporaries", saved.temporaries)))
    per_microbatch = 0.0
    recompute = 0.0  # activation checkpointing: one block's saved tensors, while it is recomputed
    temporary = 0.0  # the largest temporary of the rank's modules
    for s in stages:
        mine = [g for i in range(s.block_start, s.block_stop) for g in temps.blocks.get(i, ())] + \
            [g for g in temps.outside if not _contains(g.module, plan, s)] + \
            [g for p in (*s.first, *s.last, *((LOSS,) if s.last else ())) for g in temps.roots.get(p, ())]
        temporary = max(temporary, *(at([g]) for g in mine), 0.0)
        blocks = [saved_bytes(parts.blocks.get(i, ())) for i in range(s.block_start, s.block_stop)]
        if t.activation_checkpointing:
            per_microbatch += len(blocks) * t.microbatch_size * seq * hidden * value
            recompute = max(recompute, *blocks, 0.0)
        else:
            per_microbatch += sum(blocks)
        per_microbatch += saved_bytes(parts.outside)
        if s.first:
            per_microbatch += saved_bytes([g for p in s.first for g in parts.roots.get(p, ())])
        if s.last:
            per_microbatch += saved_bytes([g for p in (*s.last, LOSS) for g in parts.roots.get(p, ())])
    return int(in_flight * per_microbatch / max(1, len(stages)) + recompute + temporary)


def activation_legend(traced: bool, fp64: bool) -> str:
    """How `activation_bytes` was reckoned, in the words of `ppdsl plan`'s legend."""
    if traced:
        return "saved for backward and the largest temporary, as check's meta trace measured them; docs/memory.md"
    return f"{'68' if fp64 else '34'}*b*s*h/tp bytes per block and microbatch"


@attrs.frozen
class _Groups:
    blocks: dict[int, list[Any]]  # block index -> its saved groups
    roots: dict[str, list[Any]]  # first / last module path (or LOSS) -> the groups under it
    outside: list[Any]  # groups of no block and no first / last module


def _contains(module: str, plan: Plan, stage: StageAssignment) -> bool:
    """Is `module` an ancestor of the blocks or of a first / last module (its temporaries are theirs)?"""
    return any(p.startswith(module + ".") for p in (plan.blocks, *stage.first, *stage.last))


def _grouped(plan: Plan, which: str, groups: Sequence[Any], cache: dict | None) -> _Groups:
    key = (which, plan.blocks, tuple((s.first, s.last) for s in plan.stages))
    parts = cache.get(key) if cache is not None else None
    if parts is None:
        parts = _stage_groups(plan, groups)
        if cache is not None:
            cache[key] = parts
    return parts


def _stage_groups(plan: Plan, groups: Sequence[Any]) -> _Groups:
    """The trace's saved groups by the part of the pipeline that runs their module."""
    roots = sorted({p for s in plan.stages for p in (*s.first, *s.last)}, key=len, reverse=True)
    head = f"{plan.blocks}."
    out = _Groups({}, {}, [])
    for g in groups:
        if g.module.startswith(head):
            index = g.module[len(head):].split(".", 1)[0]
            if index.isdigit():
                out.blocks.setdefault(int(index), []).append(g)
                continue
        root = LOSS if g.module == LOSS else next(
            (r for r in roots if g.module == r or g.module.startswith(r + ".")), None)
        if root is None:
            out.outside.append(g)
        else:
            out.roots.setdefault(root, []).append(g)
    return out


def _counts(plan: Plan, stages: Sequence[StageAssignment], info: Any, cache: dict | None) -> tuple[int | None, int]:
    """(parameters at tp-local shapes with the experts whole, the experts' parameters)."""
    if info is None:
        return None, 0
    key = (plan.mesh.tp, plan.blocks, plan.tp, plan.experts,
           tuple((s.block_start, s.block_stop, s.first, s.last, s.shared) for s in stages))
    if cache is not None and key in cache:
        return cache[key]
    found = (rank_params(plan, stages, info), rank_expert_params(plan, stages, info))
    if cache is not None:
        cache[key] = found
    return found


def rank_expert_params(plan: Plan, stages: Any, info: Any) -> int:
    """Parameters of the experts modules in the rank's blocks (all E of each layer)."""
    if info is None or not plan.experts:
        return 0
    from ppdsl.dsl.introspect import params_under

    return sum(params_under(info, e.path) for e in plan.experts for s in stages if in_blocks(plan, s, e.path))


def in_blocks(plan: Plan, stage: Any, path: str) -> bool:
    """Is `path` inside one of the blocks `stage` holds?"""
    head = f"{plan.blocks}."
    if not path.startswith(head):
        return False
    index = path[len(head):].split(".", 1)[0]
    return index.isdigit() and stage.block_start <= int(index) < stage.block_stop


def _resharded(plan: Plan, stages: Any, info: Any) -> Resharded | None:
    """zero 3 + reshard_after_forward: the rank's blocks and roots (tensor-parallel local)."""
    if info is None:
        return None
    held = held_paths(plan, stages, info)
    return resharded([([params_of(plan, info, [f"{plan.blocks}.{i}"], held) for i in range(s.block_start, s.block_stop)],
                       params_of(plan, info, [x for x in (*s.first, *s.last) if x in info.modules], held),
                       s.stage == 0) for s in stages], plan.train.microbatches, plan.schedule.split_backward)
