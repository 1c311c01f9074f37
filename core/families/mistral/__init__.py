"""MistralForCausalLM: the rotary decoder with a sliding-window causal mask when
config.sliding_window is set (torch half: stage.py on rotary_decoder)."""

from ..descriptor import Family

FAMILY = Family(
    name="mistral",
    hf_classes={"MistralForCausalLM": "transformers.models.mistral.configuration_mistral:MistralConfig"},
    task="causal_lm",
    positions_from_microbatch=True,
    stage="ppdsl.core.families.mistral.stage:MistralStage",
    kv_heads_default_heads=True,
    kv_projections=("self_attn.k_proj", "self_attn.v_proj"),
    attention_classes=("MistralAttention",),
)
