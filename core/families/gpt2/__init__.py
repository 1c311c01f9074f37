"""GPT2LMHeadModel: learned positions, fused q|k|v Conv1D, tied lm_head (torch half: runtime/stage/adapters/gpt2.py)."""

from ..descriptor import Family, Fused, Layout

FAMILY = Family(
    name="gpt2",
    hf_classes={"GPT2LMHeadModel": "transformers.models.gpt2.configuration_gpt2:GPT2Config"},
    task="causal_lm",
    positions_from_microbatch=True,
    stage="ppdsl.runtime.stage.adapters.gpt2:GPT2Stage",
    ffn_per_hidden=4,  # n_inner = None
    fused={"attn.c_attn": Fused(3)},
    attention_classes=("GPT2Attention",),
    layout=Layout("transformer.h", ("transformer.wte", "transformer.wpe"), ("transformer.ln_f", "lm_head")),
)
