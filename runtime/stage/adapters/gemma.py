"""GemmaForCausalLM stages, mirroring transformers 5.24 GemmaModel.forward (one causal mask).

Kept: the own forward cannot vocab-split the scaled embedding (its scale would be lost: E0426), nor
run sequence parallelism (E0423).

The embedding (GemmaTextScaledWordEmbedding) multiplies its lookup by sqrt(hidden_size) cast to
the weight's dtype; once split by vocab it is a VocabParallelEmbedding without that scale, so
the stage applies it. Init: transformers zeroes the RMSNorm weights (the norm scales by 1 + w).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ppdsl.runtime.stage.adapters.rotary_decoder import RotaryDecoderStage
from ppdsl.runtime.stage.init import HFInitRule, InitRule

if TYPE_CHECKING:
    from ppdsl.lowering.plan import ModelRef
    from ppdsl.runtime.stage.build import MicroBatch, StageModule


class GemmaStage(RotaryDecoderStage):
    mask = "causal"

    def init_rule(self, model: nn.Module, ref: ModelRef) -> InitRule:
        base = super().init_rule(model, ref)
        assert isinstance(base, HFInitRule)
        return HFInitRule(std=base.std, norm_weight=0.0)

    def embed(self, stage: StageModule, mb: MicroBatch) -> torch.Tensor:
        embed = stage.get_submodule("model.embed_tokens")
        hidden = embed(mb.input_ids)
        if not hasattr(embed, "scalar_embed_scale"):  # split by vocab: the scale is the stage's
            scale = torch.tensor(stage.config.hidden_size**0.5, device=hidden.device)
            hidden = hidden * scale.to(embed.weight.dtype)
        return hidden
