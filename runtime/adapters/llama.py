"""LlamaForCausalLM stages (and Mistral / Qwen2, same layout), mirroring transformers 5.24
LlamaModel.forward / LlamaForCausalLM.forward.

first: model.embed_tokens; blocks: model.layers, each given the causal mask and the rotary
(cos, sin) from model.rotary_emb, which has no parameters and is rebuilt on every stage;
last: model.norm, lm_head.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from . import StageAdapter, positions

if TYPE_CHECKING:
    from ppdsl.runtime.stage import MicroBatch, StageModule


class LlamaAdapter(StageAdapter):
    family = "llama"
    blocks = "model.layers"
    first = ("model.embed_tokens",)
    last = ("model.norm", "lm_head")
    head_module = "lm_head"

    def embed(self, stage: StageModule, mb: MicroBatch) -> torch.Tensor:
        return stage.get_submodule("model.embed_tokens")(mb.input_ids)

    def context(self, stage: StageModule, hidden: torch.Tensor, mb: MicroBatch) -> Any:
        from transformers.masking_utils import create_causal_mask

        position_ids = positions(hidden.shape[1], hidden.device)
        mask = create_causal_mask(
            config=stage.config,
            inputs_embeds=hidden,
            attention_mask=mb.attention_mask,
            cache=None,
            position_ids=position_ids,
        )
        # cos / sin take the dtype of the hidden states, as in LlamaModel.forward.
        position_embeddings = stage.get_submodule("model.rotary_emb")(hidden, position_ids=position_ids)
        return mask, position_ids, position_embeddings

    def run_block(self, stage: StageModule, block: nn.Module, hidden: torch.Tensor, ctx: Any) -> torch.Tensor:
        mask, position_ids, position_embeddings = ctx
        return block(
            hidden,
            attention_mask=mask,
            position_embeddings=position_embeddings,
            position_ids=position_ids,
            cache=None,
            use_cache=False,
        )

    def head(self, stage: StageModule, hidden: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        hidden = stage.get_submodule("model.norm")(hidden)
        return stage.get_submodule("lm_head")(hidden)
