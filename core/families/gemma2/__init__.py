"""Gemma2ForCausalLM: Gemma's embeddings and norms, attention logit soft-capping, alternating
sliding-window / full layers (config.layer_types) and soft-capped final logits (torch half:
runtime/stage/adapters/gemma2.py)."""

from ..descriptor import Family

FAMILY = Family(
    name="gemma2",
    hf_classes={"Gemma2ForCausalLM": "transformers.models.gemma2.configuration_gemma2:Gemma2Config"},
    task="causal_lm",
    positions_from_microbatch=True,
    stage="ppdsl.runtime.stage.adapters.gemma2:Gemma2Stage",
    kv_heads_default_heads=True,
    kv_projections=("self_attn.k_proj", "self_attn.v_proj"),
    attention_classes=("Gemma2Attention",),
)
