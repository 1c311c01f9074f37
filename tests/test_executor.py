"""The pipeline executor: the message steps it walks (pure, core.schedules.messages), the split
backward (one process) and behaviour on 2 ranks beyond plain equivalence (evaluation, lookahead,
negative control)."""

from __future__ import annotations

import collections
import itertools
import random
from typing import Any

import attrs
import pytest
import torch
from torch import nn

from ppdsl.core.schedules import STYLES, generate
from ppdsl.core.schedules.ir import Action, Op, Schedule
from ppdsl.core.schedules.messages import Message, message_steps
from ppdsl.core.schedules.simulate import validate
from ppdsl.runtime.pipeline.split_backward import backward_input, backward_weight, graph_parameters

from _exec_harness import executor_checks_worker
from _tiny_models import chunks_for, tiny_plan
from dist_harness import run_distributed


# ---------------------------------------------------------------------------------------------
# Message steps
# ---------------------------------------------------------------------------------------------


def _schedules() -> list[Schedule]:
    out = []
    for style, pp, m in itertools.product(STYLES, (1, 2, 3, 4), (1, 2, 4, 8)):
        try:
            out.append(generate(style, pp, m, chunks_for(style)))
        except ValueError:
            continue  # a combination the style does not support
    return out


SCHEDULES = _schedules()


def _run_plan(schedule: Schedule, lookahead: int, forward_only: bool = False) -> dict[tuple[int, int], list[Message]]:
    """Execute every rank's plan with the executor's semantics (``_execute``). Asserts that every
    receive matches the message it expects and that no rank is ever stuck."""
    sent, stuck = _execute(schedule, lookahead, forward_only)
    assert not stuck, f"{schedule.style} pp={schedule.pp}: stuck at {stuck}"
    return sent


def _execute(schedule: Schedule, lookahead: int, forward_only: bool = False
             ) -> tuple[dict[tuple[int, int], list[Message]], dict[int, Action]]:
    """Walk every rank's message steps as the executor does: receives posted early, sends issued
    in the batch before the next action (or at the end), an action blocks until the message it
    consumes has been sent, matching per (src, dst) pair in order. Returns the messages sent per
    pair, and the action each rank is stuck at when none can go on ({} when all finished)."""
    plans = [message_steps(schedule, r, forward_only=forward_only, lookahead=lookahead) for r in range(schedule.pp)]
    sent: dict[tuple[int, int], list[Message]] = collections.defaultdict(list)
    posted: dict[tuple[int, int], list[Message]] = collections.defaultdict(list)
    pc = [0] * schedule.pp
    unsent: list[list[Message]] = [[] for _ in range(schedule.pp)]
    done_posting = [-1] * schedule.pp
    while any(pc[r] <= len(plans[r]) for r in range(schedule.pp)):
        progressed = False
        for r in range(schedule.pp):
            if pc[r] > len(plans[r]):
                continue
            for msg in unsent[r]:  # the batch before the next action (or the final flush)
                sent[(msg.src, msg.dst)].append(msg)
                progressed = True
            unsent[r] = []
            if pc[r] == len(plans[r]):
                pc[r] += 1
                progressed = True
                continue
            step = plans[r][pc[r]]
            if done_posting[r] < pc[r]:
                for msg in step.post:
                    posted[(msg.src, msg.dst)].append(msg)
                done_posting[r] = pc[r]
            if step.needs is not None:
                pair = (step.needs.src, step.needs.dst)
                slot = posted[pair].index(step.needs)
                if len(sent[pair]) <= slot:
                    continue  # blocked: the peer has not sent it yet
                assert sent[pair][slot] == step.needs, f"rank {r} would receive {sent[pair][slot]} as {step.needs}"
            if step.send is not None:
                unsent[r].append(step.send)
            pc[r] += 1
            progressed = True
        if not progressed:
            return sent, {r: plans[r][pc[r]].action for r in range(schedule.pp) if pc[r] < len(plans[r])}
    for pair in set(sent) | set(posted):
        assert sent[pair] == posted[pair], pair
    return sent, {}


@pytest.mark.parametrize("lookahead", [1, 2, 4])
def test_message_steps_match_and_never_block(lookahead: int) -> None:
    for schedule in SCHEDULES:
        _run_plan(schedule, lookahead)
        _run_plan(schedule, lookahead, forward_only=True)


@pytest.mark.parametrize("lookahead", [1, 2])
def test_the_executor_hangs_where_the_simulator_says(lookahead: int) -> None:
    # both walk core.schedules.messages' steps: rank lists reordered at random that the simulator
    # reports deadlocked stop the executor's walk at the same action of each blocked rank, and
    # those it passes the walk finishes. (An order problem, an action before its own rank's
    # input to it, fails the executor on a missing tensor instead: the walk does not model it.)
    rng = random.Random(lookahead)
    seen = collections.Counter()
    for schedule in SCHEDULES:
        if schedule.pp == 1:
            continue
        for _ in range(4):
            ranks = [list(actions) for actions in schedule.ranks]
            r = rng.randrange(schedule.pp)
            ranks[r].insert(rng.randrange(len(ranks[r])), ranks[r].pop(rng.randrange(len(ranks[r]))))
            moved = attrs.evolve(schedule, ranks=tuple(map(tuple, ranks)))
            problems = validate(moved)
            if any(p.kind == "order" for p in problems):
                continue
            _, stuck = _execute(moved, lookahead)
            assert stuck == {p.rank: p.action for p in problems}, (schedule.style, schedule.pp, problems)
            seen[bool(stuck)] += 1
    assert seen[True] > 20 and seen[False] > 20, seen


def test_message_steps_follow_the_placement() -> None:
    for schedule in SCHEDULES:
        sent = _run_plan(schedule, 1)
        acts = sum(1 for s in range(schedule.num_stages - 1) if schedule.stage_ranks[s] != schedule.stage_ranks[s + 1])
        per_kind = collections.Counter(m.kind for msgs in sent.values() for m in msgs)
        assert per_kind["act"] == per_kind["grad"] == acts * schedule.microbatches
        for msgs in sent.values():
            for m in msgs:
                assert m.src != m.dst
                producer = m.stage - 1 if m.kind == "act" else m.stage + 1
                assert schedule.stage_ranks[producer] == m.src and schedule.stage_ranks[m.stage] == m.dst


def test_v_placement_hands_over_locally_at_the_turn() -> None:
    schedule = generate("zbv", 2, 4, 2)  # rank 0: stages 0, 3; rank 1: stages 1, 2
    steps = {step.action: step for step in message_steps(schedule, 1)}
    f12 = next(step for a, step in steps.items() if a.op is Op.F and a.stage == 2)
    assert f12.send is not None and f12.send.dst == 0  # stage 2 -> 3 crosses to rank 0
    assert f12.needs is None  # stage 1 -> 2 stays on rank 1
    f11 = next(step for a, step in steps.items() if a.op is Op.F and a.stage == 1)
    assert f11.send is None and f11.needs is not None and f11.needs.src == 0


def test_message_steps_reject_an_inconsistent_schedule() -> None:
    good = generate("1f1b", 2, 2, 1)
    # rank 1 runs a microbatch that rank 0 never sends
    bad = Schedule(good.style, 2, 2, 1, False, good.stage_ranks,
                   (good.ranks[0][:1] + good.ranks[0][2:3], good.ranks[1]))
    with pytest.raises(ValueError, match="never sends|never receives"):
        message_steps(bad, 1)


# ---------------------------------------------------------------------------------------------
# Split backward (B = input gradient, W = weight gradient) equals a full backward bit for bit
# ---------------------------------------------------------------------------------------------


class _Stage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm = nn.LayerNorm(16)
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)
        self.shared = nn.Linear(16, 16)  # used twice
        self.unused = nn.Linear(16, 16)
        self.scale = nn.Parameter(torch.ones(16))  # used directly on the output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))
        h = h + self.shared(self.shared(h))
        return h * self.scale


def _params(m: nn.Module) -> list[nn.Parameter]:
    return list(m.parameters())


@pytest.mark.parametrize("last", [False, True])
def test_split_backward_equals_full_backward(last: bool) -> None:
    torch.set_num_threads(1)
    full, split = _Stage(), _Stage()
    inputs = [torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    grads = [torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(10 + i)) for i in range(3)]
    dx_full, dx_split, pending = [], [], []
    for x, g in zip(inputs, grads):
        xf = x.clone().requires_grad_(True)
        out = full(xf)
        if last:
            out.pow(2).mean().backward()
        else:
            out.backward(g)
        dx_full.append(xf.grad)
        xs = x.clone().requires_grad_(True)
        out = split(xs)
        dx, groups = backward_input(out.pow(2).mean() if last else out, None if last else g, xs, _params(split))
        dx_split.append(dx)
        pending.append(groups)
    for groups in pending:  # W later, after every B (as zero-bubble schedules do)
        backward_weight(groups)
    for a, b in zip(dx_full, dx_split):
        assert torch.equal(a, b)
    for (name, a), b in zip(full.named_parameters(), _params(split)):
        if name.startswith("unused"):
            assert a.grad is None and b.grad is None
        else:
            assert torch.equal(a.grad, b.grad), name


def test_split_backward_takes_the_parameters_the_graph_used() -> None:
    """Without a parameter list, B takes the parameters from the autograd graph (what FSDP2's
    resharding needs: after the forward the module holds other Parameter objects), and W lands
    every weight gradient on them, as a full backward does; `before` sees every group."""
    torch.set_num_threads(1)
    full, split = _Stage(), _Stage()
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(0))
    g = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1))
    xf = x.clone().requires_grad_(True)
    full(xf).backward(g)
    xs = x.clone().requires_grad_(True)
    out = split(xs)
    used = _params(split)
    for name, p in list(split.named_parameters()):  # swap every Parameter, as a reshard does
        owner, _, leaf = name.rpartition(".")
        setattr(split.get_submodule(owner), leaf, nn.Parameter(torch.zeros_like(p)))
    assert {id(p) for p in graph_parameters(out, (xs,))} == {id(p) for n, p in zip(
        dict(full.named_parameters()), used) if not n.startswith("unused")}
    dx, groups = backward_input(out, g, xs)
    assert groups is not None and torch.equal(dx, xf.grad)
    seen: list[torch.Tensor] = []
    backward_weight(groups, before=seen.extend)
    assert {id(p) for p in seen} == {id(p) for p in graph_parameters(out, (xs,))}
    for (name, a), b in zip(full.named_parameters(), used):
        if name.startswith("unused"):
            assert a.grad is None and b.grad is None
        else:
            assert torch.equal(a.grad, b.grad), name
    assert all(p.grad is None for p in split.parameters())  # the swapped-in ones got nothing


def test_split_backward_without_input_gradient_defers_everything() -> None:
    stage = _Stage()
    x = torch.randn(2, 5, 16)  # the first stage: its input needs no gradient
    dx, groups = backward_input(stage(x), torch.ones(2, 5, 16), x, _params(stage))
    assert dx is None and groups is None  # the executor then runs the whole backward in W


# ---------------------------------------------------------------------------------------------
# On two ranks
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checks() -> list[dict[str, Any]]:
    return run_distributed(executor_checks_worker, 2, timeout=240)


@pytest.mark.distributed
def test_groups_coordinates_and_tie_group(checks: list[dict[str, Any]]) -> None:
    assert [c["coords"] for c in checks] == [{"dp": 0, "cp": 0, "pp": 0, "tp": 0}, {"dp": 0, "cp": 0, "pp": 1, "tp": 0}]
    assert checks[0]["peers"] == checks[1]["peers"] == [0, 1]
    assert checks[0]["tie_size"] == checks[1]["tie_size"] == 2  # wte on rank 0, lm_head on rank 1


@pytest.mark.distributed
def test_eval_step_equals_reference_forward(checks: list[dict[str, Any]]) -> None:
    assert checks[0]["eval"] == checks[1]["eval"] == checks[0]["eval_reference"]
    assert checks[0]["eval"] != checks[0]["reference_first_loss"] * 0  # a real number


@pytest.mark.distributed
def test_wrong_microbatch_count_is_a_value_error(checks: list[dict[str, Any]]) -> None:
    assert "runs 4 microbatches, got 3" in checks[0]["wrong_count"]


@pytest.mark.distributed
@pytest.mark.parametrize("style", ["interleaved", "zbv"])
def test_early_receives_change_nothing(checks: list[dict[str, Any]], style: str) -> None:
    assert checks[0][f"lookahead-{style}"] is True  # bitwise equal losses and gradients


@pytest.mark.distributed
@pytest.mark.parametrize("style", ["interleaved", "zbv"])
@pytest.mark.parametrize("lookahead", [1, 3])
def test_receive_buffers_are_allocated_once(checks: list[dict[str, Any]], style: str, lookahead: int) -> None:
    for rank in checks:
        reserved, after_steps = rank[f"buffers-{style}-{lookahead}"]
        assert reserved > 0 and after_steps == reserved


@pytest.mark.distributed
def test_verify_catches_missing_tied_gradient_sum(checks: list[dict[str, Any]]) -> None:
    report = checks[0]["untied"]
    assert not report.ok
    assert report.first_loss_bitwise  # the forward is still right
    worst = max(report.grad_diffs, key=report.grad_diffs.get)
    assert worst in ("transformer.wte.weight", "lm_head.weight")
    assert report.grad_diffs[worst] > 1e-2


# ---------------------------------------------------------------------------------------------
# Launching and metrics (no process group needed)
# ---------------------------------------------------------------------------------------------


def test_torchrun_arguments() -> None:
    from ppdsl.runtime.run.launch import torchrun_args

    args = torchrun_args("s.ppspec", ["run", "s.ppspec", "--nproc", "4", "--out", "o"], 4)
    assert args == ["--standalone", "--nproc-per-node=4", "--module", "ppdsl", "run", "s.ppspec", "--out", "o"]
    assert torchrun_args("s.ppspec", ["--nproc=2"], 2)[-2:] == ["run", "s.ppspec"]
    with pytest.raises(ValueError):
        torchrun_args("s.ppspec", [], 0)


def test_run_worker_refuses_a_world_that_does_not_fit(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from ppdsl.runtime.run.worker import run_worker

    monkeypatch.setenv("WORLD_SIZE", "3")
    assert run_worker(tiny_plan("generic", "1f1b", pp=2, tp=2), None) == 2
    err = capsys.readouterr().err
    assert "needs 4 processes" in err and "WORLD_SIZE = 3" in err


def test_metrics_lines(tmp_path: Any) -> None:
    import io
    import json

    from ppdsl.runtime.train.metrics import MetricsLogger, StepRecord

    out = io.StringIO()
    record = StepRecord(step=3, loss=4.5, lr=1e-3, grad_norm=0.5, step_time_s=0.25, tokens_per_s=1024.0,
                        peak_memory_mib=300.0)
    with MetricsLogger(tmp_path / "m.jsonl", 10, stream=out) as logger:
        logger.log(record)
    with MetricsLogger(tmp_path / "other.jsonl", 10, enabled=False, stream=out) as quiet:
        quiet.log(record)
    assert out.getvalue().startswith("step  3/10 | loss 4.5000 | lr 1.00e-03 | gnorm 0.500 | 1,024 tok/s")
    assert json.loads((tmp_path / "m.jsonl").read_text())["tokens_per_s"] == 1024.0
    assert not (tmp_path / "other.jsonl").exists()


def test_each_rank_gets_the_data_it_uses() -> None:
    from ppdsl.runtime.data.source import make_data
    from ppdsl.runtime.stage.build import MicroBatch

    plan = tiny_plan("gpt2", "1f1b", pp=2, microbatches=4, microbatch_size=2)
    full, first, last = make_data(plan), make_data(plan, pp_rank=0), make_data(plan, pp_rank=1)
    a, b = full.microbatches(0, 0), full.microbatches(0, 0)
    assert len(a) == 4 and isinstance(a[0], MicroBatch) and a[0].input_ids.shape == (2, 16)
    assert all(torch.equal(x.input_ids, y.input_ids) for x, y in zip(a, b))  # (seed, step, replica) -> batch
    assert not torch.equal(full.batch(1, 0).input_ids, full.batch(0, 0).input_ids)
    assert not torch.equal(full.batch(0, 1).input_ids, full.batch(0, 0).input_ids)
    assert torch.equal(first.batch(0, 0).input_ids, full.batch(0, 0).input_ids)
    assert torch.equal(last.batch(0, 0).labels, full.batch(0, 0).labels)
    # a V schedule puts the first and the last stage on pipeline rank 0: it reads both
    v = make_data(tiny_plan("gpt2", "zbv", pp=2, microbatches=4), pp_rank=0).batch(0, 0)
    ref = make_data(tiny_plan("gpt2", "zbv", pp=2, microbatches=4)).batch(0, 0)
    assert torch.equal(v.input_ids, ref.input_ids) and torch.equal(v.labels, ref.labels)


def test_verify_ignores_only_zero_true_gradients() -> None:
    """A parameter whose reference gradient is rounding noise (BERT's key bias: softmax ignores
    it) is not held to the gradient tolerance; a real gradient that differs still fails."""
    from ppdsl.runtime.verify.reference import ReferenceRun
    from ppdsl.runtime.verify.report import Tolerances
    from ppdsl.runtime.verify.compare import compare

    plan = tiny_plan("generic", "1f1b", pp=2, tp=1)
    big = torch.ones(64)
    noise_ref, noise_par = torch.full((4,), 5e-7), torch.full((4,), -5e-7)  # below 1e-6 x the norm
    ref = ReferenceRun(losses=[1.0], grad_norms=[8.0], grads=[{"w": big, "k.bias": noise_ref}],
                       params={"w": big, "k.bias": torch.zeros(4)}, aliases={})
    ok = compare(plan, 1, [1.0], [8.0], [{"w": big.clone(), "k.bias": noise_par}],
                 {"w": big.clone(), "k.bias": torch.zeros(4)}, ref, Tolerances())
    assert ok.noise == ("k.bias",) and ok.ok, ok.render()
    assert ok.grad_diffs["k.bias"] > 1e-5  # shown, but not checked
    bad = compare(plan, 1, [1.0], [8.0], [{"w": big * 1.01, "k.bias": noise_par}],
                  {"w": big.clone(), "k.bias": torch.zeros(4)}, ref, Tolerances())
    assert not bad.ok and "EXCEEDED" in bad.render()


def test_bf16_with_tensor_parallelism_is_verified_to_bf16_precision() -> None:
    from ppdsl.runtime.verify.report import Tolerances

    assert Tolerances.for_plan(tiny_plan("generic", "1f1b", pp=2, tp=1, precision="bf16")).grad_rel == 1e-5
    loose = Tolerances.for_plan(tiny_plan("generic", "1f1b", pp=2, tp=2, precision="bf16"))
    assert (loose.loss_abs, loose.grad_rel, loose.drift_rel) == (1e-3, 3e-2, 3e-2)
    assert Tolerances.for_plan(tiny_plan("generic", "1f1b", pp=2, tp=2)).grad_rel == 1e-5  # fp32 stays tight
