"""GemmaForCausalLM: the rotary decoder with embeddings scaled by sqrt(hidden), (1 + weight)
RMSNorms and a tied lm_head (torch half: runtime/stage/adapters/gemma.py)."""

from ..descriptor import Family

FAMILY = Family(
    name="gemma",
    hf_classes={"GemmaForCausalLM": "transformers.models.gemma.configuration_gemma:GemmaConfig"},
    task="causal_lm",
    positions_from_microbatch=True,
    stage="ppdsl.runtime.stage.adapters.gemma:GemmaStage",
    kv_heads_default_heads=True,
    kv_projections=("self_attn.k_proj", "self_attn.v_proj"),
    attention_classes=("GemmaAttention",),
)
