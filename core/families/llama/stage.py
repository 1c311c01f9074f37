"""LlamaForCausalLM stages: the rotary decoder with one causal mask (LlamaModel.forward)."""

from ..rotary_decoder import RotaryDecoderStage


class LlamaStage(RotaryDecoderStage):
    mask = "causal"
