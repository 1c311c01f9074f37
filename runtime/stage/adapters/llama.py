"""LlamaForCausalLM stages: the rotary decoder with one causal mask (LlamaModel.forward).

Reproduced by the own forward at pp 2 x tp 2, sequence parallelism included
(benchmarks/own_forward_vs_families.py); kept until the tests that build plans with this family move
to the own forward, then deleted (issue 30).
"""

from ppdsl.runtime.stage.adapters.rotary_decoder import RotaryDecoderStage


class LlamaStage(RotaryDecoderStage):
    mask = "causal"
