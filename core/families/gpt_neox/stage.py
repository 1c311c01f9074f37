"""GPTNeoXForCausalLM stages, mirroring transformers 5.24 GPTNeoXModel.forward /
GPTNeoXForCausalLM.forward.

Kept for sequence parallelism, which the own forward lacks (E0423); without it the own forward
reproduces this class at pp 2 x tp 2 (benchmarks/own_forward_vs_families.py).

first: gpt_neox.embed_in, then emb_dropout; blocks: gpt_neox.layers with the causal mask and
the rotary (cos, sin) of gpt_neox.rotary_emb (no parameters, rebuilt on every stage); last:
gpt_neox.final_layer_norm, lm_head. The attention views its qkv output as (-1 heads,
3 * head_size): nothing to rewrite once the projection is split by whole heads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from ...hf_masks import build_mask
from ..stage_base import StageAdapter, positions
from ...phrasing import not_divisible_by_tp

if TYPE_CHECKING:
    from ppdsl.runtime.stage import MicroBatch, StageModule


class GPTNeoXStage(StageAdapter):
    @staticmethod
    def attention_changes(module: nn.Module, tp: int) -> list[tuple[str, int, int]]:
        heads = int(cast(Any, module).config.num_attention_heads)
        if heads % tp:
            raise ValueError(f"{type(module).__name__}: " + not_divisible_by_tp(f"num_attention_heads = {heads}", tp))
        return []

    def embed(self, stage: StageModule, mb: MicroBatch) -> torch.Tensor:
        hidden = stage.get_submodule("gpt_neox.embed_in")(mb.input_ids)
        return stage.get_submodule("gpt_neox.emb_dropout")(hidden)

    def context(self, stage: StageModule, hidden: torch.Tensor, mb: MicroBatch) -> Any:
        from transformers.masking_utils import create_causal_mask

        position_ids = positions(hidden.shape[1], hidden.device, mb)
        mask = build_mask(create_causal_mask, stage.config, hidden, mb.attention_mask, position_ids)
        position_embeddings = stage.get_submodule("gpt_neox.rotary_emb")(hidden, position_ids=position_ids)
        return mask, position_ids, position_embeddings

    def run_block(self, stage: StageModule, block: nn.Module, hidden: torch.Tensor, ctx: Any) -> torch.Tensor:
        mask, position_ids, position_embeddings = ctx
        return block(hidden, attention_mask=mask, position_ids=position_ids, layer_past=None, use_cache=False,
                     position_embeddings=position_embeddings)

    def head(self, stage: StageModule, hidden: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        hidden = stage.get_submodule("gpt_neox.final_layer_norm")(hidden)
        assert self.last is not None
        return stage.get_submodule(self.last[-1])(hidden)  # lm_head (5.x), embed_out (4.x): the declared plan's
