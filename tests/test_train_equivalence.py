"""Pipeline (+ tensor, + data) parallel training equals one process, on CPU with gloo.

Every schedule style x pp in {2, 4} x tp in {1, 2} (world <= 4) on tiny models of every family
(the generic decoder, GPT-2 with tied embeddings, Llama, BERT with a padding mask), plus data
parallelism, ZeRO-1, bf16 autocast, active clipping, SGD / Adam and LR schedules. The
reference is the full model in one process accumulating gradients over the same microbatches
with the same optimizer (``runtime.verify.compare``). Asserted, per case:

- tp = 1, dp = 1: the first step's loss is bitwise equal;
- every step's loss within 1e-6;
- every gradient of the first step within 1e-5 (relative, 2-norm, TP shards gathered);
- after the optimizer steps: updates and later gradients within the plan's drift tolerance.

Each world size runs as one spawned suite (a spawn mostly costs importing torch and
transformers); each case is its own test reading the suite's result. The default suite keeps
every style on the generic decoder and GPT-2 at pp 2 x tp 2 and on the generic decoder at pp 4;
Llama's and BERT's other styles there run under `-m slow` (a suite of their own).
"""

from __future__ import annotations

from typing import Any

import pytest

from _exec_harness import case_id, equivalence_worker
from _tiny_models import tiny_plan
from dist_harness import run_distributed

pytestmark = pytest.mark.distributed

ALL_STYLES = ("gpipe", "1f1b", "interleaved", "looped_bfs", "zbh1", "zbv", "interleaved_zb", "dualpipev")


def _cases(dp: int, pp: int, tp: int, families: tuple[str, ...] = ("generic", "gpt2", "llama", "bert")) -> list[dict[str, Any]]:
    mesh = dict(dp=dp, pp=pp, tp=tp, microbatches=2 * pp, num_layers=2 * pp, steps=1)
    return [dict(family=f, style=s, **mesh) for f in families for s in ALL_STYLES]


def _with(case: dict[str, Any], **changes: Any) -> dict[str, Any]:
    return {**case, **changes}


def _pp2_tp2() -> list[dict[str, Any]]:
    """pp 2 x tp 2: every style on the generic decoder and GPT-2 (tied embeddings across ranks);
    Llama and BERT on a plain, a V and a split-backward looped style (the rest: slow)."""
    kept = {"generic": ALL_STYLES, "gpt2": ALL_STYLES, "llama": ("1f1b", "zbv", "dualpipev"),
            "bert": ("1f1b", "interleaved_zb")}
    return [dict(c, slow=c["style"] not in kept[c["family"]]) for c in _cases(1, 2, 2)]


def _pp4() -> list[dict[str, Any]]:
    """pp 4: every style on a python factory; a rotary decoder on zbv (the rest: slow). GPT-2 and
    BERT run every style at pp 2 and pp 2 x tp 2 above; a deeper pipeline changes the schedule,
    not the family."""
    return [dict(c, slow=c["family"] == "llama" and c["style"] != "zbv") for c in _cases(1, 4, 1, ("generic", "llama"))]


CASES: dict[int, list[dict[str, Any]]] = {
    2: _cases(1, 2, 1)
    + [
        # two steps: optimizer, LR schedule and clipping in the loop; SGD keeps drift at 1e-5
        dict(family="gpt2", style="1f1b", dp=1, pp=2, tp=1, microbatches=4, num_layers=4, steps=2),
        dict(family="generic", style="zbv", dp=1, pp=2, tp=1, microbatches=4, num_layers=4, steps=2,
             optimizer="sgd", lr_schedule="cosine"),
        dict(family="llama", style="interleaved", dp=1, pp=2, tp=1, microbatches=4, num_layers=4, steps=2,
             optimizer="adam", lr_schedule="linear"),
        # bf16 autocast on CPU (activations cross stages in fp32)
        dict(family="gpt2", style="zbh1", dp=1, pp=2, tp=1, microbatches=4, num_layers=4, steps=2, precision="bf16"),
    ],
    4: _pp2_tp2() + _pp4()
    + [
        # data parallel: gradients averaged over two replicas, fed different data
        dict(family="gpt2", style="1f1b", dp=2, pp=2, tp=1, microbatches=4, num_layers=4, steps=2),
        dict(family="generic", style="zbv", dp=2, pp=2, tp=1, microbatches=4, num_layers=4, steps=2,
             optimizer="sgd"),
        # ZeRO-1: optimizer state sharded over the data-parallel replicas
        dict(family="llama", style="1f1b", dp=2, pp=2, tp=1, microbatches=4, num_layers=4, steps=2, zero=1),
        # clipping always active: the global norm must count TP-replicated and tied tensors once
        dict(family="gpt2", style="interleaved", dp=1, pp=2, tp=2, microbatches=4, num_layers=4, steps=2,
             grad_clip=0.05),
    ],
}
# one spawned world per (world size, tier): the default suite's cases, and the `slow` marker's
SUITES: dict[tuple[int, bool], list[dict[str, Any]]] = {
    (world, slow): [{k: v for k, v in c.items() if k != "slow"} for c in cases if c.get("slow", False) == slow]
    for world, cases in CASES.items() for slow in (False, True)
}

TIMEOUT_S = {2: 240, 4: 420}
_results: dict[tuple[int, bool], list[Any]] = {}


def _suite(key: tuple[int, bool]) -> list[Any]:
    if key not in _results:
        plans = [tiny_plan(**case) for case in SUITES[key]]
        _results[key] = run_distributed(equivalence_worker, key[0], plans, timeout=TIMEOUT_S[key[0]])[0]
    return _results[key]


PARAMS = [pytest.param(key, i, id=f"w{key[0]}-{case_id(c)}", marks=[pytest.mark.slow] if key[1] else [])
          for key, cases in SUITES.items() for i, c in enumerate(cases)]


@pytest.mark.parametrize("key,index", PARAMS)
def test_equivalent_to_single_process(key: tuple[int, bool], index: int) -> None:
    case = SUITES[key][index]
    report, _seconds = _suite(key)[index]
    text = report.render()
    assert not report.problems, text
    if case["tp"] == 1 and case["dp"] == 1:
        assert report.first_loss_bitwise, text
    assert report.max_loss_diff <= 1e-6, text
    assert report.first_step_grad_diff <= 1e-5, text
    assert report.ok, text
