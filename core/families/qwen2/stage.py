"""Qwen2ForCausalLM stages: Qwen2Model.forward builds the full causal mask and, when a layer is
of type sliding_attention, the sliding-window one; each layer takes config.layer_types[i]'s.

Kept for sequence parallelism, which the own forward lacks (E0423); without it the own forward
reproduces this class at pp 2 x tp 2 (benchmarks/own_forward_vs_families.py).
"""

from ..rotary_decoder import RotaryDecoderStage


class Qwen2Stage(RotaryDecoderStage):
    mask = "layer_types"
