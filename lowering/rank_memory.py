"""One rank's memory at the step's peak: the one estimate `ppdsl plan` prints per rank
(ppdsl/views/report.py), `ppdsl check` proves against `train.device_memory` (lowering/fit.py),
`ppdsl tune` ranks its candidates by and lowering stores in the plan (`Plan.memory`, what
`ppdsl run --memory-trace` measures against).

peak = the largest of the step's phases, not a sum of their maxima:

- forward / backward (`pipeline_peak`): weights and optimizer state (`memory.state_bytes`,
  under the spec's ZeRO stage, of the parameters the rank holds, `rank_params`), plus, walking
  the rank's actions in the schedule's order, each stage's activations per microbatch in
  flight (from its F to its B, or W under a split backward, which also holds what B keeps for
  W, `kept_for_weights`), its gradients from its first backward on (so where every microbatch
  is in flight before the first backward, one microbatch or GPipe, the peak activations and the
  gradients do not add up), the action's largest temporary, activation checkpointing's
  recomputed block in a backward, and an accumulation into existing gradients (a temporary the
  size of the largest parameter, as the backward ends);
- the gradient sync and the optimizer step, the activations freed (`memory.state_phases`):
  the sync's buckets, the inf / nan check, the optimizer's temporaries
  (`memory.optimizer_temporaries`: AdamW's two tensors the size of the largest parameter on CPU),
  ZeRO-1's windows, ZeRO-3's shards.

Activations: what check's meta trace measured the model's training forward to save for backward
(`ModelInfo.saved`, dsl/saved_activations.py: attention through SDPA counted as the fused kernel
a CPU or GPU runs, not the meta device's math path), per microbatch of each stage the rank
holds (`stage_terms`), plus the largest temporary the trace saw in the stage's modules. A stage
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
- activation checkpointing: a checkpointed block keeps only its input (b * s * h values; a model
  fed images: the shape the trace measured entering that block) per
  microbatch in flight, plus one block's saved tensors while its backward recomputes it;
- the largest temporary: the trace also counts, per module, the most bytes alive that are
  neither saved nor parameters' gradients while the module runs or backward uses its saved
  tensors (a backward's gradients of activations, the loss's gradient the size of the logits);
  each action adds its stage's largest, undivided by tp (an upper bound under tensor
  parallelism);
- a split backward's B keeps, per microbatch until its W, one gradient the size of each
  parametrised module's output (`kept_for_weights`); under activation checkpointing also the
  blocks it recomputed (kept with the graph W needs), and W recomputes them once more and holds
  them while it runs (`StageTerms.rerun`; decoder.ppspec at zbv, measured: -3 % and +4 %);
- not counted: receive buffers, MoE routing imbalance (experts taken as the trace ran them),
  CUDA's foreach optimizer temporaries (every parameter of a group at once).

Without a trace (check --no-model, a forward that failed on meta) the activations are
Megatron's formula: 34 * b * s * h bytes per block and microbatch / tp (Korthikanti et al.
2022, without the attention-score term; 68 under fp64), known to be 4x low on a SwiGLU model
with eager attention, in the same phases.

Pure Python: the model comes in as `dsl.introspect.ModelInfo` data.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from ppdsl.core.hidden_width import hidden_width
from ppdsl.core.module_paths import under_any
from ppdsl.core.schedules.ir import Action, Op
from ppdsl.dsl.saved_activations import LOSS

from .memory import (BYTES, Resharded, StateBytes, Terms, optimizer_slots, optimizer_temporaries, resharded,
                     state_bytes, state_phases, value_bytes)
from .plan import Plan, PredictedMemory, StageAssignment
from .rank_params import held_paths, largest_param, params_of, rank_params

if TYPE_CHECKING:
    from ppdsl.dsl.introspect import ModelInfo


@attrs.frozen
class RankMemory:
    """What a rank holds at the peak of a step (bytes), and the parameters behind it."""

    params: int | None  # at tp-local shapes, 1/ep of the experts; None without the model
    experts: int  # parameters of the experts in its blocks, all of them (0 without experts)
    state: StateBytes | None  # None without the model
    activations: int  # at the pipeline's peak (forward / backward)
    replicas: int | None  # the same rank's peak with zero = 0
    reshard: Resharded | None  # zero 3 + reshard_after_forward
    # (phase, its bytes by term at its peak) in step order; () without the model
    phases: tuple[tuple[str, Terms], ...] = ()

    @property
    def peak(self) -> int | None:
        return None if self.state is None else max(sum(b for _, b in t) for _, t in self.phases)

    @property
    def peak_phase(self) -> str:
        """The phase of the step where the peak comes."""
        return max(self.phases, key=lambda p: sum(b for _, b in p[1]))[0] if self.phases else ""

    def terms(self) -> list[tuple[str, int]]:
        """The peak's terms (of the phase it comes in), largest first."""
        if self.state is None:
            return [("activations", self.activations)]
        terms = dict(self.phases)[self.peak_phase]
        return sorted(terms, key=lambda t: -t[1])


def hidden_size(plan: Plan, info: ModelInfo | None = None, hidden: int | None = None) -> int:
    """The model's hidden size: the plan's (lowered with the model), else `hidden` (the spec's
    model dims) or the config's (`ppdsl.core.hidden_width`); 0 when nothing tells."""
    if plan.model.hidden:
        return plan.model.hidden
    # the built model's config holds what an hf_pretrained directory's config.json adds
    cfg = {**(info.config if info is not None else {}), **plan.model.config_dict}
    return hidden_width(None, hidden, cfg, None) or 0


def rank_memory(plan: Plan, info: ModelInfo | None, pp_rank: int, peaks: Sequence[int], hidden: int,
                cache: dict | None = None) -> RankMemory:
    """The memory of a rank of pipeline coordinate `pp_rank` (the other coordinates hold the
    same). `peaks`: the schedule's peak in-flight microbatches per pipeline rank
    (`simulate(plan.schedule).peak_activations`), for the formula without a model; `hidden`:
    `hidden_size`; `cache`: a dict kept across calls of one model (parameter counts by stages
    and tp)."""
    t = plan.train
    m = plan.mesh
    stages = plan.stages_of(pp_rank)
    value = value_bytes(t.precision)
    params, experts = _counts(plan, stages, info, cache)
    if params is not None:  # at its tp-local shapes, experts whole (replicated over tp): 1/ep of them
        params = params - experts + experts // m.ep
    slots = optimizer_slots(t.optimizer.name, t.optimizer.momentum)
    reshard = _resharded(plan, stages, info) if t.zero == 3 and t.reshard_after_forward else None
    if params is None:
        return RankMemory(None, 0, None, activation_bytes(plan, info, stages, peaks[pp_rank], hidden, cache), None, None)
    largest = largest_param(plan, stages, info)
    terms = {s.stage: attrs.evolve(stage_terms(plan, info, s, hidden, cache),
                                   params=float(_counts(plan, [s], info, cache)[0] or 0)) for s in stages}
    temporaries = optimizer_temporaries(t.optimizer.name, t.optimizer.weight_decay)

    # every zero stage accumulates the whole gradients over the step (memory.state_bytes)
    state = state_bytes(params, m.dp, t.zero, slots, reshard, value)  # check refused zero with cp (E0244)
    top = pipeline_peak(plan.schedule.ranks[pp_rank], terms, state.grads, largest * value, plan.schedule.split_backward)

    def phases(state: StateBytes, zero: int) -> tuple[tuple[str, Terms], ...]:
        after = state_phases(state, m.dp, zero, largest, temporaries, value)
        return (("forward / backward", (("weights", state.weights), ("optimizer state", state.optimizer),
                                        ("activations", top.activations), ("gradients", top.grads))),
                ("grad sync", after.grad_sync), ("optimizer", after.optimizer))

    replicas = max(sum(b for _, b in t) for _, t in phases(state_bytes(params, m.dp, 0, slots, value=value), 0))
    return RankMemory(params, experts, state, top.activations, replicas, reshard, phases(state, t.zero))


@attrs.frozen
class StageTerms:
    """One stage's activation terms on its rank, in bytes (see the module doc)."""

    saved: float  # per microbatch in flight: what its forward saved (checkpointed: its blocks' inputs)
    recompute: float  # activation checkpointing: one block's saved tensors while it is recomputed
    temporary: float  # the largest temporary of its modules (one forward or backward at a time)
    kept: float  # split backward, per microbatch between its B and its W: the gradients B keeps for W
    params: float = 0.0  # its parameters (its share of the rank's gradients; set by rank_memory)
    # split backward with activation checkpointing: W recomputes the stage's blocks once more
    # (runtime/stage/module.py) and holds them until it ends; an upper bound (W frees each weight
    # group's kept gradients as it goes)
    rerun: float = 0.0


@attrs.frozen
class PipelinePeak:
    """The forward / backward phase's peak: its activations and the gradients alive then (bytes)."""

    activations: int
    grads: int
    at: str  # the action at the peak ("F3s1"), "" for none

    @property
    def total(self) -> int:
        return self.activations + self.grads


def pipeline_peak(actions: Sequence[Action], terms: Mapping[int, StageTerms], grads: float, accumulate: float,
                  split_backward: bool) -> PipelinePeak:
    """Walk a rank's actions in order: a stage's activations are held from its F to its B (W
    under a split backward, which also holds what B kept for W), its gradients exist from its
    first B (W) on, at their share `StageTerms.params` of the rank's `grads`; each action adds
    its stage's largest temporary, a backward its recomputed block under activation
    checkpointing (W under a split backward: `StageTerms.rerun`); and an accumulation of gradients into existing ones (W: each time, its clone
    the first) a temporary the size of the largest parameter (`accumulate` bytes), counted as
    the action ends: the largest parameter is usually the embedding, whose gradient comes last
    in the backward, when the microbatch's activations are freed (a head's comes first, next
    to the loss's temporaries, which are larger). The peak is
    the most held at once, before or after any action: not the peak activations plus the whole
    gradients, which never coexist where every microbatch is in flight before the first
    backward (one microbatch, GPipe)."""
    held = {s: 0 for s in terms}
    kept = {s: 0 for s in terms}
    has: set[int] = set()
    total = sum(t.params for t in terms.values()) or 1.0
    best = PipelinePeak(0, 0, "")

    def at(extra: float, label: str) -> None:
        nonlocal best
        act = sum(held[s] * terms[s].saved + kept[s] * terms[s].kept for s in terms) + extra
        g = grads * sum(terms[s].params for s in has) / total
        if act + g > best.total:
            best = PipelinePeak(int(act), int(g), label)

    for a in actions:
        t = terms[a.stage]
        if a.op is Op.F:
            held[a.stage] += 1
            at(t.temporary, str(a))
            continue
        releases = a.op is Op.W or not split_backward
        accumulating = a.op is Op.W or (releases and a.stage in has)
        if a.op is Op.B and split_backward:
            kept[a.stage] += 1  # what B keeps for W builds up as it runs, next to its temporaries
            at(t.temporary + t.recompute, str(a))
        elif a.op is Op.W and t.kept:  # under activation checkpointing W recomputes the blocks again
            at(t.temporary + t.rerun, str(a))
        else:  # a backward, or the W of the first stage (its whole backward)
            at(t.temporary + t.recompute, str(a))
        if releases:
            held[a.stage] -= 1
            kept[a.stage] -= 1 if split_backward else 0
            has.add(a.stage)
        at(accumulate if accumulating else 0.0, f"after {a}")
    return best


def predicted_memory(plan: Plan, info: ModelInfo | None, hidden: int | None = None, cache: dict | None = None,
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


def activation_bytes(plan: Plan, info: ModelInfo | None, stages: Sequence[StageAssignment], in_flight: int, hidden: int,
                     cache: dict | None = None) -> int:
    """Bytes of activations a rank holding `stages` keeps with `in_flight` microbatches in flight,
    spread evenly over its stages (see the module doc; the formula's figure without a trace)."""
    terms = [stage_terms(plan, info, s, hidden, cache) for s in stages]
    per_microbatch = sum(x.saved for x in terms) / max(1, len(stages))
    return int(in_flight * per_microbatch + max((x.recompute for x in terms), default=0.0)
               + max((x.temporary for x in terms), default=0.0))


def stage_terms(plan: Plan, info: ModelInfo | None, s: StageAssignment, hidden: int, cache: dict | None = None) -> StageTerms:
    """A stage's activation terms (see the module doc); `cache`: as `rank_memory`'s."""
    t = plan.train
    m = plan.mesh
    value = value_bytes(t.precision)
    seq = t.seq_len // m.cp  # context parallelism: the rank's tokens of each sequence
    saved = getattr(info, "saved", None)
    if saved is None:
        return StageTerms(s.num_blocks * 34 * t.microbatch_size * seq * hidden / m.tp * value / BYTES, 0.0, 0.0, 0.0)
    split = {r.path for r in plan.tp if r.style == "column" and not r.gather_output}

    def at(groups: Sequence[Any]) -> float:
        # the s^2 term: the rank's seq / cp queries against all t.seq_len keys
        return saved.bytes_at(groups, t.microbatch_size, t.seq_len) / m.cp * value / BYTES

    def saved_bytes(groups: Sequence[Any]) -> float:
        return at([g for g in groups if g.producer not in split]) + at([g for g in groups if g.producer in split]) / m.tp

    parts, temps = (_grouped(plan, which, groups, cache) for which, groups in
                    (("saved", saved.groups), ("temporaries", saved.temporaries)))
    mine = [g for i in range(s.block_start, s.block_stop) for g in temps.blocks.get(i, ())] + \
        [g for g in temps.outside if not _contains(g.module, plan, s)] + \
        [g for p in (*s.first, *s.last, *((LOSS,) if s.last else ())) for g in temps.roots.get(p, ())]
    temporary = max((at([g]) for g in mine), default=0.0)
    blocks = [saved_bytes(parts.blocks.get(i, ())) for i in range(s.block_start, s.block_stop)]
    recompute = 0.0
    if t.activation_checkpointing:  # each block keeps its input: the traced shape where it changes between blocks
        inputs = _block_inputs(info, s)
        per_microbatch = (len(blocks) * seq * hidden if inputs is None else inputs) * t.microbatch_size * value
        recompute = max(blocks, default=0.0)
    else:
        per_microbatch = sum(blocks)
    per_microbatch += saved_bytes(parts.outside)
    if s.first:
        per_microbatch += saved_bytes([g for p in s.first for g in parts.roots.get(p, ())])
    if s.last:
        per_microbatch += saved_bytes([g for p in (*s.last, LOSS) for g in parts.roots.get(p, ())])
    kept = rerun = 0.0
    if plan.schedule.split_backward and s.stage > 0:
        kept = kept_for_weights(plan, info, s, hidden)
        if t.activation_checkpointing:  # B's recomputed tensors stay with the graph W needs
            rerun = sum(blocks)
            kept += rerun
    return StageTerms(per_microbatch, recompute, temporary, kept, rerun=rerun)


def _block_inputs(info: ModelInfo | None, s: StageAssignment) -> int | None:
    """The values of one sample's hidden state entering each of the stage's blocks, summed, as
    check's trace measured them (a model fed images: Swin's and ConvNext's change between blocks);
    None where the trace does not say (a token model: seq_len * hidden each)."""
    layout = getattr(info, "own_layout", None)
    shapes = getattr(layout, "block_shapes", ()) if getattr(layout, "inputs", "") == "pixels" else ()
    if len(shapes) < s.block_stop or not all(shapes[i] for i in range(s.block_start, s.block_stop)):
        return None
    total = 0
    for i in range(s.block_start, s.block_stop):
        n = 1
        for d in shapes[i]:
            n *= d
        total += n
    return total


def kept_for_weights(plan: Plan, info: ModelInfo | None, s: StageAssignment, hidden: int) -> float:
    """What a split backward's B keeps for W, per microbatch of stage `s` (bytes): the gradient
    arriving at each op where a weight branch leaves the input-gradient path
    (runtime/pipeline/split_backward.py), one the size of each parametrised module's output: a linear's
    `out_features` (1/tp of a column or vocab split's), an embedding's `embedding_dim`, a norm's
    (and any other module's) hidden size. The first stage keeps nothing (its W is its whole
    backward)."""
    t = plan.train
    tokens = t.microbatch_size * t.seq_len // plan.mesh.cp
    held = held_paths(plan, [s], info)
    split = {r.path for r in plan.tp if r.style in ("column", "vocab") and not r.gather_output}
    experts = tuple(e.path for e in plan.experts)
    width = 0.0
    for path, mod in info.modules.items():
        layer = mod.kind in ("linear", "conv1d", "embedding")  # a tied one owns no parameters of its own
        if (mod.num_params <= 0 and not layer) or not under_any(path, held) or under_any(path, experts):
            continue
        if mod.kind in ("linear", "conv1d") and mod.out_features:
            width += mod.out_features / (plan.mesh.tp if path in split else 1)
        elif mod.kind == "embedding" and mod.embedding_dim:
            width += mod.embedding_dim
        else:
            width += hidden
    return tokens * width * value_bytes(t.precision)


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


def _counts(plan: Plan, stages: Sequence[StageAssignment], info: ModelInfo | None, cache: dict | None) -> tuple[int | None, int]:
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


def rank_expert_params(plan: Plan, stages: Any, info: ModelInfo | None) -> int:
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


def _resharded(plan: Plan, stages: Any, info: ModelInfo | None) -> Resharded | None:
    """zero 3 + reshard_after_forward: the rank's blocks and roots (tensor-parallel local)."""
    if info is None:
        return None
    held = held_paths(plan, stages, info)
    return resharded([([params_of(plan, info, [f"{plan.blocks}.{i}"], held) for i in range(s.block_start, s.block_stop)],
                       params_of(plan, info, [x for x in (*s.first, *s.last) if x in info.modules], held),
                       s.stage == 0) for s in stages], plan.schedule.microbatches, plan.schedule.split_backward)
