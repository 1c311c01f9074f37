"""Measured costs and the step-time model of ``ppdsl tune`` (pure Python, no torch).

A ``CostProfile`` holds what one process measured on the real model and shapes
(``runtime.train.profile``): per block the forward (F), input-gradient (B) and weight-gradient (W)
seconds and the bytes of activations it saves, the same for the first modules (embeddings) and
the last ones (head and loss), each at two microbatch sizes (a cost is ``a + b * samples``
between and beyond them), the optimizer's seconds per parameter, and a communication model
(latency + seconds per byte for p2p and all-reduce) from a gloo micro-benchmark.

``predict`` turns a layout into per-action costs, runs the pipeline simulator on them and adds
what the simulator does not see: tensor-parallel all-reduces (inside F and B), the data-parallel
gradient all-reduce and the optimizer step. The limits are in docs/tune.md. Memory is not
predicted here: `ppdsl tune` takes each candidate's from its lowered plan (`Plan.memory`,
lowering/rank_memory.py, the one estimate `ppdsl plan` prints and check proves).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import attrs

from ppdsl.core.schedules import STYLES, generate
from ppdsl.core.schedules.ir import Action, Op, Schedule
from ppdsl.core.schedules.profile import PROFILE_VERSION, CommModel, CostProfile, Linear, PartCost  # noqa: F401
from ppdsl.core.schedules.simulate import simulate

from .memory import Resharded, resharded
from .stages import cost_split, even_split


@attrs.frozen
class Layout:
    """The layout keys ``tune`` chooses. split None: ``measured_split`` decides."""

    tp: int
    pp: int
    dp: int
    style: str
    chunks: int
    microbatches: int
    activation_checkpointing: bool = False
    sequence_parallel: bool = False
    split: tuple[tuple[int, int], ...] | None = None
    zero: int = 0  # the ZeRO stage (train.zero): what a rank's memory holds
    reshard_after_forward: bool = False  # train.reshard_after_forward (zero 3): blocks gathered per microbatch
    cp: int = 1  # context parallelism: a world factor, each rank 1 / cp of every sequence
    ep: int = 1  # expert parallelism: borrowed from dp

    def label(self) -> str:
        extra = ("+ac" if self.activation_checkpointing else "") + ("+sp" if self.sequence_parallel else "") + \
            (f"+z{self.zero}" if self.zero else "")
        v = f" v{self.chunks}" if self.chunks > 1 else ""
        axes = (f" cp{self.cp}" if self.cp > 1 else "") + (f" ep{self.ep}" if self.ep > 1 else "")
        return f"tp{self.tp} pp{self.pp} dp{self.dp}{axes} {self.style}{v} m{self.microbatches}{extra}"


@attrs.frozen
class Prediction:
    layout: Layout
    step_s: float
    pipeline_s: float  # the simulated schedule's makespan
    bubble: float  # of the simulated schedule, under the measured costs
    dp_sync_s: float
    optimizer_s: float
    split: tuple[tuple[int, int], ...]
    stage_s: tuple[float, ...]  # F + B + W seconds per virtual stage and microbatch
    action_s: tuple[tuple[float, float, float], ...] = ()  # per virtual stage: F, B, W seconds
    # the largest rank's peak, from the candidate's plan (`Plan.memory`, set by ppdsl tune); None unknown
    memory_bytes: float | None = None


def calibration_factor(pred: Prediction, measured: Sequence[tuple[str, int, float]]) -> float:
    """How much slower the actions of a real run were than `pred` says: the sum of measured
    F / B / W seconds over the sum of their predicted ones. measured: (op, stage, seconds) of
    every action of the steps looked at; `pred` made without contention (factor 1)."""
    index = {"F": 0, "B": 1, "W": 2}
    split = any(op == "W" for op, _, _ in measured)
    predicted = 0.0
    for op, stage, _ in measured:
        f, b, w = pred.action_s[stage]
        predicted += (f, b if split else b + w, w)[index[op]]
    got = sum(sec for _, _, sec in measured)
    if predicted <= 0 or got <= 0:
        raise ValueError("no F / B / W time to calibrate on")
    return got / predicted


def microbatch_size(global_batch: int, layout: Layout) -> int:
    return global_batch // (layout.dp * layout.microbatches)


def rank_samples(global_batch: int, layout: Layout) -> float:
    """A rank's share of each microbatch, in whole sequences: 1 / cp of it under context parallelism."""
    return microbatch_size(global_batch, layout) / layout.cp


def _block_time(p: PartCost, samples: int, tp: int, ac: bool) -> tuple[float, float, float]:
    f, b, w = p.f.at(samples) / tp, p.b.at(samples) / tp, p.w.at(samples) / tp
    if ac:
        b += f  # the forward runs again before the backward
    return f, b, w


def measured_split(profile: CostProfile, num_stages: int, samples: int, tp: int = 1,
                   ac: bool = False) -> list[tuple[int, int]]:
    """Contiguous block ranges minimising the largest stage's F + B + W under the profile."""
    def total(p: PartCost) -> float:
        return sum(_block_time(p, samples, tp, ac))

    return cost_split([total(b) for b in profile.blocks], num_stages, total(profile.first), total(profile.last))


def tp_collectives_per_block(sequence_parallel: bool) -> int:
    """Collectives per block and direction: an all-reduce after attention and after the MLP; under
    sequence parallelism an all-gather before each and a reduce-scatter after (Korthikanti et al.)."""
    return 4 if sequence_parallel else 2


def tp_comm_per_block(profile: CostProfile, tp: int, sequence_parallel: bool, act_bytes: float) -> float:
    """Seconds of tensor-parallel communication per block in F (and again in B)."""
    if tp <= 1:
        return 0.0
    n = tp_collectives_per_block(sequence_parallel)
    if tp in profile.tp_collective:
        return n * profile.tp_collective[tp]
    # all-gather and reduce-scatter move half of an all-reduce's bytes each
    return n * profile.comm.allreduce(act_bytes / (2 if sequence_parallel else 1), tp)


def axis_comm_per_block(profile: CostProfile, layout: Layout, sequence_bytes: float) -> float:
    """Seconds of context- and expert-parallel communication per block in F (and again in B), from
    the bytes of one microbatch's hidden states over the whole sequence: cp all-gathers the
    keys and values (taken as wide as the hidden state: an upper bound with grouped-query
    attention; half an all-reduce in F, its gradients' all-reduce in B, counted as their mean);
    ep sends (ep - 1) / ep of the rank's tokens there and back (routing uniform, one expert per
    token: top-k routing sends k times this)."""
    out = 0.0
    if layout.cp > 1:
        out += 0.75 * profile.comm.allreduce(2 * sequence_bytes / layout.tp, layout.cp)
    if layout.ep > 1:
        out += 2 * profile.comm.p2p(sequence_bytes / layout.cp * (layout.ep - 1) / layout.ep)
    return out


@attrs.frozen
class _StageTimes:
    f: list[float]  # per virtual stage and microbatch, seconds
    b: list[float]
    w: list[float]
    params: list[float]


def _stage_times(profile: CostProfile, layout: Layout, samples: float, world: int,
                 ranges: Sequence[tuple[int, int]]) -> _StageTimes:
    """`samples`: the rank's share of a microbatch in whole sequences (samples / cp under context
    parallelism: every per-token cost, attention's too, is 1 / cp of the sequence's)."""
    num_stages = layout.pp * layout.chunks
    tp = layout.tp
    # CPU: more processes than cores share them (docs/tune.md)
    slow = profile.slowdown(world)
    act = profile.boundary_bytes.at(samples)
    tp_ar = tp_comm_per_block(profile, tp, layout.sequence_parallel, act) + \
        axis_comm_per_block(profile, layout, act * layout.cp)
    out = _StageTimes([], [], [], [])
    for s, (a, z) in enumerate(ranges):
        parts = list(profile.blocks[a:z])
        if s == 0:
            parts.append(profile.first)
        if s == num_stages - 1:
            parts.append(profile.last)
        times = [_block_time(p, samples, tp, layout.activation_checkpointing) for p in parts]
        out.f.append(slow * sum(t[0] for t in times) + tp_ar * (z - a))
        out.b.append(slow * sum(t[1] for t in times) + tp_ar * (z - a))
        out.w.append(slow * sum(t[2] for t in times))
        out.params.append(sum(p.params for p in parts) / tp)
    return out


def _action_cost(times: _StageTimes, split_backward: bool) -> Callable[[Action], float]:
    def cost(action: Action) -> float:
        s = action.stage
        if action.op is Op.F:
            return times.f[s]
        if action.op is Op.B:
            return times.b[s] if split_backward else times.b[s] + times.w[s]
        return times.w[s]

    return cost


def measured_schedule(profile: CostProfile, layout: Layout, global_batch: int, world: int,
                      ranges: Sequence[tuple[int, int]]) -> Schedule:
    """The layout's schedule, for a zero-bubble style ordered on the measured F / B / W costs of
    its stages (the paper's automatic scheduler) when that simulates strictly faster than the
    unit-cost order; otherwise, and for the other styles, the unit-cost schedule itself."""
    unit = generate(layout.style, layout.pp, layout.microbatches, layout.chunks)
    if not unit.split_backward:
        return unit
    times = _stage_times(profile, layout, rank_samples(global_batch, layout), world, ranges)
    timed = generate(layout.style, layout.pp, layout.microbatches, layout.chunks,
                     costs=tuple(zip(times.f, times.b, times.w)))
    cost = _action_cost(times, True)
    latency = profile.comm.p2p(profile.boundary_bytes.at(rank_samples(global_batch, layout)))
    got, base = simulate(timed, cost, p2p_latency=latency), simulate(unit, cost, p2p_latency=latency)
    return timed if got.ok and got.makespan < base.makespan else unit


def predict(profile: CostProfile, layout: Layout, global_batch: int, world: int,
            split: Sequence[tuple[int, int]] | None = None, balance: str = "measured",
            schedule: Schedule | None = None) -> Prediction:
    """The predicted step time of `layout`; split overrides the layout's and `balance`
    (measured | even) chooses one when neither gives it. `schedule`: the one to simulate
    (``measured_schedule``), by default the style's unit-cost order."""
    tp, pp, dp, v = layout.tp, layout.pp, layout.dp, layout.chunks
    whole = microbatch_size(global_batch, layout)
    # E0302 at check: lower's layout and each of tune's candidates split the batch into whole microbatches
    assert whole >= 1, f"{layout.label()}: global batch {global_batch} gives no sample per microbatch (E0302)"
    samples = rank_samples(global_batch, layout)
    if schedule is None:
        schedule = generate(layout.style, pp, layout.microbatches, v)
    num_stages = pp * v
    ranges = list(split or layout.split or ())
    if not ranges:
        ranges = (measured_split(profile, num_stages, samples, tp, layout.activation_checkpointing)
                  if balance == "measured" else even_split(len(profile.blocks), num_stages))
    slow = profile.slowdown(world)
    act = profile.boundary_bytes.at(samples)
    times = _stage_times(profile, layout, samples, world, ranges)
    f_s, b_s, w_s, stage_params = times.f, times.b, times.w, times.params
    sim = simulate(schedule, _action_cost(times, schedule.split_backward), p2p_latency=profile.comm.p2p(act))
    assert sim.ok, sim.problems
    rank_params = [0.0] * pp
    for s, r in enumerate(schedule.stage_ranks):
        rank_params[r] += stage_params[s]
    # zero 0 all-reduces the gradients; zero 1 and 3 move the same bytes as a reduce-scatter and an all-gather
    dp_sync = max(profile.comm.allreduce(profile.value_bytes * p, dp * layout.cp) for p in rank_params)
    reshard: list[Resharded | None] = [None] * pp
    if layout.zero == 3 and layout.reshard_after_forward and dp > 1:
        reshard = _resharded_ranks(profile, schedule, ranges, tp, layout.microbatches)
        # per step: the gradients' reduce-scatter and the roots' all-gather (half an all-reduce each), and
        # the blocks' all-gathers, every microbatch (their latency once per gather)
        dp_sync = max(profile.comm.allreduce(profile.value_bytes * (rank_params[r] + rs.roots + rs.gathered_per_step),
                                             dp) / 2
                      + rs.gathers * (dp - 1) * profile.comm.allreduce_latency / 2
                      for r, rs in enumerate(reshard) if rs is not None)
    # under zero 1 and 3 a rank steps only its 1/dp of the parameters
    optimizer = max(rank_params) / (dp if layout.zero else 1) * profile.optimizer_per_param * slow
    return Prediction(
        layout=attrs.evolve(layout, split=tuple(ranges)),
        step_s=sim.makespan + dp_sync + optimizer + profile.step_overhead.get(world, 0.0),
        pipeline_s=sim.makespan, bubble=sim.bubble, dp_sync_s=dp_sync, optimizer_s=optimizer,
        split=tuple(ranges), stage_s=tuple(f + b + w for f, b, w in zip(f_s, b_s, w_s)),
        action_s=tuple(zip(f_s, b_s, w_s)),
    )


def _resharded_ranks(profile: CostProfile, schedule: Schedule, ranges: Sequence[tuple[int, int]], tp: int,
                     microbatches: int) -> list[Resharded]:
    """memory.resharded of every pipeline rank, from the profile's parameters per block."""
    last = len(ranges) - 1
    per_rank: list[list[tuple[list[float], float, bool]]] = [[] for _ in range(schedule.pp)]
    for s, r in enumerate(schedule.stage_ranks):
        a, z = ranges[s]
        roots = (profile.first.params if s == 0 else 0) + (profile.last.params if s == last else 0)
        per_rank[r].append(([b.params / tp for b in profile.blocks[a:z]], roots / tp, s == 0))
    return [resharded(stages, microbatches, schedule.split_backward) for stages in per_rank]


def style_chunks(style: str, pp: int) -> tuple[int, ...]:
    """The chunk counts ``tune`` tries for a style: its rule's smallest values."""
    rule = STYLES[style].chunks
    if rule == "== 1":
        return (1,)
    if rule.startswith("== 2"):
        return (2,)
    return (2, 4) if pp > 1 else ()


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def median(values: Sequence[float]) -> float:
    xs = sorted(values)
    if not xs:
        return math.nan
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2
