"""Simulate and validate a pipeline schedule (pure Python, no torch).

Semantics. The simulator runs the message steps the runtime executes (``messages.step_codes``,
the pass ``runtime.pipeline.executor`` walks as ``message_steps``). Each rank runs its steps strictly in
order, one action at a time: it posts the step's receives, waits for the message the action
needs, runs the action and sends its message, which goes out at once (the executor never waits
a send before the end of the step). An action starts when its rank is free and what it needs has
arrived: the message of its step (``p2p_latency`` after the sending action ended), or what an
earlier action of its own rank left it (a local handover between stages on the same rank, the
stage's own forward for B, its B for W):

- ``F(mb, s)`` needs ``F(mb, s-1)``'s output;
- ``B(mb, s)`` needs ``F(mb, s)`` and ``B(mb, s+1)``'s input gradient (the last stage only its own ``F``);
- ``W(mb, s)`` needs ``B(mb, s)``.

Between a pair of ranks receives match sends in order (NCCL ignores tags): before running, the
simulator checks that each rank posts its receives from a peer in the order the peer sends, each
one by the step that waits for it. Receives posted ahead (the executor's ``lookahead``) never
block and keep that order, so the steps just in time (lookahead 1) decide where a schedule hangs.

The simulation is event driven: a rank advances until its next action waits on an action
that has not run yet, and is woken when that action runs. Each action is visited once, so a
schedule of n actions simulates in O(n). When no rank can advance and some still have work,
the schedule is stuck; ``validate`` names each blocked rank, its action and what it waits for.
Whether and where a schedule gets stuck does not depend on costs, so ``validate`` runs the
same walk without the clock.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Literal, NamedTuple

import attrs

from . import messages
from .ir import Action, Op, Schedule

ProblemKind = Literal["missing", "duplicate", "wrong_rank", "unexpected", "deadlock", "order"]

_OPS: tuple[Op, ...] = (Op.F, Op.B, Op.W)


@attrs.frozen
class ScheduleProblem:
    """One reason a schedule cannot run.

    kind: ``missing`` (a required action is on no rank), ``duplicate`` (listed more than
    once), ``wrong_rank`` (listed on a rank that does not hold its stage), ``unexpected`` (an
    action that must not exist: microbatch or stage out of range, or W in a schedule without
    split backward), ``order`` (a rank lists an action before a dependency that the same rank
    runs later), ``deadlock`` (ranks wait on each other). rank is the rank that lists the
    action (for ``missing``: the rank that should).
    """

    kind: ProblemKind
    rank: int | None
    action: Action | None
    message: str


class Slot(NamedTuple):
    """When one action ran."""

    action: Action
    start: float
    end: float


@attrs.frozen
class SimResult:
    """Outcome of ``simulate``.

    starts[r][i] and ends[r][i] time the i-th action of rank r; when ``problems`` is not
    empty the schedule did not complete and they cover only what ran before it stopped.
    bubble = idle time / (ranks x makespan). peak_activations[r] is the largest number of
    (microbatch, stage) activations rank r holds at once, from F until the backward that
    frees them (W when the schedule splits backward).
    """

    schedule: Schedule = attrs.field(repr=False)
    # flat float tuples rather than one object per action: 10^5 objects cost more than the run
    starts: tuple[tuple[float, ...], ...] = attrs.field(repr=False)
    ends: tuple[tuple[float, ...], ...] = attrs.field(repr=False)
    makespan: float
    bubble: float
    busy: tuple[float, ...]
    peak_activations: tuple[int, ...]
    problems: tuple[ScheduleProblem, ...]

    @property
    def ok(self) -> bool:
        return not self.problems

    def slots(self, rank: int) -> tuple[Slot, ...]:
        """The actions rank ``rank`` ran, in order, with their times."""
        actions = self.schedule.ranks[rank]
        return tuple(Slot(a, s, e) for a, s, e in zip(actions, self.starts[rank], self.ends[rank]))

    def times(self) -> dict[Action, tuple[float, float]]:
        """action -> (start, end) for every action that ran."""
        return {
            a: (s, e)
            for r, actions in enumerate(self.schedule.ranks)
            for a, s, e in zip(actions, self.starts[r], self.ends[r])
        }


def unit_cost(schedule: Schedule) -> Callable[[Action], float]:
    """The reference costs: F = 1; B = 2 unsplit, or B = 1 and W = 1 when backward is split."""
    b = 1.0 if schedule.split_backward else 2.0
    return lambda action: b if action.op is Op.B else 1.0


def peak_activations(schedule: Schedule) -> tuple[int, ...]:
    """Per rank, the most activations held at once, walking its list in order."""
    release = Op.W if schedule.split_backward else Op.B
    peaks = []
    for actions in schedule.ranks:
        held = peak = 0
        for a in actions:
            if a.op is Op.F:
                held += 1
                if held > peak:
                    peak = held
            elif a.op is release:
                held -= 1
        peaks.append(peak)
    return tuple(peaks)


def validate(schedule: Schedule) -> list[ScheduleProblem]:
    """All problems of a schedule; [] when it is complete and runs to the end.

    Completeness problems (missing, duplicate, wrong_rank, unexpected) are reported alone:
    running an incomplete schedule would only repeat them as deadlocks.
    """
    _check_shape(schedule)
    encoded, problems = _encode(schedule)
    if problems:
        return problems
    run = _advance(schedule, encoded, messages.step_codes(schedule, encoded))
    return _stuck_problems(schedule, run) if run.stuck else []


def simulate(
    schedule: Schedule,
    cost: Callable[[Action], float] | None = None,
    p2p_latency: float = 0.0,
) -> SimResult:
    """Run ``schedule`` on a model of its ranks; the rules are in the module docstring.

    cost gives each action's duration (default ``unit_cost(schedule)``); p2p_latency is
    added to a dependency that ran on another rank. A schedule that is incomplete or gets
    stuck comes back with ``problems`` (as ``validate`` reports them) and the times of what
    ran; ``SimResult.ok`` tells.
    """
    _check_shape(schedule)
    if not (p2p_latency >= 0 and math.isfinite(p2p_latency)):
        raise ValueError(f"p2p_latency must be finite and >= 0, got {p2p_latency}")
    encoded, problems = _encode(schedule)
    if problems:
        nothing = tuple(() for _ in range(schedule.pp))
        zeros = tuple(0.0 for _ in range(schedule.pp))
        peaks = peak_activations(schedule)
        return SimResult(schedule, nothing, nothing, 0.0, 0.0, zeros, peaks, tuple(problems))
    peaks = _peaks(schedule, encoded)
    costs = _costs(schedule, encoded, cost)
    run = _run(schedule, encoded, messages.step_codes(schedule, encoded), costs, float(p2p_latency))
    makespan = max((ends[-1] for ends in run.ends if ends), default=0.0)
    busy = tuple(float(sum(c[: len(e)])) for c, e in zip(costs, run.ends))
    idle = sum(makespan - b for b in busy)
    bubble = idle / (schedule.pp * makespan) if makespan > 0 else 0.0
    stuck = tuple(_stuck_problems(schedule, run)) if run.stuck else ()
    return SimResult(schedule, run.starts, run.ends, makespan, bubble, busy, peaks, stuck)


def _check_shape(schedule: Schedule) -> None:
    """A malformed Schedule object is a user error, not a schedule problem."""
    if schedule.pp < 1 or schedule.chunks < 1 or schedule.microbatches < 1:
        raise ValueError(
            f"schedule needs pp, chunks and microbatches >= 1, got pp={schedule.pp}, "
            f"chunks={schedule.chunks}, microbatches={schedule.microbatches}"
        )
    if len(schedule.ranks) != schedule.pp:
        raise ValueError(f"schedule has {len(schedule.ranks)} rank lists for pp={schedule.pp}")
    if len(schedule.stage_ranks) != schedule.pp * schedule.chunks:
        raise ValueError(
            f"schedule places {len(schedule.stage_ranks)} stages, expected pp * chunks = "
            f"{schedule.pp * schedule.chunks}"
        )
    bad = [r for r in schedule.stage_ranks if not 0 <= r < schedule.pp]
    if bad:
        raise ValueError(f"stage_ranks names ranks outside 0..{schedule.pp - 1}: {bad}")


def _costs(
    schedule: Schedule, encoded: list[list[int]], cost: Callable[[Action], float] | None
) -> list[list[float]]:
    if cost is None:
        # unit_cost, on the codes of ``_encode``: B codes lie in [ms, 2 ms)
        b = 1.0 if schedule.split_backward else 2.0
        ms = schedule.microbatches * schedule.num_stages
        b_end = 2 * ms
        return [[b if ms <= k < b_end else 1.0 for k in codes] for codes in encoded]
    costs = [[float(cost(a)) for a in acts] for acts in schedule.ranks]
    if not all(c >= 0 and math.isfinite(c) for rank in costs for c in rank):
        raise ValueError("action costs must be finite and >= 0")
    return costs


def _encode(schedule: Schedule) -> tuple[list[list[int]], list[ScheduleProblem]]:
    """Actions as ints (op * m + mb) * S + stage, with the completeness problems.

    Completeness: every (mb, stage) has exactly one F, one B, and one W iff backward is
    split, on the rank that holds the stage. Flat int bookkeeping instead of hashing attrs
    objects keeps a 10^5-action schedule well under a second.
    """
    m, stages = schedule.microbatches, schedule.num_stages
    ms = m * stages
    num_ops = 3 if schedule.split_backward else 2
    F, B = Op.F, Op.B
    counts = bytearray(3 * ms)
    encoded: list[list[int]] = []
    problems: list[ScheduleProblem] = []
    stage_ranks = schedule.stage_ranks
    for rank, actions in enumerate(schedule.ranks):
        codes = []
        for a in actions:
            kind, mb, stage = a.op, a.microbatch, a.stage
            # identity tests: hashing a str-Enum member runs Python code
            op = 0 if kind is F else 1 if kind is B else 2
            if op >= num_ops or not (0 <= mb < m and 0 <= stage < stages):
                why = (
                    "W in a schedule without split backward"
                    if op >= num_ops
                    else f"microbatch must be in 0..{m - 1} and stage in 0..{stages - 1}"
                )
                problems.append(ScheduleProblem("unexpected", rank, a, f"rank {rank} lists {a}: {why}"))
                continue
            if stage_ranks[stage] != rank:
                owner = stage_ranks[stage]
                problems.append(
                    ScheduleProblem(
                        "wrong_rank", rank, a, f"rank {rank} lists {a}, but stage {stage} is on rank {owner}"
                    )
                )
            k = (op * m + mb) * stages + stage
            codes.append(k)
            if counts[k]:
                if counts[k] == 1:
                    problems.append(
                        ScheduleProblem("duplicate", rank, a, f"{a} is listed more than once (again on rank {rank})")
                    )
                    counts[k] = 2
            else:
                counts[k] = 1
        encoded.append(codes)
    if counts.find(0, 0, num_ops * ms) >= 0:
        problems += _missing(schedule, counts, num_ops)
    return encoded, problems


def _peaks(schedule: Schedule, encoded: list[list[int]]) -> tuple[int, ...]:
    """``peak_activations`` of a complete schedule, on the codes of ``_encode``."""
    ms = schedule.microbatches * schedule.num_stages
    # codes from ``release`` on free an activation: W when backward is split, else B
    release = 2 * ms if schedule.split_backward else ms
    peaks = []
    for codes in encoded:
        held = peak = 0
        for k in codes:
            if k < ms:
                held += 1
                if held > peak:
                    peak = held
            elif k >= release:
                held -= 1
        peaks.append(peak)
    return tuple(peaks)


def _missing(schedule: Schedule, counts: bytearray, num_ops: int) -> list[ScheduleProblem]:
    m, stages = schedule.microbatches, schedule.num_stages
    ms = m * stages
    problems = []
    for k in range(num_ops * ms):
        if not counts[k]:
            a = Action(_OPS[k // ms], (k % ms) // stages, k % stages)
            owner = schedule.stage_ranks[a.stage]
            problems.append(
                ScheduleProblem(
                    "missing", owner, a, f"{a} is missing: no rank runs it (stage {a.stage} is on rank {owner})"
                )
            )
    return problems


@attrs.frozen
class _Run:
    starts: tuple[tuple[float, ...], ...]
    ends: tuple[tuple[float, ...], ...]
    blocked: tuple[tuple[int, Action, Action] | None, ...]  # rank -> (position, action, waits for)

    @property
    def stuck(self) -> bool:
        return any(b is not None for b in self.blocked)


def _steps(schedule: Schedule, encoded: list[list[int]]) -> tuple[messages.RankSteps, ...]:
    """The message steps of a complete schedule, as the runtime posts them just in time, with
    their receives checked against the sends (module docstring)."""
    steps = messages.step_codes(schedule, encoded)
    _check_receives(schedule, steps)
    return steps


def _check_receives(schedule: Schedule, steps: Sequence[messages.RankSteps]) -> None:
    """Between each pair of ranks the j-th receive posted is for the j-th message sent, and each
    is posted by the step that waits for it. Otherwise the runtime would hand an action another
    step's message: a fault of the message pass, not of the schedule, hence asserts.

    Posting a receive never blocks, so when a rank posts it changes no time; that the receives
    match the sends in order is the whole of what posting decides, and it holds for every run
    once it holds for the lists, whatever the timing."""
    pp, S, stage_ranks = schedule.pp, schedule.num_stages, schedule.stage_ranks
    ms = schedule.microbatches * S
    # the rank each F's output, each B's input gradient goes to, by code (stage s at code % S)
    to_rank = (*stage_ranks[1:], -1) * schedule.microbatches + (-1, *stage_ranks[:-1]) * schedule.microbatches
    count = [0] * (pp * pp)  # src * pp + dst -> messages so far
    sent_slot = [-1] * (2 * ms)  # message -> its place among those its sender sends its receiver
    for src, rank in enumerate(steps):
        base = src * pp
        for k in filter((-1).__lt__, rank.sends):
            pair = base + to_rank[k]
            sent_slot[k] = count[pair]
            count[pair] += 1
    sent_count, count = count, [0] * (pp * pp)
    posted_at = [2 * ms] * (2 * ms)  # message -> its place among its receiver's posts (2 ms: none)
    for dst, rank in enumerate(steps):
        for at, k in enumerate(rank.posts):
            pair = stage_ranks[k % S] * pp + dst
            assert sent_slot[k] == count[pair], f"rank {dst} posts its receives out of its peers' send order"
            count[pair] += 1
            posted_at[k] = at
        for msg, end in zip(rank.needs, rank.post_end):
            assert msg < 0 or posted_at[msg] < end, f"rank {dst} waits for a message it has not posted"
    assert count == sent_count, "a message is sent that its receiver never posts"


def _run(schedule: Schedule, encoded: list[list[int]], steps: Sequence[messages.RankSteps],
         costs: Sequence[Sequence[float]], latency: float) -> _Run:
    """Event-driven execution of a complete schedule's message steps, on the codes from ``_encode``."""
    m, S = schedule.microbatches, schedule.num_stages
    ms, ms2, last = m * S, 2 * m * S, S - 1
    stage_rank = schedule.stage_ranks
    end_time = [-1.0] * (3 * ms)  # -1: has not run (costs are >= 0)
    waiter = [-1] * (3 * ms)  # action -> the rank blocked on it, or -1; see ``_advance``
    ptr = [0] * schedule.pp
    free = [0.0] * schedule.pp
    starts: list[list[float]] = [[] for _ in range(schedule.pp)]
    ends: list[list[float]] = [[] for _ in range(schedule.pp)]
    blocked_on = [-1] * schedule.pp
    todo = list(range(schedule.pp))
    # the hot loop of the simulator: plain ints and lists, dependencies inlined
    while todo:
        r = todo.pop()
        seq, need, cost, i, t = encoded[r], steps[r].needs, costs[r], ptr[r], free[r]
        n = len(seq)
        rank_starts, rank_ends = starts[r], ends[r]
        blocked_on[r] = -1
        while i < n:
            k = seq[i]
            stage = k % S
            # what the action waits for (module docstring), d1 then d2. A message is the code of
            # the action that sent it, which went out when that action ended: the step's
            # message, else a handover on this rank (d1 of an F, d2 of a B); a B's F, a W's B (d1)
            d2 = -1
            if k < ms:
                d1 = need[i]
                if d1 < 0 and stage:
                    d1 = k - 1
            else:
                d1 = k - ms
                if k < ms2:
                    d2 = need[i]
                    if d2 < 0 and stage != last:
                        d2 = k + 1
            start = t
            if d1 >= 0:
                e = end_time[d1]
                if e < 0:
                    blocked_on[r] = d1
                    break
                if latency and stage_rank[d1 % S] != r:
                    e += latency
                if e > start:
                    start = e
            if d2 >= 0:
                e = end_time[d2]
                if e < 0:
                    blocked_on[r] = d2
                    break
                if latency and stage_rank[d2 % S] != r:
                    e += latency
                if e > start:
                    start = e
            t = start + cost[i]
            rank_starts.append(start)
            rank_ends.append(t)
            end_time[k] = t
            if waiter[k] >= 0:
                todo.append(waiter[k])
            i += 1
        ptr[r], free[r] = i, t
        if blocked_on[r] >= 0:
            waiter[blocked_on[r]] = r
    return _Run(tuple(map(tuple, starts)), tuple(map(tuple, ends)), _blocked(schedule, encoded, ptr, blocked_on))


def _advance(schedule: Schedule, encoded: list[list[int]], steps: Sequence[messages.RankSteps]) -> _Run:
    """``_run`` without the clock, for ``validate``: which actions run, and where ranks stop.

    The actions that can run do not depend on costs or on the order ranks are visited in,
    so each rank stops at the same action, waiting for the same dependency, as in ``_run``.
    """
    m, S = schedule.microbatches, schedule.num_stages
    ms, ms2, last = m * S, 2 * m * S, S - 1
    done = bytearray(3 * ms)
    # action -> the rank blocked on it, or -1. Only one other rank can wait for an action
    # (the one running the next stage's F, or the previous stage's B); a rank waiting for
    # its own later action is stuck for good, so losing track of it changes nothing.
    waiter = [-1] * (3 * ms)
    ptr = [0] * schedule.pp
    blocked_on = [-1] * schedule.pp
    todo = list(range(schedule.pp))
    while todo:
        r = todo.pop()
        seq, need, i = encoded[r], steps[r].needs, ptr[r]
        n = len(seq)
        d = -1
        while i < n:
            k = seq[i]
            # the dependencies of ``_run``, in the same order
            if k < ms:
                e = need[i]
                if e < 0 and k % S:
                    e = k - 1
                if e >= 0 and not done[e]:
                    d = e
                    break
            else:
                if not done[k - ms]:
                    d = k - ms
                    break
                if k < ms2:
                    e = need[i]
                    if e < 0 and k % S != last:
                        e = k + 1
                    if e >= 0 and not done[e]:
                        d = e
                        break
            done[k] = 1
            if waiter[k] >= 0:
                todo.append(waiter[k])
            i += 1
        ptr[r], blocked_on[r] = i, d
        if d >= 0:
            waiter[d] = r
    empty = tuple(() for _ in range(schedule.pp))
    return _Run(empty, empty, _blocked(schedule, encoded, ptr, blocked_on))


def _blocked(
    schedule: Schedule, encoded: list[list[int]], ptr: list[int], blocked_on: list[int]
) -> tuple[tuple[int, Action, Action] | None, ...]:
    """Per rank, None when it ran all its actions, else (position, action, what it waits for)."""
    ms, S = schedule.microbatches * schedule.num_stages, schedule.num_stages

    def decode(k: int) -> Action:
        return Action(_OPS[k // ms], (k % ms) // S, k % S)

    return tuple(
        (ptr[r], schedule.ranks[r][ptr[r]], decode(blocked_on[r])) if ptr[r] < len(encoded[r]) else None
        for r in range(schedule.pp)
    )


def _stuck_problems(schedule: Schedule, run: _Run) -> list[ScheduleProblem]:
    """Explain why the blocked ranks cannot advance: a same-rank order error, or a deadlock."""
    position = {a: (r, i) for r, acts in enumerate(schedule.ranks) for i, a in enumerate(acts)}
    waits_for_rank: dict[int, int] = {}
    problems: list[ScheduleProblem] = []
    for rank, info in enumerate(run.blocked):
        if info is None:
            continue
        pos, action, dep = info
        dep_rank, dep_pos = position[dep]
        if dep_rank == rank:
            problems.append(
                ScheduleProblem(
                    "order", rank, action,
                    f"rank {rank} runs {action} at position {pos} before {dep}, which it needs "
                    f"and runs itself later, at position {dep_pos}",
                )
            )
            continue
        waits_for_rank[rank] = dep_rank
        other = run.blocked[dep_rank]
        assert other is not None, "a rank that finished would have run the dependency"
        problems.append(
            ScheduleProblem(
                "deadlock", rank, action,
                f"rank {rank} is blocked at {action} (position {pos}): it waits for {dep} from "
                f"rank {dep_rank} (its position {dep_pos}), which is blocked at {other[1]} "
                f"(position {other[0]})",
            )
        )
    cycle = _find_cycle(waits_for_rank)
    if cycle:
        path = " -> ".join(f"rank {r}" for r in cycle + [cycle[0]])
        problems = [
            attrs.evolve(p, message=f"{p.message}; wait cycle: {path}")
            if p.kind == "deadlock" and p.rank in cycle
            else p
            for p in problems
        ]
    return problems


def _find_cycle(edges: dict[int, int]) -> list[int]:
    """A cycle in a graph where each node has at most one outgoing edge, or []."""
    for start in edges:
        path: list[int] = []
        node: int | None = start
        while node is not None and node not in path:
            path.append(node)
            node = edges.get(node)
        if node is not None:
            return path[path.index(node):]
    return []
