"""MixtralForCausalLM stages: MixtralModel.forward (the sliding-window mask when
config.sliding_window is set) and the plain causal-LM loss (no router auxiliary loss)."""

from ..rotary_decoder import RotaryDecoderStage


class MixtralStage(RotaryDecoderStage):
    mask = "sliding_if_set"
