"""LlamaForCausalLM: rotary decoder, causal mask (torch half: stage.py on rotary_decoder)."""

from ..descriptor import Family

FAMILY = Family(
    name="llama",
    hf_classes={"LlamaForCausalLM": "transformers.models.llama.configuration_llama:LlamaConfig"},
    task="causal_lm",
    positions_from_microbatch=True,
    stage="ppdsl.core.families.llama.stage:LlamaStage",
    kv_heads_default_heads=True,
    kv_projections=("self_attn.k_proj", "self_attn.v_proj"),
    attention_classes=("LlamaAttention",),
)
