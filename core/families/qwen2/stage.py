"""Qwen2ForCausalLM stages: Qwen2Model.forward builds the full causal mask and, when a layer is
of type sliding_attention, the sliding-window one; each layer takes config.layer_types[i]'s."""

from ..rotary_decoder import RotaryDecoderStage


class Qwen2Stage(RotaryDecoderStage):
    mask = "layer_types"
