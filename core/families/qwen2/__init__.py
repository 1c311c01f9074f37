"""Qwen2ForCausalLM: the rotary decoder (q/k/v biases) with per-layer full or sliding-window
masks from config.layer_types (torch half: stage.py on rotary_decoder)."""

from ..descriptor import Family

FAMILY = Family(
    name="qwen2",
    hf_classes={"Qwen2ForCausalLM": "transformers.models.qwen2.configuration_qwen2:Qwen2Config"},
    task="causal_lm",
    positions_from_microbatch=True,
    stage="ppdsl.core.families.qwen2.stage:Qwen2Stage",
    kv_heads_default_heads=True,
    kv_projections=("self_attn.k_proj", "self_attn.v_proj"),
    attention_classes=("Qwen2Attention",),
)
