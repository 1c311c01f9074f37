"""OPTForCausalLM: learned positions offset by 2 and counted over the attention mask, optional
project_in / project_out (word_embed_proj_dim != hidden_size) and final_layer_norm
(do_layer_norm_before), tied lm_head (torch half: stage.py)."""

from ..descriptor import Family, Layout

FAMILY = Family(
    name="opt",
    hf_classes={"OPTForCausalLM": "transformers.models.opt.configuration_opt:OPTConfig"},
    task="causal_lm",
    stage="ppdsl.core.families.opt.stage:OPTStage",
    positions_from_microbatch=True,
    config_keys={"ffn": ("ffn_dim",)},
    attention_classes=("OPTAttention",),
    refuse={"layerdrop": (0.0, "LayerDrop skips random layers: a pipeline runs every layer it holds")},
    no_sequence_parallel="OPTDecoderLayer flattens its tokens to (batch * sequence, hidden) before fc1, so the "
                         "sequence-split hidden states cannot be gathered along the sequence there",
    layout=Layout("model.decoder.layers", ("model.decoder.embed_tokens", "model.decoder.embed_positions"), ("model.decoder.final_layer_norm", "lm_head")),
    optional_first=("model.decoder.project_in",),
    optional_last=("model.decoder.final_layer_norm", "model.decoder.project_out"),
)
