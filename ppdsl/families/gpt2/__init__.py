"""GPT2LMHeadModel: learned positions, fused q|k|v Conv1D, tied lm_head (torch half: stage.py)."""

from ppdsl.families.descriptor import Family, Fused

FAMILY = Family(
    name="gpt2",
    hf_classes={"GPT2LMHeadModel": "transformers.models.gpt2.configuration_gpt2:GPT2Config"},
    blocks="transformer.h",
    first=("transformer.wte", "transformer.wpe"),
    last=("transformer.ln_f", "lm_head"),
    task="causal_lm",
    stage="ppdsl.families.gpt2.stage:GPT2Stage",
    ffn_per_hidden=4,  # n_inner = None
    fused={"attn.c_attn": Fused(3)},
    attention_classes=("GPT2Attention",),
)
