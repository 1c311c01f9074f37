"""MistralForCausalLM stages: MistralModel.forward picks create_sliding_window_causal_mask when
config.sliding_window is set, create_causal_mask otherwise."""

from ..rotary_decoder import RotaryDecoderStage


class MistralStage(RotaryDecoderStage):
    mask = "sliding_if_set"
