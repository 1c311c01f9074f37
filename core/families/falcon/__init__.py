"""FalconForCausalLM with rotary positions: a fused query_key_value whose output is grouped per
head ([q k v] per head when multi_query = false; [q.. k v] per kv group with
new_decoder_architecture), so a plain column split hands each rank whole heads / groups. The
original multi-query layout ([all q | k | v], one kv head) is divided part by part: each rank its
query heads and the one kv head, replicated (``multi_query``; not with sequence parallelism, whose
split regions need the layer split); ALiBi is refused (torch half: runtime/stage/adapters/falcon.py)."""

from ..descriptor import Family, Fused, Layout, SplitRefusal

# the config under which query_key_value is [all q | k | v] (one key/value head)
_MULTI_QUERY = {"multi_query": True, "new_decoder_architecture": False}

FAMILY = Family(
    name="falcon",
    hf_classes={"FalconForCausalLM": "transformers.models.falcon.configuration_falcon:FalconConfig"},
    task="causal_lm",
    positions_from_microbatch=True,
    stage="ppdsl.runtime.stage.adapters.falcon:FalconStage",
    config_keys={"kv_heads": ("num_kv_heads",), "ffn": ("ffn_hidden_size",)},
    ffn_per_hidden=4,  # ffn_hidden_size = None
    kv_heads_default_heads=True,
    fused={"self_attention.query_key_value": Fused(3, per_head=True)},
    attention_classes=("FalconAttention",),
    split_refusals=(SplitRefusal(
        "self_attention.query_key_value", _MULTI_QUERY,
        "the multi-query layout [all q | k | v] (one key/value head) is divided only by a column split "
        "without gather_output and without sequence parallelism (the kv head replicated on every rank); "
        "or set multi_query = false or new_decoder_architecture = true"),),
    multi_query={"self_attention.query_key_value": _MULTI_QUERY},
    refuse={"alibi": (False, "ALiBi biases are built for all heads in the model's forward, not per tp rank")},
    layout=Layout("transformer.h", ("transformer.word_embeddings",), ("transformer.ln_f", "lm_head")),
)
