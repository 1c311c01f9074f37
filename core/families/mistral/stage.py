"""MistralForCausalLM stages: MistralModel.forward picks create_sliding_window_causal_mask when
config.sliding_window is set, create_causal_mask otherwise.

Kept for sequence parallelism, which the own forward lacks (E0423); without it the own forward
reproduces this class at pp 2 x tp 2 (benchmarks/own_forward_vs_families.py).
"""

from ..rotary_decoder import RotaryDecoderStage


class MistralStage(RotaryDecoderStage):
    mask = "sliding_if_set"
