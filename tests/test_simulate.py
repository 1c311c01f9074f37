"""The schedule simulator and validator."""

from __future__ import annotations

import itertools
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ppdsl.core.schedules import STYLES, generate, style_problem
from ppdsl.core.schedules.ir import Action, Op, Schedule
from ppdsl.core.schedules.messages import Message, message_steps
from ppdsl.core.schedules.simulate import (
    ScheduleProblem,
    SimResult,
    _encode,
    _steps,
    peak_activations,
    simulate,
    unit_cost,
    validate,
)


def F(mb: int, s: int) -> Action:
    return Action(Op.F, mb, s)


def B(mb: int, s: int) -> Action:
    return Action(Op.B, mb, s)


def W(mb: int, s: int) -> Action:
    return Action(Op.W, mb, s)


def two_rank(rank0: list[Action], rank1: list[Action], m: int = 2, split: bool = False) -> Schedule:
    return Schedule("hand", 2, m, 1, split, (0, 1), (tuple(rank0), tuple(rank1)))


# -- timing -------------------------------------------------------------------------------


def test_unit_cost_timeline_by_hand() -> None:
    sim = simulate(generate("1f1b", 2, 2, 1))
    times = sim.times()
    assert times[F(0, 0)] == (0.0, 1.0)
    assert times[F(0, 1)] == (1.0, 2.0)
    assert times[B(0, 1)] == (2.0, 4.0)  # unsplit backward costs 2
    assert times[F(1, 0)] == (1.0, 2.0)
    assert times[B(0, 0)] == (4.0, 6.0)
    assert times[F(1, 1)] == (4.0, 5.0)
    assert times[B(1, 1)] == (5.0, 7.0)
    assert times[B(1, 0)] == (7.0, 9.0)
    assert sim.makespan == 9.0
    assert sim.busy == (6.0, 6.0)
    assert sim.bubble == pytest.approx((9 - 6) * 2 / (2 * 9))


def test_latency_and_custom_costs() -> None:
    schedule = generate("gpipe", 2, 1, 1)
    sim = simulate(schedule, p2p_latency=0.5)
    times = sim.times()
    assert times[F(0, 1)] == (1.5, 2.5)
    assert times[B(0, 0)] == (5.0, 7.0)
    assert sim.makespan == 7.0

    def cost(a: Action) -> float:
        return {Op.F: 2.0, Op.B: 3.0, Op.W: 0.0}[a.op]

    assert simulate(schedule, cost=cost).makespan == 2 + 2 + 3 + 3


def test_same_rank_handover_has_no_latency() -> None:
    # zbv: stages 3 and 4 both live on the last rank
    sim = simulate(generate("zbv", 4, 4, 2), p2p_latency=10.0)
    times = sim.times()
    assert times[F(0, 4)][0] == times[F(0, 3)][1]


def test_split_backward_unit_costs() -> None:
    schedule = generate("zbh1", 2, 2, 1)
    cost = unit_cost(schedule)
    assert [cost(a) for a in (F(0, 0), B(0, 0), W(0, 0))] == [1.0, 1.0, 1.0]
    assert unit_cost(generate("1f1b", 2, 2, 1))(B(0, 0)) == 2.0


def test_slots_follow_rank_order() -> None:
    schedule = generate("interleaved", 2, 4, 2)
    sim = simulate(schedule)
    for r in range(schedule.pp):
        slots = sim.slots(r)
        assert [s.action for s in slots] == list(schedule.ranks[r])
        assert all(a.end <= b.start for a, b in zip(slots, slots[1:]))


# -- peaks ----------------------------------------------------------------------------------


def test_peak_counts_until_backward_or_weight_gradient() -> None:
    unsplit = two_rank([F(0, 0), F(1, 0), B(0, 0), B(1, 0)], [F(0, 1), B(0, 1), F(1, 1), B(1, 1)])
    assert peak_activations(unsplit) == (2, 1)
    split = Schedule(
        "hand", 2, 2, 1, True, (0, 1),
        (
            (F(0, 0), F(1, 0), B(0, 0), W(0, 0), B(1, 0), W(1, 0)),
            (F(0, 1), B(0, 1), F(1, 1), B(1, 1), W(0, 1), W(1, 1)),
        ),
    )
    assert peak_activations(split) == (2, 2)  # rank 1 holds mb 0 until its W
    assert validate(split) == []


# -- validation ----------------------------------------------------------------------------


def cyclic_deadlock() -> Schedule:
    # rank 0 waits at B0 for rank 1's B0; rank 1 first runs F1, which needs rank 0's F1
    return two_rank([F(0, 0), B(0, 0), F(1, 0), B(1, 0)], [F(1, 1), F(0, 1), B(0, 1), B(1, 1)])


def test_deadlock_names_each_blocked_rank_and_what_it_waits_for() -> None:
    problems = validate(cyclic_deadlock())
    assert {p.kind for p in problems} == {"deadlock"}
    by_rank = {p.rank: p for p in problems}
    assert set(by_rank) == {0, 1}
    assert by_rank[0].action == B(0, 0)
    assert by_rank[1].action == F(1, 1)
    assert "waits for B0s1 from rank 1" in by_rank[0].message
    assert "waits for F1s0 from rank 0" in by_rank[1].message
    assert "wait cycle: rank 0 -> rank 1 -> rank 0" in by_rank[0].message


def test_simulate_reports_deadlock_with_partial_times() -> None:
    sim = simulate(cyclic_deadlock())
    assert not sim.ok
    assert {p.kind for p in sim.problems} == {"deadlock"}
    assert sim.slots(0)[0].action == F(0, 0) and len(sim.slots(0)) == 1
    assert sim.slots(1) == ()


def test_rank_waiting_on_a_stuck_rank_is_named_too() -> None:
    # rank 0 lists B before its own F (an order error); ranks 1 and 2 then wait on it
    schedule = Schedule(
        "hand", 3, 1, 1, False, (0, 1, 2),
        ((B(0, 0), F(0, 0)), (F(0, 1), B(0, 1)), (F(0, 2), B(0, 2))),
    )
    problems = validate(schedule)
    kinds = {p.rank: p.kind for p in problems}
    assert kinds == {0: "order", 1: "deadlock", 2: "deadlock"}
    order = next(p for p in problems if p.kind == "order")
    assert order.action == B(0, 0) and "F0s0" in order.message


def test_weight_gradient_before_its_backward_is_an_order_problem() -> None:
    schedule = Schedule(
        "hand", 1, 1, 1, True, (0,), ((F(0, 0), W(0, 0), B(0, 0)),),
    )
    assert [p.kind for p in validate(schedule)] == ["order"]


def test_missing_duplicate_wrong_rank_unexpected() -> None:
    schedule = two_rank(
        [F(0, 0), F(0, 0), F(1, 0), B(1, 0), F(0, 1), Action(Op.F, 5, 0)],
        [F(0, 1), B(0, 1), F(1, 1), B(1, 1), W(1, 1)],
    )
    problems = validate(schedule)
    kinds = sorted(p.kind for p in problems)
    assert kinds == ["duplicate", "duplicate", "missing", "unexpected", "unexpected", "wrong_rank"]
    missing = next(p for p in problems if p.kind == "missing")
    assert missing.action == B(0, 0) and missing.rank == 0
    wrong = next(p for p in problems if p.kind == "wrong_rank")
    assert wrong.rank == 0 and wrong.action == F(0, 1)
    sim = simulate(schedule)
    assert not sim.ok and sim.makespan == 0.0


def test_split_schedule_without_weight_gradients_is_incomplete() -> None:
    schedule = generate("zbh1", 2, 2, 1)
    stripped = Schedule(
        schedule.style, 2, 2, 1, True, schedule.stage_ranks,
        tuple(tuple(a for a in acts if a.op is not Op.W) for acts in schedule.ranks),
    )
    problems = validate(stripped)
    assert len(problems) == 4 and {p.kind for p in problems} == {"missing"}


def test_malformed_schedules_raise_value_error() -> None:
    with pytest.raises(ValueError, match="rank lists"):
        validate(Schedule("x", 2, 1, 1, False, (0, 1), ((F(0, 0), B(0, 0)),)))
    with pytest.raises(ValueError, match="places 1 stages"):
        simulate(Schedule("x", 1, 1, 2, False, (0,), ((),)))
    with pytest.raises(ValueError, match="outside"):
        validate(Schedule("x", 1, 1, 1, False, (3,), ((),)))
    with pytest.raises(ValueError, match="p2p_latency"):
        simulate(generate("gpipe", 2, 2, 1), p2p_latency=-1.0)
    with pytest.raises(ValueError, match="costs"):
        simulate(generate("gpipe", 2, 2, 1), cost=lambda a: -1.0)


def test_problem_and_result_are_frozen() -> None:
    problem = ScheduleProblem("missing", 0, F(0, 0), "m")
    sim = simulate(generate("gpipe", 2, 2, 1))
    assert isinstance(sim, SimResult)
    with pytest.raises(AttributeError):
        problem.kind = "order"  # type: ignore[misc]
    with pytest.raises(AttributeError):
        sim.bubble = 0.0  # type: ignore[misc]


# -- properties ------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    style=st.sampled_from(sorted(STYLES)),
    p=st.integers(1, 5),
    m=st.integers(1, 10),
    v=st.sampled_from([1, 2, 3]),
    f=st.floats(0.1, 3.0),
    b=st.floats(0.1, 3.0),
    w=st.floats(0.0, 3.0),
    latency=st.floats(0.0, 2.0),
)
def test_any_costs_respect_dependencies_and_rank_order(
    style: str, p: int, m: int, v: int, f: float, b: float, w: float, latency: float
) -> None:
    if style_problem(style, p, m, v) is not None:
        return
    schedule = generate(style, p, m, v)
    costs = {Op.F: f, Op.B: b, Op.W: w}
    sim = simulate(schedule, cost=lambda a: costs[a.op], p2p_latency=latency)
    assert sim.ok
    times = sim.times()
    for r in range(p):
        slots = sim.slots(r)
        assert all(x.end <= y.start + 1e-9 for x, y in zip(slots, slots[1:]))
    for a, (start, _) in times.items():
        deps = []
        if a.op is Op.F and a.stage > 0:
            deps = [F(a.microbatch, a.stage - 1)]
        elif a.op is Op.B:
            deps = [F(a.microbatch, a.stage)]
            if a.stage < schedule.num_stages - 1:
                deps.append(B(a.microbatch, a.stage + 1))
        elif a.op is Op.W:
            deps = [B(a.microbatch, a.stage)]
        for d in deps:
            hop = latency if schedule.stage_ranks[d.stage] != schedule.stage_ranks[a.stage] else 0.0
            assert start + 1e-9 >= times[d][1] + hop
    assert 0.0 <= sim.bubble < 1.0
    assert sim.makespan >= max(sim.busy) - 1e-9


@settings(max_examples=60, deadline=None)
@given(
    style=st.sampled_from(sorted(STYLES)),
    p=st.integers(1, 4),
    m=st.integers(1, 6),
    v=st.sampled_from([1, 2]),
    moves=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 10**6), st.integers(0, 10**6)), max_size=4),
)
def test_validate_agrees_with_simulate_on_reordered_schedules(
    style: str, p: int, m: int, v: int, moves: list[tuple[int, int, int]]
) -> None:
    # validate walks the schedule without the clock; it must stop where simulate stops
    if style_problem(style, p, m, v) is not None:
        return
    schedule = generate(style, p, m, v)
    ranks = [list(actions) for actions in schedule.ranks]
    for rank, src, dst in moves:
        actions = ranks[rank % p]
        if actions:
            actions.insert(dst % len(actions), actions.pop(src % len(actions)))
    moved = Schedule(schedule.style, p, m, v, schedule.split_backward, schedule.stage_ranks, tuple(map(tuple, ranks)))
    sim = simulate(moved)
    assert validate(moved) == list(sim.problems)
    assert sim.peak_activations == peak_activations(moved)


# -- the message steps the runtime executes ----------------------------------------------------


def _shipped(pps: tuple[int, ...] = (1, 2, 3, 4), ms: tuple[int, ...] = (1, 2, 4, 8)) -> list[Schedule]:
    out = []
    for style, p, m, v in itertools.product(STYLES, pps, ms, (1, 2, 3)):
        if style_problem(style, p, m, v) is None:
            out.append(generate(style, p, m, v))
    return out


def test_the_simulator_runs_the_steps_the_executor_walks() -> None:
    # runtime.pipeline.executor walks messages.message_steps; the simulator runs _steps: one pass, one list
    for schedule in _shipped():
        encoded, problems = _encode(schedule)
        assert problems == []
        ran = _steps(schedule, encoded)
        for rank in range(schedule.pp):
            walked = message_steps(schedule, rank)
            assert [s.action for s in walked] == list(schedule.ranks[rank])
            for i, step in enumerate(walked):
                code = ran[rank]
                assert [_code(schedule, m) for m in step.post] == list(code.posted(i))
                assert _code(schedule, step.needs) == code.needs[i]
                assert _code(schedule, step.send) == code.sends[i]


def test_every_shipped_style_runs_to_completion_through_its_message_steps() -> None:
    for schedule in _shipped(pps=(1, 2, 3, 4, 8), ms=(1, 2, 3, 4, 8, 16)):
        sim = simulate(schedule)
        assert sim.ok and validate(schedule) == [], (schedule.style, schedule.pp, schedule.microbatches)
        assert all(len(ends) == len(actions) for ends, actions in zip(sim.ends, schedule.ranks))


def test_a_broken_action_list_is_stuck_where_its_messages_wait() -> None:
    # rank 0 waits at B0 for rank 1's gradient message, rank 1 at F1 for rank 0's activation: the
    # steps name the messages, validate reports the two ranks and their cycle
    schedule = cyclic_deadlock()
    steps = [message_steps(schedule, r) for r in range(2)]
    b00 = steps[0][1]
    assert b00.action == B(0, 0) and b00.needs is not None and b00.needs.kind == "grad" and b00.needs.src == 1
    f11 = steps[1][0]
    assert f11.action == F(1, 1) and f11.needs is not None and f11.needs.kind == "act" and f11.needs.src == 0
    problems = validate(schedule)
    assert {(p.rank, p.action) for p in problems} == {(0, b00.action), (1, f11.action)}
    assert all("wait cycle: rank 0 -> rank 1 -> rank 0" in p.message for p in problems)


def _code(schedule: Schedule, message: Message | None) -> int:
    """A message as the code of the action that sends it (core.schedules.messages)."""
    if message is None:
        return -1
    op, stage = (0, message.stage - 1) if message.kind == "act" else (1, message.stage + 1)
    return (op * schedule.microbatches + message.microbatch) * schedule.num_stages + stage


# -- speed -----------------------------------------------------------------------------------


def test_large_schedule_is_fast() -> None:
    # pp=64, m=256, v=2: about 65k actions; O(n) event-driven simulation, not time steps
    start = time.perf_counter()
    schedule = generate("interleaved", 64, 256, 2)
    sim = simulate(schedule)
    elapsed = time.perf_counter() - start
    assert sim.ok and sim.bubble == pytest.approx(63 / (512 + 63))
    assert elapsed < 4.0  # about 0.4 s on one core; generous for loaded CI machines
