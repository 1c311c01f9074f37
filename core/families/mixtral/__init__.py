"""MixtralForCausalLM: Mistral's decoder with a sparse mixture-of-experts MLP. The experts are
3-d parameters (MixtralExperts.gate_up_proj / down_proj), not linear layers: tensor parallelism
splits the attention only, and every tp rank holds (replicates) all experts and the router
(torch half: stage.py). The router's auxiliary loss is off (output_router_logits = false)."""

from ..descriptor import Family

FAMILY = Family(
    name="mixtral",
    hf_classes={"MixtralForCausalLM": "transformers.models.mixtral.configuration_mixtral:MixtralConfig"},
    task="causal_lm",
    positions_from_microbatch=True,
    stage="ppdsl.core.families.mixtral.stage:MixtralStage",
    kv_heads_default_heads=True,
    kv_projections=("self_attn.k_proj", "self_attn.v_proj"),
    attention_classes=("MixtralAttention",),
    refuse={"output_router_logits": (False, "the router's auxiliary loss is not part of the pipeline's loss")},
)
