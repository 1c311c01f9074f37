"""MixtralForCausalLM stages: MixtralModel.forward (the sliding-window mask when
config.sliding_window is set) and the plain causal-LM loss (no router auxiliary loss).

Kept for sequence parallelism, which the own forward lacks (E0423); without it the own forward
reproduces this class at pp 2 x tp 2 (benchmarks/own_forward_vs_families.py).
"""

from ..rotary_decoder import RotaryDecoderStage


class MixtralStage(RotaryDecoderStage):
    mask = "sliding_if_set"
