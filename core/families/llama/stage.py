"""LlamaForCausalLM stages: the rotary decoder with one causal mask (LlamaModel.forward).

Kept for sequence parallelism, which the own forward lacks (E0423); without it the own forward
reproduces this class at pp 2 x tp 2 (benchmarks/own_forward_vs_families.py).
"""

from ..rotary_decoder import RotaryDecoderStage


class LlamaStage(RotaryDecoderStage):
    mask = "causal"
