"""GPTNeoXForCausalLM: rotary (partial) decoder with a fused query_key_value projection whose
output is interleaved per head ([q0 k0 v0 | q1 k1 v1 | ...]): a plain column split (fused = 1)
hands each rank whole heads (torch half: stage.py)."""

from ..descriptor import Family, Fused

FAMILY = Family(
    name="gpt_neox",
    hf_classes={"GPTNeoXForCausalLM": "transformers.models.gpt_neox.configuration_gpt_neox:GPTNeoXConfig"},
    task="causal_lm",
    positions_from_microbatch=True,
    stage="ppdsl.core.families.gpt_neox.stage:GPTNeoXStage",
    fused={"attention.query_key_value": Fused(3, per_head=True)},
    attention_classes=("GPTNeoXAttention",),
)
