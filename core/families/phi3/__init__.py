"""Phi3ForCausalLM: the rotary decoder with fused projections: self_attn.qkv_proj holds
[q | k | v] (three equal parts only when num_key_value_heads == num_attention_heads) and
mlp.gate_up_proj holds [gate | up]; the sliding-window mask when config.sliding_window is set
(torch half: runtime/stage/adapters/phi3.py)."""

from ..descriptor import Family, Fused

FAMILY = Family(
    name="phi3",
    hf_classes={"Phi3ForCausalLM": "transformers.models.phi3.configuration_phi3:Phi3Config"},
    task="causal_lm",
    positions_from_microbatch=True,
    stage="ppdsl.runtime.stage.adapters.phi3:Phi3Stage",
    kv_heads_default_heads=True,
    fused={"self_attn.qkv_proj": Fused(3), "mlp.gate_up_proj": Fused(2)},
    attention_classes=("Phi3Attention",),
)
