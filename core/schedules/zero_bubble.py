"""Zero-bubble schedules (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024).

The backward is split into B (input gradient, on the critical path) and W (weight gradient,
free to move later), and W fills the bubbles that 1F1B leaves. As in the paper, the per-rank
order is built by list scheduling: a unit-cost simulation (F = B = W = 1) in which every free
rank starts, at each step, the ready action of highest priority, never holding more
activations than its memory caps. Only the resulting order is kept: the runtime and the
simulator run it whatever the real costs are. Given measured costs (F, B, W seconds per
virtual stage: ``pipeline.profile``), the same list scheduling runs on them instead of unit
steps, as the paper's automatic scheduler does; the caps, and so the memory, stay the same.

- ``zbh1``: one chunk per rank, loop placement. Rank r holds at most 1F1B's pp - r
  activations before their B and pp until their W. Bubble (pp-1)(F+B-W) = pp - 1 steps,
  against 1F1B's (pp-1)(F+B+W).
- ``zbv``: two chunks in a V (rank r holds stages r and 2pp-1-r), at most 2pp activations
  per rank. With unit costs the optimum 6m + pp - 1 (the last rank's first input arrives at
  step pp - 1) is reached from about 2pp microbatches on.
- ``interleaved_zb``: loop placement with v chunks. Activations per rank are capped at v*pp
  first and, when that cannot reach the unit-cost optimum 3vm + pp - 1, at interleaved
  1F1B's own peak on rank 0, (v+1)pp - 1.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence

import attrs

from ._common import assemble, basic_problem, chunks_problem, loop_placement, raise_if, v_placement
from .ir import Action, Op, Schedule

_NEVER = 1 << 60
StageCosts = Sequence[tuple[float, float, float]]  # per virtual stage: F, B, W seconds


@attrs.frozen
class _Plan:
    """What the list scheduler needs: placement, memory caps and stage priorities."""

    pp: int
    microbatches: int
    stage_ranks: tuple[int, ...]
    cap_until_b: tuple[int, ...]  # per rank: most activations whose B has not run
    cap_until_w: tuple[int, ...]  # per rank: most activations whose W has not run
    # per rank, its stages in the order they are tried for F and for B
    f_preference: tuple[tuple[int, ...], ...]
    b_preference: tuple[tuple[int, ...], ...]


# A rank's order is kept as int codes while searching, (op * m + microbatch) * stages + stage
# with op 0, 1, 2 for F, B, W: ints, unlike tuples or Actions, are no work for the garbage
# collector, which otherwise takes a good part of the run at pp=64.
_OPS = (Op.F, Op.B, Op.W)

# A stage's end times: row[mb] is when F (or B) of microbatch mb ended, _NEVER until it has
# run. Rows have one extra _NEVER entry at index m, so "the stage's next microbatch is
# ready" is a single comparison even when all m have run.
_Row = list[int]


@attrs.frozen
class _Built:
    order: list[list[int]]  # per rank, action codes
    makespan: int  # under unit costs
    peak: int  # most activations any rank holds until W


@attrs.frozen
class _Candidates:
    """Per rank, what its F and B may run, in preference order, with the rows they read.

    f: (stage, its F row, the F row of the stage before, or an always-ready row for stage 0);
    b: (stage, its B row, its F row, the B row of the stage after, or an always-ready row).
    """

    f: list[list[tuple[int, _Row, _Row]]]
    b: list[list[tuple[int, _Row, _Row, _Row]]]


def _candidates(plan: _Plan, f_end: list[_Row], b_end: list[_Row]) -> _Candidates:
    m, last = plan.microbatches, len(plan.stage_ranks) - 1
    ready = [0] * m + [_NEVER]  # the input of stage 0 and the loss gradient of the last stage
    f = [[(s, f_end[s], f_end[s - 1] if s else ready) for s in stages] for stages in plan.f_preference]
    b = [
        [(s, b_end[s], f_end[s], b_end[s + 1] if s != last else ready) for s in stages]
        for stages in plan.b_preference
    ]
    return _Candidates(f, b)


def _list_schedule(plan: _Plan, priority: str, give_up_at: int) -> _Built | None:
    """Unit-cost list scheduling; priority orders the kinds a free rank tries, e.g. "FBW".

    Every action lasts one step, so at step t an action is ready when its dependencies
    ended at or before t, and ranks decide independently within a step. Each stage runs
    its F, B and W in microbatch order. None when the caps starve the pipeline or the
    order would not finish by step ``give_up_at``.
    """
    m, pp, num_stages = plan.microbatches, plan.pp, len(plan.stage_ranks)
    ms = m * num_stages
    f_end = [[_NEVER] * (m + 1) for _ in range(num_stages)]
    b_end = [[_NEVER] * (m + 1) for _ in range(num_stages)]
    cands = _candidates(plan, f_end, b_end)
    f_cands, b_cands = cands.f, cands.b
    kinds = [{"F": 0, "B": 1, "W": 2}[kind] for kind in priority]
    f_next = [0] * num_stages
    b_next = [0] * num_stages
    pending_w: list[deque[int]] = [deque() for _ in range(pp)]
    before_b = [0] * pp
    before_w = [0] * pp
    order: list[list[int]] = [[] for _ in range(pp)]
    cap_b, cap_w = plan.cap_until_b, plan.cap_until_w
    remaining = 3 * ms
    peak = 0
    t = 0
    # the hot loop of the generator: plain ints and lists, the three kinds inlined
    while remaining:
        if t >= give_up_at:
            return None
        started = 0
        done = t + 1
        for r in range(pp):
            chosen = -1  # the code of the action rank r starts, if any
            for kind in kinds:
                if kind == 0:
                    if before_b[r] < cap_b[r] and before_w[r] < cap_w[r]:
                        for s, own, prev in f_cands[r]:
                            mb = f_next[s]
                            if prev[mb] <= t:
                                chosen = mb * num_stages + s
                                own[mb] = done
                                f_next[s] = mb + 1
                                before_b[r] += 1
                                held = before_w[r] = before_w[r] + 1
                                if held > peak:
                                    peak = held
                                break
                elif kind == 1:
                    for s, own, fwd_row, next_row in b_cands[r]:
                        mb = b_next[s]
                        if fwd_row[mb] <= t and next_row[mb] <= t:
                            chosen = ms + mb * num_stages + s
                            own[mb] = done
                            b_next[s] = mb + 1
                            before_b[r] -= 1
                            pending_w[r].append(chosen + ms)
                            break
                elif pending_w[r]:
                    chosen = pending_w[r].popleft()
                    before_w[r] -= 1
                if chosen >= 0:
                    order[r].append(chosen)
                    started += 1
                    break
        if not started:
            # nothing ran in this step, so nothing new is ready in the next one either
            return None
        remaining -= started
        t += 1
    return _Built(order=order, makespan=t, peak=peak)


def _timed_list_schedule(plan: _Plan, priority: str, costs: StageCosts) -> _Built | None:
    """``_list_schedule`` on measured costs: an action of stage s lasts costs[s] (F, B, W). A rank
    free at time t starts the ready action of highest priority, or waits for the next action to
    end anywhere. Same caps and preferences; makespan in the costs' unit. None when stuck."""
    m, pp, num_stages = plan.microbatches, plan.pp, len(plan.stage_ranks)
    ms = m * num_stages
    f_end: list[list[float]] = [[_NEVER] * (m + 1) for _ in range(num_stages)]
    b_end: list[list[float]] = [[_NEVER] * (m + 1) for _ in range(num_stages)]
    cands = _candidates(plan, f_end, b_end)  # type: ignore[arg-type]
    kinds = [{"F": 0, "B": 1, "W": 2}[kind] for kind in priority]
    f_next = [0] * num_stages
    b_next = [0] * num_stages
    pending_w: list[deque[int]] = [deque() for _ in range(pp)]
    before_b = [0] * pp
    before_w = [0] * pp
    order: list[list[int]] = [[] for _ in range(pp)]
    left = [0] * pp  # actions each rank has still to start
    for r in plan.stage_ranks:
        left[r] += 3 * m
    inf = float("inf")
    free = [0.0 if left[r] else inf for r in range(pp)]  # when each rank next tries to start one
    waiting: set[int] = set()  # ranks that found nothing ready: they try again at the next end
    ends: list[float] = []  # a heap of the end times of started actions
    peak = 0
    makespan = 0.0
    while any(left):
        r = min(range(pp), key=lambda q: (free[q], q))
        t = free[r]
        if t == inf:
            return None  # every rank with work left waits on a dependency that never ends
        chosen, took = -1, 0.0
        for kind in kinds:
            if kind == 0:
                if before_b[r] < plan.cap_until_b[r] and before_w[r] < plan.cap_until_w[r]:
                    for s, own, prev in cands.f[r]:
                        mb = f_next[s]
                        if prev[mb] <= t:
                            chosen, took = mb * num_stages + s, costs[s][0]
                            own[mb] = t + took
                            f_next[s] = mb + 1
                            before_b[r] += 1
                            before_w[r] += 1
                            peak = max(peak, before_w[r])
                            break
            elif kind == 1:
                for s, own, fwd_row, next_row in cands.b[r]:
                    mb = b_next[s]
                    if fwd_row[mb] <= t and next_row[mb] <= t:
                        chosen, took = ms + mb * num_stages + s, costs[s][1]
                        own[mb] = t + took
                        b_next[s] = mb + 1
                        before_b[r] -= 1
                        pending_w[r].append(chosen + ms)
                        break
            elif pending_w[r]:
                chosen = pending_w[r].popleft()
                took = costs[chosen % num_stages][2]
                before_w[r] -= 1
            if chosen >= 0:
                break
        if chosen < 0:
            while ends and ends[0] <= t:
                heapq.heappop(ends)
            free[r] = ends[0] if ends else inf
            waiting.add(r)
            continue
        end = t + took
        order[r].append(chosen)
        left[r] -= 1
        free[r] = end if left[r] else inf
        makespan = max(makespan, end)
        heapq.heappush(ends, end)
        for q in list(waiting):  # a new end may make their next action ready sooner
            if free[q] > end:
                free[q] = end
            if q == r or not left[q]:
                waiting.discard(q)
        waiting.discard(r)
    return _Built(order=order, makespan=makespan, peak=peak)  # type: ignore[arg-type]


def _actions(codes: list[int], microbatches: int, num_stages: int) -> list[Action]:
    ms = microbatches * num_stages
    return [Action(_OPS[k // ms], (k % ms) // num_stages, k % num_stages) for k in codes]


def _best_order(candidates: Sequence[tuple[_Plan, str]], lower_bound: int,
                costs: StageCosts | None = None) -> list[list[Action]]:
    """The first (plan, priority) whose order reaches the lower bound, else the best one. With
    measured costs: the candidate whose order, scheduled on them, ends first."""
    if costs is not None:
        timed = _best_timed_order(candidates, costs)
        if timed is not None:
            return timed
        # greedy on these costs, every candidate filled its caps and stuck: the unit-cost order
    best: _Built | None = None
    for plan, priority in candidates:
        # a later candidate must finish strictly earlier to replace the best so far
        built = _list_schedule(plan, priority, give_up_at=_NEVER if best is None else best.makespan)
        if built is None:
            continue
        if best is None or (built.makespan, built.peak) < (best.makespan, best.peak):
            best = built
        if built.makespan <= lower_bound:
            break
    assert best is not None, f"no candidate completes: {candidates}"
    plan = candidates[0][0]
    return [_actions(codes, plan.microbatches, len(plan.stage_ranks)) for codes in best.order]


def _best_timed_order(candidates: Sequence[tuple[_Plan, str]], costs: StageCosts) -> list[list[Action]] | None:
    plan = candidates[0][0]
    assert len(costs) == len(plan.stage_ranks), f"{len(costs)} stage costs for {len(plan.stage_ranks)} stages"
    built = [b for b in (_timed_list_schedule(p, priority, costs) for p, priority in candidates) if b is not None]
    if not built:
        return None
    best = min(built, key=lambda b: (b.makespan, b.peak))
    return [_actions(codes, plan.microbatches, len(plan.stage_ranks)) for codes in best.order]


def zbh1_problem(pp: int, microbatches: int, chunks: int) -> str | None:
    return basic_problem(pp, microbatches, chunks) or chunks_problem("zbh1", chunks)


def zbh1(pp: int, microbatches: int, chunks: int = 1, costs: StageCosts | None = None) -> Schedule:
    raise_if("zbh1", zbh1_problem(pp, microbatches, chunks))
    plan = _Plan(
        pp=pp,
        microbatches=microbatches,
        stage_ranks=loop_placement(pp, 1),
        cap_until_b=tuple(pp - r for r in range(pp)),
        cap_until_w=tuple(pp for _ in range(pp)),
        f_preference=tuple((r,) for r in range(pp)),
        b_preference=tuple((r,) for r in range(pp)),
    )
    # F first reaches 3m + pp - 1 for every pp and m we tried; B first is the fallback
    order = _best_order([(plan, "FBW"), (plan, "BFW")], lower_bound=3 * microbatches + pp - 1, costs=costs)
    return assemble("zbh1", pp, microbatches, 1, True, plan.stage_ranks, order)


def zbv_problem(pp: int, microbatches: int, chunks: int) -> str | None:
    return basic_problem(pp, microbatches, chunks) or chunks_problem("zbv", chunks)


def zbv(pp: int, microbatches: int, chunks: int = 2, costs: StageCosts | None = None) -> Schedule:
    raise_if("zbv", zbv_problem(pp, microbatches, chunks))
    plan = _Plan(
        pp=pp,
        microbatches=microbatches,
        stage_ranks=v_placement(pp),
        cap_until_b=tuple(2 * pp for _ in range(pp)),
        cap_until_w=tuple(2 * pp for _ in range(pp)),
        # forwards: the later stage first, which moves microbatches towards the loss (on
        # rank 0) and keeps the cap from filling with first-chunk activations;
        # backwards: the earlier stage first, which finishes microbatches
        f_preference=tuple((2 * pp - 1 - r, r) for r in range(pp)),
        b_preference=tuple((r, 2 * pp - 1 - r) for r in range(pp)),
    )
    # F first is optimal from about 2pp microbatches on; B first wins for m a little above pp
    order = _best_order([(plan, "FBW"), (plan, "BFW")], lower_bound=6 * microbatches + pp - 1, costs=costs)
    return assemble("zbv", pp, microbatches, 2, True, plan.stage_ranks, order)


def interleaved_zb_problem(pp: int, microbatches: int, chunks: int) -> str | None:
    return basic_problem(pp, microbatches, chunks) or chunks_problem("interleaved_zb", chunks)


def _interleaved_plan(pp: int, microbatches: int, chunks: int, cap: int, later_first: bool) -> _Plan:
    def stages(r: int) -> tuple[int, ...]:
        own = tuple(c * pp + r for c in range(chunks))
        return tuple(reversed(own)) if later_first else own

    return _Plan(
        pp=pp,
        microbatches=microbatches,
        stage_ranks=loop_placement(pp, chunks),
        cap_until_b=tuple(cap for _ in range(pp)),
        cap_until_w=tuple(cap for _ in range(pp)),
        f_preference=tuple(stages(r) for r in range(pp)),
        b_preference=tuple(stages(r) for r in range(pp)),
    )


def interleaved_zb(pp: int, microbatches: int, chunks: int = 2, costs: StageCosts | None = None) -> Schedule:
    raise_if("interleaved_zb", interleaved_zb_problem(pp, microbatches, chunks))
    small, interleaved_peak = chunks * pp, (chunks + 1) * pp - 1

    def plan(cap: int, later_first: bool) -> _Plan:
        return _interleaved_plan(pp, microbatches, chunks, cap, later_first)

    # tried in turn until one reaches the unit-cost optimum: the small cap first, then
    # interleaved 1F1B's own peak, so the result never needs more memory than interleaved
    candidates = [
        (plan(small, True), "BFW"),
        (plan(interleaved_peak, True), "BFW"),
        (plan(interleaved_peak, False), "BFW"),
    ]
    order = _best_order(candidates, lower_bound=3 * chunks * microbatches + pp - 1, costs=costs)
    return assemble("interleaved_zb", pp, microbatches, chunks, True, loop_placement(pp, chunks), order)
