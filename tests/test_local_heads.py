"""The own forward's local heads under tp travel in the plan (`Plan.tp_local_heads`): check's
proof at one rank's local shapes sets them, lowering records them, and the runtime sets exactly
those attributes, refusing a plan that does not say them or that was lowered for another model."""

from __future__ import annotations

import attrs
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from _front_end import lower_text  # noqa: E402

OPT = """ppspec 1
model m {{
  source = hf("OPTForCausalLM")
  config {{ num_hidden_layers = 2, hidden_size = 64, num_attention_heads = 4, ffn_dim = 128, vocab_size = 128, word_embed_proj_dim = 64 }}
}}
mesh {{ pp = 2, tp = {tp} }}
tensor_parallel {{
  model.decoder.layers[*].self_attn.q_proj : column
  model.decoder.layers[*].self_attn.k_proj : column
  model.decoder.layers[*].self_attn.v_proj : column
  model.decoder.layers[*].self_attn.out_proj : row
  model.decoder.layers[*].fc1 : column
  model.decoder.layers[*].fc2 : row
}}
pipeline {{ style = 1f1b, microbatches = 2 }}
train {{ global_batch = 4, seq_len = 16, steps = 2 }}
"""


def test_the_plan_holds_the_heads_check_made_local() -> None:
    from ppdsl.lowering.plan import LocalHeads, Plan

    plan = lower_text(OPT.format(tp=2), world=4)
    assert plan.tp_local_heads == tuple(
        LocalHeads(f"model.decoder.layers.{i}.self_attn", (("num_heads", 4, 2), ("embed_dim", 64, 32)), False)
        for i in range(2))
    assert Plan.from_json(plan.to_json()) == plan  # the workers read it from plan.json
    assert lower_text(OPT.format(tp=1), world=2).tp_local_heads is None


def test_the_runtime_sets_the_plans_heads_and_refuses_a_plan_without_them() -> None:
    from ppdsl.runtime.parallel.parallelize import _localize_heads
    from ppdsl.runtime.stage.build import build_stages

    plan = lower_text(OPT.format(tp=2), world=4)
    (stage,) = build_stages(plan, 0, torch.device("cpu"), 0)
    attention = stage.get_submodule("model.decoder.layers.0.self_attn")
    _localize_heads(stage, plan, 0)
    assert (attention.num_heads, attention.embed_dim) == (2, 32)

    (stage,) = build_stages(plan, 0, torch.device("cpu"), 0)
    with pytest.raises(ValueError, match="older ppdsl"):
        _localize_heads(stage, attrs.evolve(plan, tp_local_heads=None), 0)
    other = tuple(attrs.evolve(h, attributes=(("num_heads", 8, 4),)) for h in plan.tp_local_heads)
    with pytest.raises(ValueError, match="lowered for another model"):
        _localize_heads(stage, attrs.evolve(plan, tp_local_heads=other), 0)
