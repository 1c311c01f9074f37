"""OPTForCausalLM stages, mirroring transformers 5.24 OPTDecoder.forward / OPTForCausalLM.forward.

Reproduced by the own forward at pp 2 x tp 2 (benchmarks/own_forward_vs_families.py; sequence
parallelism refused by both: its blocks flatten the tokens); kept until the tests that build plans
with this family (context parallelism, packed documents) move to the own forward (issue 30).

first: model.decoder.embed_tokens, project_in (if any), plus embed_positions at the microbatch's
position ids (packed documents), else cumsum(mask) * mask - 1 (+ offset 2 inside the module; mask
all ones without padding); blocks: model.decoder.layers with the causal mask (packed documents:
ppdsl's document masks, core/document_masks.py, as OPT's mask builder does not read positions); last: final_layer_norm (if any), project_out (if
any), lm_head. The attention views with self.num_heads: made local, with embed_dim.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ...hf_masks import build_mask, call_block
from ..stage_base import StageAdapter, divide_attrs, positions

if TYPE_CHECKING:
    from ppdsl.runtime.stage import MicroBatch, StageModule

_D = "model.decoder"


class OPTStage(StageAdapter):
    @staticmethod
    def attention_changes(module: nn.Module, tp: int) -> list[tuple[str, int, int]]:
        return divide_attrs(module, ("num_heads", "embed_dim"), tp, "attention heads/width", required=("num_heads",))

    def _mask(self, mb: MicroBatch) -> torch.Tensor:
        if mb.attention_mask is not None:
            return mb.attention_mask
        return torch.ones(mb.input_ids.shape[0], mb.input_ids.shape[-1], device=mb.input_ids.device)

    @staticmethod
    def _positions(mb: MicroBatch, mask: torch.Tensor) -> torch.Tensor:
        """The microbatch's (context parallelism: its tokens' global positions; packed documents:
        restarting at each), else counted over the mask as OPTDecoder.forward counts them."""
        if mb.sequence_shard is not None or mb.position_ids is not None:
            return positions(mask.shape[1], mask.device, mb)
        return (torch.cumsum(mask, dim=1) * mask - 1).long()

    def embed(self, stage: StageModule, mb: MicroBatch) -> torch.Tensor:
        input_ids = mb.input_ids.view(-1, mb.input_ids.shape[-1])
        inputs_embeds = stage.get_submodule(f"{_D}.embed_tokens")(input_ids)
        position_mask = self._mask(mb)
        position_ids = self._positions(mb, position_mask)
        pos_embeds = stage.get_submodule(f"{_D}.embed_positions")(position_mask, 0, position_ids=position_ids)
        if stage.config.word_embed_proj_dim != stage.config.hidden_size:
            inputs_embeds = stage.get_submodule(f"{_D}.project_in")(inputs_embeds)
        return inputs_embeds + pos_embeds.to(inputs_embeds.device)

    def context(self, stage: StageModule, hidden: torch.Tensor, mb: MicroBatch) -> Any:
        from transformers.masking_utils import create_causal_mask

        position_ids = self._positions(mb, self._mask(mb))
        causal = build_mask(create_causal_mask, stage.config, hidden, mb.attention_mask, None)
        return causal, position_ids

    def run_block(self, stage: StageModule, block: nn.Module, hidden: torch.Tensor, ctx: Any) -> torch.Tensor:
        mask, position_ids = ctx
        return call_block(block, hidden, attention_mask=mask, position_ids=position_ids, cache=None, use_cache=False)

    def head(self, stage: StageModule, hidden: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        config = stage.config
        if config.do_layer_norm_before and not getattr(config, "_remove_final_layer_norm", False):
            hidden = stage.get_submodule(f"{_D}.final_layer_norm")(hidden)
        if config.word_embed_proj_dim != config.hidden_size:
            hidden = stage.get_submodule(f"{_D}.project_out")(hidden)
        return stage.get_submodule("lm_head")(hidden).contiguous()
