"""FalconForCausalLM stages (rotary, no ALiBi), mirroring transformers 5.24 FalconModel.forward /
FalconForCausalLM.forward.

Kept: query_key_value is a FalconLinear, which the own forward's split would replace by a plain
linear (E0426); nor can the own forward run sequence parallelism (E0423).

first: transformer.word_embeddings; blocks: transformer.h with the causal mask (materialised:
allow_is_causal_skip = False, as FalconModel builds it) and the rotary tables of
transformer.rotary_emb; last: transformer.ln_f, lm_head. The attention reads num_heads /
num_kv_heads in its reshapes: made local.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from ppdsl.core.hf_masks import build_mask, call_block
from ppdsl.runtime.stage.adapters.base import StageAdapter, divide_attrs, positions

if TYPE_CHECKING:
    from ppdsl.runtime.stage.build import MicroBatch, StageModule


class FalconStage(StageAdapter):
    @staticmethod
    def attention_changes(module: nn.Module, tp: int) -> list[tuple[str, int, int]]:
        attn = cast(Any, module)
        if attn.multi_query and not attn.new_decoder_architecture:
            # [all q | k | v]: the rank computes its query heads and the one (replicated) kv head, so
            # the query heads per kv head (5.25's num_key_value_groups) are the rank's heads too
            return divide_attrs(module, ("num_heads", "hidden_size", "split_size", "num_key_value_groups"), tp,
                                "attention heads/width", required=("num_heads",))
        return divide_attrs(module, ("num_heads", "num_kv_heads", "hidden_size", "split_size"), tp,
                            "attention heads/width", required=("num_heads",))

    def embed(self, stage: StageModule, mb: MicroBatch) -> torch.Tensor:
        return stage.get_submodule("transformer.word_embeddings")(mb.input_ids)

    def context(self, stage: StageModule, hidden: torch.Tensor, mb: MicroBatch) -> Any:
        from transformers.masking_utils import create_causal_mask

        position_ids = positions(hidden.shape[1], hidden.device, mb)
        mask = build_mask(create_causal_mask, stage.config, hidden, mb.attention_mask, position_ids,
                          allow_is_causal_skip=False)
        position_embeddings = stage.get_submodule("transformer.rotary_emb")(hidden, position_ids=position_ids)
        return mask, position_ids, position_embeddings

    def run_block(self, stage: StageModule, block: nn.Module, hidden: torch.Tensor, ctx: Any) -> torch.Tensor:
        mask, position_ids, position_embeddings = ctx
        return call_block(block, hidden, layer_past=None, attention_mask=mask, position_ids=position_ids,
                          use_cache=False, output_attentions=False, alibi=None,
                          position_embeddings=position_embeddings)

    def head(self, stage: StageModule, hidden: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        hidden = stage.get_submodule("transformer.ln_f")(hidden)
        return stage.get_submodule("lm_head")(hidden)
