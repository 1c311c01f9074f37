"""LlamaForCausalLM: rotary decoder, causal mask (torch half: runtime/stage/adapters/llama.py on rotary_decoder.py)."""

from ..descriptor import Family

FAMILY = Family(
    name="llama",
    hf_classes={"LlamaForCausalLM": "transformers.models.llama.configuration_llama:LlamaConfig"},
    task="causal_lm",
    positions_from_microbatch=True,
    stage="ppdsl.runtime.stage.adapters.llama:LlamaStage",
    kv_heads_default_heads=True,
    kv_projections=("self_attn.k_proj", "self_attn.v_proj"),
    attention_classes=("LlamaAttention",),
)
