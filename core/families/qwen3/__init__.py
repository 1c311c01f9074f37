"""Qwen3ForCausalLM: Qwen2's layout with per-head q/k RMSNorms (head_dim wide, so heads split
over tp unchanged) and per-layer masks from config.layer_types (torch half: stage.py)."""

from ..descriptor import Family

FAMILY = Family(
    name="qwen3",
    hf_classes={"Qwen3ForCausalLM": "transformers.models.qwen3.configuration_qwen3:Qwen3Config"},
    task="causal_lm",
    positions_from_microbatch=True,
    stage="ppdsl.core.families.qwen3.stage:Qwen3Stage",
    kv_heads_default_heads=True,
    kv_projections=("self_attn.k_proj", "self_attn.v_proj"),
    attention_classes=("Qwen3Attention",),
)
