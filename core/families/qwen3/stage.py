"""Qwen3ForCausalLM stages: Qwen3Model.forward, the same mask mapping as Qwen2's."""

from ..rotary_decoder import RotaryDecoderStage


class Qwen3Stage(RotaryDecoderStage):
    mask = "layer_types"
