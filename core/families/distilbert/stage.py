"""DistilBertForSequenceClassification stages, mirroring transformers 5.24
DistilBertModel.forward and DistilBertForSequenceClassification.forward.

Kept for sequence parallelism, which the own forward lacks (E0423); without it the own forward
reproduces this class at pp 2 x tp 2 (benchmarks/own_forward_vs_families.py).

first: distilbert.embeddings (word + position embeddings, LayerNorm, dropout); blocks:
distilbert.transformer.layer with the bidirectional mask; last: hidden[:, 0], pre_classifier,
ReLU, dropout, classifier. The attention reshapes with -1 heads; n_heads / dim are made local
for readers of older versions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ...hf_masks import build_mask, call_block
from ..stage_base import StageAdapter, divide_attrs

if TYPE_CHECKING:
    from ppdsl.runtime.stage import MicroBatch, StageModule


class DistilBertStage(StageAdapter):
    @staticmethod
    def attention_changes(module: nn.Module, tp: int) -> list[tuple[str, int, int]]:
        return divide_attrs(module, ("n_heads", "dim"), tp, "attention heads/width", required=("n_heads",))

    def embed(self, stage: StageModule, mb: MicroBatch) -> torch.Tensor:
        return stage.get_submodule("distilbert.embeddings")(mb.input_ids)

    def context(self, stage: StageModule, hidden: torch.Tensor, mb: MicroBatch) -> Any:
        from transformers import masking_utils

        if not hasattr(masking_utils, "create_bidirectional_mask"):  # transformers 4.x: DistilBertModel's mask
            mask = mb.attention_mask
            if mask is None:
                mask = torch.ones(hidden.shape[:2], device=hidden.device)
            if stage.config._attn_implementation == "sdpa":
                from transformers.modeling_attn_mask_utils import _prepare_4d_attention_mask_for_sdpa

                mask = _prepare_4d_attention_mask_for_sdpa(mask, hidden.dtype, tgt_len=hidden.shape[1])
            return mask
        return build_mask(masking_utils.create_bidirectional_mask, stage.config, hidden, mb.attention_mask, None)

    def run_block(self, stage: StageModule, block: nn.Module, hidden: torch.Tensor, ctx: Any) -> torch.Tensor:
        return call_block(block, hidden, ctx)

    def head(self, stage: StageModule, hidden: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        pooled = hidden[:, 0]
        pooled = stage.get_submodule("pre_classifier")(pooled)
        pooled = nn.ReLU()(pooled)
        pooled = stage.get_submodule("dropout")(pooled)
        return stage.get_submodule("classifier")(pooled)
