"""GPT2LMHeadModel stages, mirroring transformers 5.24 GPT2Model.forward / GPT2LMHeadModel.forward.

Reproduced by the own forward at pp 2 x tp 2, sequence parallelism included
(benchmarks/own_forward_vs_families.py); kept until the tests that build plans with this family move
to the own forward, then deleted (issue 30).

first: wte + wpe (+ wte(token_type_ids)), drop; blocks: transformer.h with the causal mask;
last: ln_f, lm_head (tied to wte).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ppdsl.runtime.stage.init import HFInitRule, InitRule

from ppdsl.core.hf_masks import build_mask
from ppdsl.runtime.stage.adapters.base import StageAdapter, divide_attrs, positions

if TYPE_CHECKING:
    from ppdsl.lowering.plan import ModelRef
    from ppdsl.runtime.stage.build import MicroBatch, StageModule


def _is_residual_projection(name: str) -> bool:
    # GPT2PreTrainedModel._init_weights rescales c_proj of GPT2Attention and GPT2MLP.
    return name.endswith(".c_proj.weight")


class GPT2Stage(StageAdapter):
    @staticmethod
    def attention_changes(module: nn.Module, tp: int) -> list[tuple[str, int, int]]:
        # forward splits the fused c_attn output with split(self.split_size, dim=2): split_size
        # must become embed_dim / tp. num_heads / embed_dim are not read by the 5.24 forward, but
        # 4.x read them in _split_heads / _merge_heads and the SDPA variant's final view, so
        # they are made local too (as ColossalAI's Shardformer does).
        return divide_attrs(module, ("num_heads", "split_size", "embed_dim"), tp, "attention heads/width",
                            required=("num_heads", "split_size"))

    def init_rule(self, model: nn.Module, ref: ModelRef) -> InitRule:
        config = model.config
        std = float(config.initializer_range)
        scaled = std / math.sqrt(2 * config.n_layer)
        return HFInitRule(std=std, std_overrides=((_is_residual_projection, scaled),))

    def embed(self, stage: StageModule, mb: MicroBatch) -> torch.Tensor:
        seq_len = mb.input_ids.shape[-1]
        input_ids = mb.input_ids.view(-1, seq_len)
        wte = stage.get_submodule("transformer.wte")
        inputs_embeds = wte(input_ids)
        position_ids = positions(inputs_embeds.shape[1], inputs_embeds.device, mb)
        position_embeds = stage.get_submodule("transformer.wpe")(position_ids)
        hidden = inputs_embeds + position_embeds.to(inputs_embeds.device)
        if mb.token_type_ids is not None:
            hidden = hidden + wte(mb.token_type_ids.view(-1, seq_len))
        return stage.get_submodule("transformer.drop")(hidden)

    def context(self, stage: StageModule, hidden: torch.Tensor, mb: MicroBatch) -> Any:
        from transformers.masking_utils import create_causal_mask

        position_ids = positions(hidden.shape[1], hidden.device, mb)
        attention_mask = mb.attention_mask
        if attention_mask is not None and attention_mask.ndim < 4:
            attention_mask = attention_mask.view(hidden.shape[0], -1)
        mask = build_mask(create_causal_mask, stage.config, hidden, attention_mask, position_ids)
        return mask, position_ids

    def run_block(self, stage: StageModule, block: nn.Module, hidden: torch.Tensor, ctx: Any) -> torch.Tensor:
        mask, position_ids = ctx
        return block(
            hidden, None, mask, None, encoder_attention_mask=None, use_cache=False, position_ids=position_ids
        )

    def head(self, stage: StageModule, hidden: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        hidden = stage.get_submodule("transformer.ln_f")(hidden)
        return stage.get_submodule("lm_head")(hidden)
