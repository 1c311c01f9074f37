"""GPTJForCausalLM: parallel attention + MLP blocks with partial rotary embeddings (rotary_dim),
lm_head with a bias (torch half: stage.py)."""

from ..descriptor import Family, Layout

FAMILY = Family(
    name="gptj",
    hf_classes={"GPTJForCausalLM": "transformers.models.gptj.configuration_gptj:GPTJConfig"},
    task="causal_lm",
    positions_from_microbatch=True,
    stage="ppdsl.core.families.gptj.stage:GPTJStage",
    ffn_per_hidden=4,  # n_inner = None
    attention_classes=("GPTJAttention",),
    # written out: GPTJConfig declares no base_model_pp_plan before transformers 5
    layout=Layout("transformer.h", ("transformer.wte",), ("transformer.ln_f", "lm_head")),
)
