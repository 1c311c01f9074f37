"""`train.precision = fp64`: everything in float64, the tight check of `ppdsl verify`.

In fp32 a model whose gradients are differences of nearly equal terms amplifies rounding past
verify's 1e-5 (DiffLlama's lambdas at tp 2: 7.5e-4); in fp64 the same layout agrees to ~1e-16,
so what remains is the split's. These tests hold the fp64 path to that: parameters, activations
on the wire, the vocab-parallel loss, ZeRO / FSDP2 shards and the reference are all float64,
and the parallel run matches one process to far below fp32's rounding.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

from ppdsl.dsl.check import check_text

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")

DECODER = """ppspec 1
model tiny {{
  source = python("ppdsl.models.decoder:build_decoder")
  config {{ vocab_size = 128, dim = 64, n_layers = 4, n_heads = 4, max_seq_len = 32 }}
}}
mesh {{ tp = {tp}, pp = {pp}{dp} }}
tensor_parallel {{
  tok_embeddings            : vocab
  layers[*].attention.wq    : column
  layers[*].attention.wk    : column
  layers[*].attention.wv    : column
  layers[*].attention.wo    : row
  layers[*].feed_forward.w1 : column
  layers[*].feed_forward.w2 : row
  output                    : column
}}
pipeline {{
  style = {style}
  chunks = {chunks}
  microbatches = 4
  blocks = layers
  first = [tok_embeddings, pos_embeddings]
  last = [norm, output]
}}
train {{
  global_batch = {batch}
  seq_len = 16
  steps = 2
  precision = fp64
  optimizer = adamw(lr = 3e-3)
  zero = {zero}
  data = synthetic(seed = 0)
}}
"""

# DiffLlama through its own forward and its declared plan: in fp32 its lambda gradients (differences
# of nearly equal exponentials) are 7.5e-4 apart at tp 2, beyond verify's 1e-5; in fp64, 5e-16
DIFF_LLAMA = """ppspec 1
model m {
  source = hf("DiffLlamaForCausalLM")
  config { num_hidden_layers = 4, hidden_size = 32, intermediate_size = 64, num_attention_heads = 4,
           num_key_value_heads = 2, head_dim = 8, vocab_size = 128, max_position_embeddings = 64,
           pad_token_id = 0, attention_dropout = 0.0 }
}
mesh { pp = 2, tp = 2 }
tensor_parallel { hf_plan = true }
pipeline { style = 1f1b, microbatches = 2 }
train { global_batch = 4, seq_len = 16, steps = 2, precision = fp64, optimizer = sgd(lr = 0.1), data = synthetic(seed = 0) }
"""

# Qwen3 (the family) with one key / value head at tp 2: k_proj is kept whole on both ranks, so its
# k_norm over that head takes a whole input (check refused it with E0219 before); verified in fp32
QWEN3_ONE_KV_HEAD = """ppspec 1
model qwen3 {
  source = hf("Qwen3ForCausalLM")
  config { num_hidden_layers = 4, hidden_size = 32, intermediate_size = 64, num_attention_heads = 4,
           num_key_value_heads = 1, head_dim = 8, vocab_size = 128, max_position_embeddings = 64,
           tie_word_embeddings = false }
}
mesh { tp = 2, pp = 2 }
tensor_parallel {
  model.embed_tokens : vocab
  model.layers[*].self_attn.q_proj : column
  model.layers[*].self_attn.k_proj : column
  model.layers[*].self_attn.v_proj : column
  model.layers[*].self_attn.o_proj : row
  model.layers[*].mlp.gate_proj : column
  model.layers[*].mlp.up_proj : column
  model.layers[*].mlp.down_proj : row
  lm_head : column
}
pipeline { style = 1f1b, microbatches = 4 }
train { global_batch = 4, seq_len = 16, steps = 2, optimizer = sgd(lr = 0.1), data = synthetic(seed = 0) }
"""

# pp 2 x tp 2 (vocab-parallel embedding and loss), dp 2 with ZeRO-1 and FSDP2, a split backward
LAYOUTS = {
    "tp2_pp2_1f1b": dict(tp=2, pp=2, dp="", style="1f1b", chunks=1, batch=8, zero=0),
    "tp2_pp2_zbv": dict(tp=2, pp=2, dp="", style="zbv", chunks=2, batch=8, zero=0),
    "dp2_tp2_zero1": dict(tp=2, pp=1, dp="", style="1f1b", chunks=1, batch=8, zero=1),
    "dp2_pp2_zero3": dict(tp=1, pp=2, dp="", style="1f1b", chunks=1, batch=8, zero=3),
}


def _plan(text: str, world: int = 4) -> Any:
    from ppdsl.lowering.lower import lower

    result = check_text(text, "<fp64>", world=world, model=True)
    assert result.ok, [d.message for d in result.diagnostics]
    return lower(result.spec, world, result.model_info)


def test_check_accepts_fp64_and_the_plan_carries_it() -> None:
    plan = _plan(DECODER.format(**LAYOUTS["tp2_pp2_1f1b"]))
    assert plan.train.precision == "fp64"


def test_fp64_doubles_the_memory_estimate() -> None:
    import attrs

    from ppdsl.views.report import plan_report

    from ppdsl.lowering.lower import lower

    result = check_text(DECODER.format(**LAYOUTS["dp2_tp2_zero1"]), "<fp64>", world=4, model=True)
    plan = lower(result.spec, 4, result.model_info)
    fp32 = attrs.evolve(plan, train=attrs.evolve(plan.train, precision="fp32"))
    wide, narrow = plan_report(plan, result.model_info).rows[0], plan_report(fp32, result.model_info).rows[0]
    assert wide.params == narrow.params and narrow.dp_bytes > 0
    for field in ("weight_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes", "p2p_bytes", "dp_bytes"):
        assert getattr(wide, field) == 2 * getattr(narrow, field), field


def test_models_with_experts_are_built_with_the_eager_experts_kernel() -> None:
    """transformers' default experts kernel (torch's grouped_mm) takes no float64."""
    mixtral = DIFF_LLAMA.replace("DiffLlamaForCausalLM", "MixtralForCausalLM").replace(
        "tensor_parallel { hf_plan = true }\n", "").replace("head_dim = 8,", "num_local_experts = 4,")
    plan = _plan(mixtral)
    assert plan.model.config_dict["experts_implementation"] == "eager"
    # Mixtral runs its own forward, which builds every MoE with the eager experts (its meta trace
    # needs them): in fp32 too
    assert _plan(mixtral.replace("precision = fp64", "precision = fp32")).model.config_dict["experts_implementation"] == "eager"
    chosen = mixtral.replace("num_local_experts = 4,", 'num_local_experts = 4, experts_implementation = "eager",')
    assert _plan(chosen).model.config_dict["experts_implementation"] == "eager"


def test_tolerances_and_the_hint() -> None:
    from ppdsl.runtime.verify.report import Tolerances, VerifyReport

    plan = _plan(DECODER.format(**LAYOUTS["tp2_pp2_1f1b"]))
    tol = Tolerances.for_plan(plan)
    assert tol.loss_abs <= 1e-7 and tol.grad_rel <= 1e-6 and tol.drift_rel <= 1e-6
    failed = dict(plan="x", steps=1, losses=((1.0, 1.0),), grad_norms=((1.0, 1.0),),
                  grad_diffs_by_step=({"w": 1e-3},), param_diffs={"w": 0.0})
    assert "train.precision=fp64" in VerifyReport(**failed).render()  # fp32: try fp64
    assert "train.precision=fp64" not in VerifyReport(**failed, tol=tol, precision="fp64").render()


def verify_worker(rank: int, world: int, plans: list[tuple[str, dict[str, Any]]]) -> list[tuple[str, Any]]:
    import torch

    from ppdsl.lowering.plan import Plan
    from ppdsl.runtime.parallel.groups import build_process_groups, tie_pp_ranks_of
    from ppdsl.runtime.verify.world import verify_in_process

    out = []
    for name, data in plans:
        plan = Plan.from_json(data)
        groups = build_process_groups(plan.mesh, "cpu", tie_pp_ranks_of(plan.schedule.stage_ranks))
        report = verify_in_process(plan, groups, torch.device("cpu"), plan.train.steps)
        if report is not None:
            out.append((name, report))
    return out


@pytest.mark.distributed
def test_fp64_runs_match_one_process_to_float64_rounding() -> None:
    from dist_harness import run_distributed

    plans = [(name, _plan(DECODER.format(**layout)).to_json()) for name, layout in LAYOUTS.items()]
    plans.append(("diff_llama_hf_plan", _plan(DIFF_LLAMA).to_json()))
    plans.append(("qwen3_one_kv_head_fp32", _plan(QWEN3_ONE_KV_HEAD).to_json()))
    results = run_distributed(verify_worker, 4, plans, timeout=300)
    assert [name for name, _ in results[0]] == [name for name, _ in plans]
    for name, report in results[0]:
        assert report.ok, f"{name}:\n{report.render()}"
        if name.endswith("_fp32"):
            continue
        # far below what fp32 rounding would leave (~1e-7): every tensor was float64 end to end
        assert report.max_loss_diff < 1e-12, (name, report.max_loss_diff)
        assert report.max_grad_diff < 1e-10, (name, report.max_grad_diff)


@pytest.mark.distributed
@pytest.mark.slow  # about 28 s; fp64 runs by default in test_fp64_runs_match_one_process
def test_an_fp32_checkpoint_resumes_in_fp64(tmp_path) -> None:
    """Another precision on resume is allowed (with a note): the optimizer state takes the
    parameters' dtype (Adam's moments saved in fp32 step fp64 parameters, and the other way)."""
    from _run_helpers import resume_resharded

    ck = tmp_path / "ck"
    text = (DECODER.format(**dict(LAYOUTS["tp2_pp2_1f1b"], tp=1, batch=4))
            .replace("precision = fp64", "precision = fp32")
            .replace("steps = 2", f'steps = 4\n  checkpoint {{ dir = "{ck}", every = 2 }}'))
    spec = tmp_path / "fp32.ppspec"
    spec.write_text(text, encoding="utf-8")
    want, got, output = resume_resharded(tmp_path, spec, ck, 2, ["train.precision=fp64"])
    assert "precision differs from the checkpoint ('fp32' -> 'fp64')" in output
    assert sorted(got) == [3, 4]
    for step in (3, 4):  # the same trajectory, now without fp32's rounding
        assert abs(got[step] - want[step]) <= 1e-5, (step, got[step], want[step])


def test_an_hf_checkpoint_resumes_under_the_other_precision() -> None:
    """fp64 builds HF models with experts_implementation = eager: a kernel, not the weights, so the
    checkpoint's model fingerprint still matches (another model config is refused)."""
    import attrs
    import pytest as _pytest

    from ppdsl.runtime.checkpoint.resume import FORMAT, CheckpointMismatch, check_compatible, fingerprint

    fp32 = _plan(QWEN3_ONE_KV_HEAD)
    fp64 = _plan(QWEN3_ONE_KV_HEAD.replace("steps = 2,", "steps = 2, precision = fp64,"))
    # a kernel key the two configs differ in (a family's class is built with transformers' default
    # experts kernel in fp32, the own forward's with the eager one in both)
    fp64 = attrs.evolve(fp64, model=attrs.evolve(fp64.model, config=tuple(sorted(
        {**dict(fp64.model.config), "attn_implementation": "eager"}.items()))))
    assert fp64.model != fp32.model
    for saved, now in ((fp32, fp64), (fp64, fp32)):
        meta = {"format": FORMAT, "fingerprint": fingerprint(saved), "step": 2, "samples": 2 * saved.train.global_batch}
        notes = check_compatible(meta, now, "ck/step-000002")
        assert any("precision differs" in n for n in notes), notes
    other = attrs.evolve(fp32.model, config=tuple((k, 3 if k == "num_hidden_layers" else v) for k, v in fp32.model.config))
    meta = {"format": FORMAT, "fingerprint": fingerprint(attrs.evolve(fp32, model=other)), "step": 2, "samples": 2 * fp32.train.global_batch}
    with _pytest.raises(CheckpointMismatch, match="model"):
        check_compatible(meta, fp64, "ck/step-000002")
