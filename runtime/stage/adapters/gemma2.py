"""Gemma2ForCausalLM stages, mirroring transformers 5.24 Gemma2Model.forward (both masks, each
layer takes config.layer_types[i]'s) and Gemma2ForCausalLM.forward (logits / cap, tanh, * cap
when config.final_logit_softcapping is set: elementwise, so a vocab-split head caps its slice).

Kept: the own forward cannot vocab-split the scaled embedding (its scale would be lost: E0426), nor
run sequence parallelism (E0423).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ppdsl.runtime.stage.adapters.gemma import GemmaStage

if TYPE_CHECKING:
    from ppdsl.runtime.stage.build import MicroBatch, StageModule


class Gemma2Stage(GemmaStage):
    mask = "layer_types"

    def head(self, stage: StageModule, hidden: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        logits = super().head(stage, hidden, mb)
        cap = stage.config.final_logit_softcapping
        if cap is not None:
            logits = logits / cap
            logits = torch.tanh(logits)
            logits = logits * cap
        return logits
