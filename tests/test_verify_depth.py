"""`ppdsl verify` on deep models: fp32 drift after the first step is told from a wrong split by fp64.

After an Adam step rounding grows with depth and steps (the update is about the sign of each
gradient element, so an element whose gradient is at rounding level steps either way): an OPT with
100 layers at pp 2 x tp 2 has later-step gradients 1.5e-4 apart in fp32 against verify's 1e-4,
while step 1 agrees (loss bitwise equal) and fp64 agrees to ~1e-12. `verify` reruns such a
comparison (step 1 within tolerance, a later step not) in float64 and calls it OK when fp64 agrees.
Step 1 stays strict: a wrong split (built past check: one layer's fc1 split as if it held two
fused parts, so its features meet the wrong rows of the row-split fc2) FAILS at 4 and at 100
layers, without an fp64 rerun.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")

OPT = """ppspec 1
model opt {{
  source = hf("OPTForCausalLM")
  config {{
    vocab_size = 64, hidden_size = 16, ffn_dim = 32, num_hidden_layers = {layers}, num_attention_heads = 2,
    max_position_embeddings = 64, word_embed_proj_dim = 16, dropout = 0.0, attention_dropout = 0.0,
    pad_token_id = 1
  }}
}}
mesh {{ tp = 2, pp = 2 }}
tensor_parallel {{
  model.decoder.layers[*].self_attn.q_proj : column
  model.decoder.layers[*].self_attn.k_proj : column
  model.decoder.layers[*].self_attn.v_proj : column
  model.decoder.layers[*].self_attn.out_proj : row
  model.decoder.layers[*].fc1 : column
  model.decoder.layers[*].fc2 : row
  model.decoder.embed_tokens : vocab
  lm_head : column
}}
pipeline {{ style = 1f1b, microbatches = 4 }}
train {{ global_batch = 4, seq_len = 8, steps = 2, optimizer = adamw(lr = 1e-3), data = synthetic(seed = 0) }}
"""


def _plan(layers: int) -> Any:
    from ppdsl.dsl.check import check_text
    from ppdsl.lowering.lower import lower

    result = check_text(OPT.format(layers=layers), f"<opt{layers}>", world=4, model=True)
    assert result.ok, [d.message for d in result.diagnostics]
    return lower(result.spec, 4, result.model_info)


def _wrong_split(plan: Any) -> Any:
    """The middle layer's fc1 column-split as two fused parts: each rank computes a quarter of
    each half of its features, which the row-split fc2 multiplies with its contiguous half of
    rows. Every shape fits (nothing raises); the numbers are another model's. Check refuses it."""
    import attrs

    target = f"model.decoder.layers.{plan.num_blocks // 2}.fc1"
    tp = tuple(attrs.evolve(t, fused=2) if t.path == target else t for t in plan.tp)
    assert tp != plan.tp
    return attrs.evolve(plan, tp=tp)


# --------------------------------------------------------------------------------------------
# The verdict (no processes)
# --------------------------------------------------------------------------------------------


def _report(**kw: Any) -> Any:
    from ppdsl.runtime.verify.report import Tolerances, VerifyReport

    base: dict[str, Any] = dict(plan="opt", steps=2, tol=Tolerances(drift_rel=1e-4), losses=((4.15, 4.15), (4.17, 4.17)),
                                grad_norms=((1.0, 1.0), (1.0, 1.0)),
                                grad_diffs_by_step=({"w": 5e-6}, {"w": 1.5e-4}), param_diffs={"w": 3e-5})
    return VerifyReport(**{**base, **kw})


def _fp64(later: float) -> Any:
    from ppdsl.runtime.verify.report import Tolerances

    return _report(precision="fp64", tol=Tolerances(loss_abs=1e-7, grad_rel=1e-6, drift_rel=1e-6),
                   grad_diffs_by_step=({"w": 5e-15}, {"w": later}), param_diffs={"w": 1e-12})


def test_drift_after_step_one_is_ok_when_fp64_agrees() -> None:
    drift = _report()
    assert not drift.within_tolerance and drift.first_step_ok and drift.drift_only
    assert not drift.ok  # no fp64 rerun yet: FAILED, with the hint
    text = drift.render()
    assert text.endswith("FAILED") and "train.precision=fp64" in text and "step 1 agrees" in text

    agreed = _report(fp64=_fp64(5e-14))
    assert agreed.ok
    text = agreed.render()
    assert "fp64 rerun:" in text and "grad rel, later 1.500e-04 > 1e-04" in text
    assert text.splitlines()[-1] == "OK (fp32 later-step drift 1.500e-04 is rounding: fp64 agrees to 1.000e-12)"

    disagreed = _report(fp64=_fp64(2e-1))
    assert not disagreed.ok
    assert disagreed.render().splitlines()[-1].startswith("FAILED (fp64 disagrees too")

    crashed = _report(fp64_error="rank 0: out of memory")
    assert not crashed.ok and "fp64 rerun could not run: rank 0: out of memory" in crashed.render()


def test_the_first_step_stays_strict() -> None:
    """A first step beyond its tolerance (loss, gradients, gradient norm) or a missing parameter
    is no drift: FAILED whatever fp64 says, and verify does not rerun it."""
    for kw in (dict(grad_diffs_by_step=({"w": 2e-5}, {"w": 1.5e-4})),
               dict(losses=((4.15, 4.1502), (4.17, 4.17))),
               dict(grad_norms=((1.001, 1.0), (1.0, 1.0))),
               dict(problems=("1 reference parameter(s) not found in the parallel model: v",))):
        report = _report(**kw, fp64=_fp64(5e-14))
        assert not report.first_step_ok and not report.drift_only and not report.ok, kw
        assert report.render().splitlines()[-1] == "FAILED", kw
    # later losses, parameters and the eval are after-step quantities: drift, for fp64 to decide
    assert _report(losses=((4.15, 4.15), (4.17, 4.1702))).drift_only
    assert _report(grad_diffs_by_step=({"w": 5e-6}, {"w": 5e-5}), param_diffs={"w": 2e-4}).drift_only
    # not with dropout kept (the runs differ by design), nor in bf16 (its own, coarse tolerances)
    assert not _report(notes=("dropout kept (p): ...",), fp64=_fp64(5e-14)).ok
    assert not _report(precision="bf16", fp64=_fp64(5e-14)).ok


def test_verify_reruns_only_drift_in_fp64(monkeypatch: pytest.MonkeyPatch) -> None:
    """verify() runs the fp64 comparison for drift after step 1 only: by default on the plan with
    train.precision = fp64, from `ppdsl verify` on the spec as `--set train.precision=fp64`
    lowers it."""
    from ppdsl.runtime.verify import world as v

    plan = _plan(4)
    calls: list[Any] = []
    answers: list[Any] = []

    def fake(p: Any, steps: int, timeout_s: float, tol: Any) -> Any:
        calls.append(p)
        return answers.pop(0)

    monkeypatch.setattr(v, "_verify_world", fake)
    wide = v.as_fp64(plan)
    heard: list[str] = []
    answers[:] = [_report(), _fp64(5e-14)]
    report = v.verify(plan, 2, notes=("dropout off for the comparison: x",), progress=heard.append)
    assert report.ok and report.fp64 is not None and len(heard) == 1
    assert [p.train.precision for p in calls] == ["fp32", "fp64"]
    assert calls[1].tp == plan.tp and calls[1].mesh == plan.mesh and calls[1].model == plan.model
    assert report.notes == report.fp64.notes == ("dropout off for the comparison: x",)

    calls.clear()
    answers[:] = [_report(), _fp64(5e-14)]
    assert v.verify(plan, 2, fp64_plan=lambda: wide).ok and calls[1] is wide
    calls.clear()
    answers[:] = [_report()]
    report = v.verify(plan, 2, fp64_plan=lambda: None)
    assert not report.ok and len(calls) == 1 and "does not check" in report.fp64_error

    calls.clear()
    answers[:] = [_report(grad_diffs_by_step=({"w": 1.0}, {"w": 1.0}))]
    assert not v.verify(plan, 2).ok and len(calls) == 1  # step 1 off: no rerun
    calls.clear()
    answers[:] = [_report()]
    assert not v.verify(plan, 2, fp64_rerun=False).ok and len(calls) == 1

    def crash(p: Any, *args: Any) -> Any:
        if p.train.precision == "fp64":
            raise RuntimeError("verify of opt failed (pid 1):\n--- rank 0 ---\nTraceback\nMemoryError: no")
        return _report()

    monkeypatch.setattr(v, "_verify_world", crash)
    report = v.verify(plan, 2)
    assert not report.ok and report.fp64_error == "verify of opt failed (pid 1): ... MemoryError: no"


def test_the_cli_reruns_the_spec_as_fp64_lowers_it(tmp_path) -> None:
    """`ppdsl verify`'s fp64 plan: the spec checked with train.precision=fp64 (an HF model built
    with the eager experts kernel: grouped_mm takes no float64), dropout off as in fp32."""
    import argparse

    from ppdsl.cli import _fp64_plan

    spec = tmp_path / "opt.ppspec"
    spec.write_text(OPT.format(layers=4).replace("dropout = 0.0,", "dropout = 0.1,"), encoding="utf-8")
    args = argparse.Namespace(spec=str(spec), world=4, overrides=["train.steps=3"], keep_dropout=False)
    plan = _fp64_plan(args)
    assert plan.train.precision == "fp64" and plan.train.steps == 3
    assert plan.model.config_dict["experts_implementation"] == "eager" and plan.model.config_dict["dropout"] == 0.0
    assert plan.tp == _plan(4).tp
    assert _fp64_plan(argparse.Namespace(spec=str(spec), world=3, overrides=[], keep_dropout=False)) is None


# --------------------------------------------------------------------------------------------
# The runs (spawned worlds of 4, as `ppdsl verify` starts them)
# --------------------------------------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.parametrize("layers", [4, pytest.param(100, marks=pytest.mark.slow)])  # 100: about 55 s
def test_a_wrong_split_fails_at_any_depth(layers: int) -> None:
    from ppdsl.runtime.verify.world import verify

    report = verify(_wrong_split(_plan(layers)), 2, timeout_s=300)
    assert not report.ok, report.render()
    assert not report.first_step_ok and report.fp64 is None  # step 1 shows it: no rerun needed
    assert report.first_step_grad_diff > 0.1 and report.max_loss_diff > 1e-5, report.render()
    assert report.render().splitlines()[-1] == "FAILED"


@pytest.mark.distributed
@pytest.mark.slow
def test_opt_with_100_layers_is_not_failed_in_fp32() -> None:
    """~80 s on 2 cores (the fp32 comparison, then the fp64 one)."""
    from ppdsl.runtime.verify.world import verify

    report = verify(_plan(100), 2, timeout_s=500)
    assert report.ok, report.render()
    assert report.first_step_ok and report.first_step_grad_diff <= 1e-5
    if not report.within_tolerance:  # the drift this file is about: fp64 decided it
        assert report.fp64 is not None and report.fp64.max_grad_diff < 1e-9, report.render()
        assert report.render().splitlines()[-1].startswith("OK (fp32 later-step drift")
