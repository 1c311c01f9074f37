"""The step's phases in the memory model (lowering/rank_memory.py, lowering/memory.py), pure
Python: the pipeline's peak walks the rank's actions, the gradient sync and the optimizer step
come after it, and the rank's peak is the largest of them (issue 34)."""

from __future__ import annotations

from ppdsl.core.schedules.ir import Action, Op
from ppdsl.core.schedules import generate
from ppdsl.core.schedules.simulate import peak_activations
from ppdsl.lowering.memory import StateBytes, optimizer_temporaries, state_phases
from ppdsl.lowering.rank_memory import StageTerms, pipeline_peak

F, B, W = Op.F, Op.B, Op.W

def _total(terms: tuple[tuple[str, int], ...]) -> int:
    return sum(b for _, b in terms)


def _actions(*codes: tuple[Op, int, int]) -> list[Action]:
    return [Action(op, mb, stage) for op, mb, stage in codes]

def test_gpipe_peak_holds_no_gradients() -> None:
    # every microbatch in flight before the first backward: the gradients come after the peak
    terms = {0: StageTerms(saved=100.0, recompute=0.0, temporary=10.0, kept=0.0, params=1.0)}
    gpipe = _actions((F, 0, 0), (F, 1, 0), (F, 2, 0), (B, 0, 0), (B, 1, 0), (B, 2, 0))
    top = pipeline_peak(gpipe, terms, grads=1000.0, accumulate=0.0, split_backward=False)
    # the second backward: 2 microbatches, its temporary and the gradients = 1210 > 3 x 100 + 10
    assert (top.activations, top.grads, top.at) == (210, 1000, "B1s0")
    small = pipeline_peak(gpipe, terms, grads=50.0, accumulate=0.0, split_backward=False)
    assert (small.activations, small.grads, small.at) == (310, 0, "F2s0")  # the last forward, before any gradient

def test_one_f_one_b_steady_state_holds_the_gradients() -> None:
    terms = {0: StageTerms(100.0, 0.0, 0.0, 0.0, 1.0)}
    steady = _actions((F, 0, 0), (F, 1, 0), (B, 0, 0), (F, 2, 0), (B, 1, 0), (B, 2, 0))
    top = pipeline_peak(steady, terms, grads=50.0, accumulate=0.0, split_backward=False)
    assert (top.activations, top.grads, top.at) == (200, 50, "F2s0")

def test_split_backward_keeps_what_b_keeps_for_w() -> None:
    terms = {1: StageTerms(saved=100.0, recompute=0.0, temporary=0.0, kept=30.0, params=1.0)}
    zb = _actions((F, 0, 1), (F, 1, 1), (B, 0, 1), (B, 1, 1), (W, 0, 1), (W, 1, 1))
    top = pipeline_peak(zb, terms, grads=0.0, accumulate=0.0, split_backward=True)
    assert top.activations == 2 * 100 + 2 * 30  # both microbatches' saved tensors and B's kept gradients
    unsplit = pipeline_peak(zb[:4], terms, grads=0.0, accumulate=0.0, split_backward=False)
    assert unsplit.activations == 200

def test_gradients_arrive_per_stage_and_accumulation_ends_a_backward() -> None:
    # two stages on the rank (a V): the first backward gives only its stage's share of the gradients
    terms = {0: StageTerms(10.0, 0.0, 0.0, 0.0, params=3.0), 1: StageTerms(10.0, 0.0, 0.0, 0.0, params=1.0)}
    acts = _actions((F, 0, 0), (F, 0, 1), (B, 0, 1), (F, 1, 0))
    top = pipeline_peak(acts, terms, grads=400.0, accumulate=0.0, split_backward=False)
    assert (top.activations, top.grads, top.at) == (20, 100, "F1s0")  # next to stage 1's gradients only
    # a second backward into existing gradients: a temporary of the largest parameter as it ends
    again = _actions((F, 0, 0), (B, 0, 0), (F, 1, 0), (B, 1, 0))
    one = {0: StageTerms(10.0, 0.0, 0.0, 0.0, 1.0)}
    assert pipeline_peak(again, one, grads=5.0, accumulate=100.0, split_backward=False).total == 105
    assert pipeline_peak(again[:2], one, grads=5.0, accumulate=100.0, split_backward=False).total == 10

def test_activation_checkpointing_recomputes_one_block_in_backward() -> None:
    terms = {0: StageTerms(saved=4.0, recompute=50.0, temporary=0.0, kept=0.0, params=1.0)}
    top = pipeline_peak(_actions((F, 0, 0), (F, 1, 0), (B, 0, 0), (B, 1, 0)), terms, 0.0, 0.0, False)
    assert (top.activations, top.at) == (58, "B0s0")

def test_peak_of_a_real_schedule_is_the_simulators_in_flight_peak_without_gradients() -> None:
    for style, chunks in (("1f1b", 1), ("gpipe", 1), ("interleaved", 2), ("zbv", 2)):
        schedule = generate(style, 4, 8, chunks)
        for rank, actions in enumerate(schedule.ranks):
            terms = {s: StageTerms(1.0, 0.0, 0.0, 0.0, 1.0) for s in schedule.stages_of(rank)}
            top = pipeline_peak(actions, terms, 0.0, 0.0, schedule.split_backward)

            assert top.activations == peak_activations(schedule)[rank], (style, rank)

def test_optimizer_temporaries_as_measured_on_cpu() -> None:
    # torch 2.13's single-tensor step (runtime/memory_trace's counter, one 1M-value parameter)
    assert optimizer_temporaries("adamw", 0.1) == optimizer_temporaries("adamw", 0.0) == 2
    assert (optimizer_temporaries("adam", 0.1), optimizer_temporaries("adam", 0.0)) == (3, 2)
    assert (optimizer_temporaries("sgd", 0.1), optimizer_temporaries("sgd", 0.0)) == (1, 0)

def test_state_phases_under_each_zero_stage() -> None:
    w = 1000  # bytes of weights, fp32: 250 values; the largest parameter 100 values
    plain = StateBytes(w, w, 2 * w, 4 * w)
    one = state_phases(plain, 1, 0, 100.0, 2)
    assert _total(one.optimizer) == 4 * w + 2 * 100 * 4  # AdamW's two temporaries of the largest parameter
    assert _total(one.grad_sync) == 4 * w + 2 * 100  # the inf / nan check's two bool tensors
    replicas = state_phases(plain, 2, 0, 100.0, 2)
    assert _total(replicas.grad_sync) == 5 * w + 200  # the all-reduce's flat buckets: a second copy of the gradients
    zero1 = state_phases(StateBytes(w, w, w, 2500), 2, 1, 100.0, 2)
    # the whole gradients, the owned ones' new buffers (1/2) and the reduce-scatter windows (3 x 500)
    assert _total(zero1.grad_sync) == 3 * w + w // 2 + 3 * (w // 2)
    assert _total(zero1.optimizer) == w + w // 2 + w + max(800, 3 * (w // 2))
    zero3 = state_phases(StateBytes(w + w // 2, w, w, 2000), 2, 3, 100.0, 2)
    assert _total(zero3.optimizer) == 2000 + 2 * 100 * 4 // 2  # at rest, the temporaries of a shard


def test_split_backward_with_checkpointing_recomputes_in_b_and_again_in_w() -> None:
    # B recomputes one block at a time and keeps what W needs; W recomputes the stage's blocks
    # (`rerun`); the first stage (kept 0) has a W that is its whole backward: one block recomputed
    terms = {1: StageTerms(saved=4.0, recompute=30.0, temporary=0.0, kept=90.0, params=1.0, rerun=60.0)}
    acts = _actions((F, 0, 1), (B, 0, 1), (W, 0, 1))
    top = pipeline_peak(acts, terms, 0.0, 0.0, True)
    assert (top.activations, top.at) == (4 + 90 + 60, "W0s1")
    first = {0: StageTerms(saved=4.0, recompute=30.0, temporary=0.0, kept=0.0, params=1.0, rerun=0.0)}
    top = pipeline_peak(_actions((F, 0, 0), (B, 0, 0), (W, 0, 0)), first, 0.0, 0.0, True)
    assert (top.activations, top.at) == (34, "B0s0")
