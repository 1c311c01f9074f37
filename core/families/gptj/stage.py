"""GPTJForCausalLM stages, mirroring transformers 5.24 GPTJModel.forward / GPTJForCausalLM.forward.

Kept for sequence parallelism, which the own forward lacks (E0423); without it the own forward
reproduces this class at pp 2 x tp 2 (benchmarks/own_forward_vs_families.py).

first: transformer.wte (+ wte(token_type_ids)), drop; blocks: transformer.h with the causal mask
and the rotary tables of transformer.rotary_emb (no parameters, rebuilt on every stage); last:
transformer.ln_f, lm_head. The attention reshapes with -1 heads; num_attention_heads and
embed_dim are made local for readers of older versions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ...hf_masks import build_mask, call_block
from ..stage_base import StageAdapter, divide_attrs, positions

if TYPE_CHECKING:
    from ppdsl.runtime.stage import MicroBatch, StageModule


class GPTJStage(StageAdapter):
    @staticmethod
    def attention_changes(module: nn.Module, tp: int) -> list[tuple[str, int, int]]:
        return divide_attrs(module, ("num_attention_heads", "embed_dim"), tp, "attention heads/width",
                            required=("num_attention_heads",))

    def embed(self, stage: StageModule, mb: MicroBatch) -> torch.Tensor:
        wte = stage.get_submodule("transformer.wte")
        hidden = wte(mb.input_ids)
        if mb.token_type_ids is not None:
            hidden = hidden + wte(mb.token_type_ids.view(-1, mb.input_ids.shape[-1]))
        return stage.get_submodule("transformer.drop")(hidden)

    def context(self, stage: StageModule, hidden: torch.Tensor, mb: MicroBatch) -> Any:
        from transformers.masking_utils import create_causal_mask

        position_ids = positions(hidden.shape[1], hidden.device, mb)
        mask = build_mask(create_causal_mask, stage.config, hidden, mb.attention_mask, position_ids)
        # transformers 4.x: no rotary_emb module, each attention rotates from its own table
        rotary = getattr(stage.get_submodule("transformer"), "rotary_emb", None)
        position_embeddings = None if rotary is None else rotary(hidden, position_ids=position_ids)
        return mask, position_ids, position_embeddings

    def run_block(self, stage: StageModule, block: nn.Module, hidden: torch.Tensor, ctx: Any) -> torch.Tensor:
        mask, position_ids, position_embeddings = ctx
        return call_block(block, hidden, attention_mask=mask, position_ids=position_ids, cache=None, use_cache=False,
                     position_embeddings=position_embeddings)

    def head(self, stage: StageModule, hidden: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        hidden = stage.get_submodule("transformer.ln_f")(hidden)
        return stage.get_submodule("lm_head")(hidden)
