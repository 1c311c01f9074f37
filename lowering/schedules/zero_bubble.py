"""Zero-bubble schedules (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024).

The backward is split into B (input gradient, on the critical path) and W (weight gradient,
free to move later), and W fills the bubbles that 1F1B leaves. As in the paper, the per-rank
order is built by list scheduling: a unit-cost simulation (F = B = W = 1) in which every free
rank starts, at each step, the ready action of highest priority, never holding more
activations than its memory caps. Only the resulting order is kept: the runtime and the
simulator run it whatever the real costs are.

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

from collections import deque
from collections.abc import Sequence

import attrs

from ._common import (
    assemble,
    basic_problem,
    bwd,
    chunks_problem,
    fwd,
    loop_placement,
    raise_if,
    v_placement,
    wgt,
)
from .ir import Action, Schedule

_NEVER = 1 << 60


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


_Step = tuple[str, int, int]  # (op, microbatch, stage): cheaper than Action while searching


@attrs.frozen
class _Built:
    order: list[list[_Step]]
    makespan: int  # under unit costs
    peak: int  # most activations any rank holds until W


def _list_schedule(plan: _Plan, priority: str, give_up_at: int) -> _Built | None:
    """Unit-cost list scheduling; priority orders the kinds a free rank tries, e.g. "FBW".

    Every action lasts one step, so at step t an action is ready when its dependencies
    ended at or before t, and ranks decide independently within a step. Each stage runs
    its F, B and W in microbatch order. None when the caps starve the pipeline or the
    order would not finish by step ``give_up_at``.
    """
    m, pp, num_stages = plan.microbatches, plan.pp, len(plan.stage_ranks)
    last = num_stages - 1
    f_end = [[_NEVER] * m for _ in range(num_stages)]
    b_end = [[_NEVER] * m for _ in range(num_stages)]
    f_next = [0] * num_stages
    b_next = [0] * num_stages
    pending_w: list[deque[_Step]] = [deque() for _ in range(pp)]
    before_b = [0] * pp
    before_w = [0] * pp
    order: list[list[_Step]] = [[] for _ in range(pp)]
    f_pref, b_pref = plan.f_preference, plan.b_preference
    cap_b, cap_w = plan.cap_until_b, plan.cap_until_w
    remaining = 3 * m * num_stages
    peak = 0
    t = 0
    while remaining:
        if t >= give_up_at:
            return None
        started = 0
        for r in range(pp):
            chosen: _Step | None = None
            for kind in priority:
                if kind == "B":
                    for s in b_pref[r]:
                        mb = b_next[s]
                        if mb < m and f_end[s][mb] <= t and (s == last or b_end[s + 1][mb] <= t):
                            chosen = ("B", mb, s)
                            b_end[s][mb] = t + 1
                            b_next[s] = mb + 1
                            before_b[r] -= 1
                            pending_w[r].append(("W", mb, s))
                            break
                elif kind == "F":
                    if before_b[r] < cap_b[r] and before_w[r] < cap_w[r]:
                        for s in f_pref[r]:
                            mb = f_next[s]
                            if mb < m and (s == 0 or f_end[s - 1][mb] <= t):
                                chosen = ("F", mb, s)
                                f_end[s][mb] = t + 1
                                f_next[s] = mb + 1
                                before_b[r] += 1
                                before_w[r] += 1
                                if before_w[r] > peak:
                                    peak = before_w[r]
                                break
                elif pending_w[r]:
                    chosen = pending_w[r].popleft()
                    before_w[r] -= 1
                if chosen is not None:
                    order[r].append(chosen)
                    started += 1
                    break
        if not started:
            # nothing ran in this step, so nothing new is ready in the next one either
            return None
        remaining -= started
        t += 1
    return _Built(order=order, makespan=t, peak=peak)


_MAKE = {"F": fwd, "B": bwd, "W": wgt}


def _best_order(candidates: Sequence[tuple[_Plan, str]], lower_bound: int) -> list[list[Action]]:
    """The first (plan, priority) whose order reaches the lower bound, else the best one."""
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
    return [[_MAKE[op](mb, s) for op, mb, s in steps] for steps in best.order]


def zbh1_problem(pp: int, microbatches: int, chunks: int) -> str | None:
    return basic_problem(pp, microbatches, chunks) or chunks_problem(chunks, "== 1", chunks == 1)


def zbh1(pp: int, microbatches: int, chunks: int = 1) -> Schedule:
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
    order = _best_order([(plan, "FBW"), (plan, "BFW")], lower_bound=3 * microbatches + pp - 1)
    return assemble("zbh1", pp, microbatches, 1, True, plan.stage_ranks, order)


def zbv_problem(pp: int, microbatches: int, chunks: int) -> str | None:
    return basic_problem(pp, microbatches, chunks) or chunks_problem(chunks, "== 2 (V placement)", chunks == 2)


def zbv(pp: int, microbatches: int, chunks: int = 2) -> Schedule:
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
    order = _best_order([(plan, "FBW"), (plan, "BFW")], lower_bound=6 * microbatches + pp - 1)
    return assemble("zbv", pp, microbatches, 2, True, plan.stage_ranks, order)


def interleaved_zb_problem(pp: int, microbatches: int, chunks: int) -> str | None:
    return basic_problem(pp, microbatches, chunks) or chunks_problem(chunks, ">= 2", chunks >= 2)


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


def interleaved_zb(pp: int, microbatches: int, chunks: int = 2) -> Schedule:
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
    order = _best_order(candidates, lower_bound=3 * chunks * microbatches + pp - 1)
    return assemble("interleaved_zb", pp, microbatches, chunks, True, loop_placement(pp, chunks), order)
