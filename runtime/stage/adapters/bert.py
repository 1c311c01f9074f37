"""BertForSequenceClassification stages, mirroring transformers 5.24 BertModel.forward and
BertForSequenceClassification.forward.

Reproduced by the own forward at pp 2 x tp 2, sequence parallelism included
(benchmarks/own_forward_vs_families.py); kept until the tests that build plans with this family move
to the own forward, then deleted (issue 30).

first: bert.embeddings; blocks: bert.encoder.layer with the (bidirectional) attention mask built
from mb.attention_mask (None: no padding, no mask); last: bert.pooler, dropout, classifier. The
loss is the base class's sequence-classification loss.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ppdsl.runtime.stage.adapters.base import StageAdapter, divide_attrs
from ppdsl.core.hf_masks import build_mask

if TYPE_CHECKING:
    from ppdsl.runtime.stage.build import MicroBatch, StageModule


class BertStage(StageAdapter):
    prefix = "bert"  # the base model's attribute

    @staticmethod
    def attention_changes(module: nn.Module, tp: int) -> list[tuple[str, int, int]]:
        # reshapes with -1 heads, so 5.24 needs nothing; transformers 4.x reshaped the context
        # layer to all_head_size and head pruning reads both: made local.
        return divide_attrs(module, ("num_attention_heads", "all_head_size"), tp,
                            "attention heads/width", required=("num_attention_heads",))

    def embed(self, stage: StageModule, mb: MicroBatch) -> torch.Tensor:
        embeddings = stage.get_submodule(f"{self.prefix}.embeddings")
        # the offset of the positions: `cache_length` in 5.x, `past_key_values_length` in 4.x
        offset = "cache_length" if "cache_length" in inspect.signature(embeddings.forward).parameters \
            else "past_key_values_length"
        return embeddings(input_ids=mb.input_ids, position_ids=None, token_type_ids=mb.token_type_ids,
                          inputs_embeds=None, **{offset: 0})

    def context(self, stage: StageModule, hidden: torch.Tensor, mb: MicroBatch) -> Any:
        from transformers import masking_utils

        config = stage.config
        if not hasattr(masking_utils, "create_bidirectional_mask"):  # transformers 4.x: BertModel's extended mask
            mask = mb.attention_mask
            if mask is None:
                mask = torch.ones(hidden.shape[:2], device=hidden.device)
            return stage.shell.get_extended_attention_mask(mask, hidden.shape[:2])
        if config.is_decoder:
            return build_mask(masking_utils.create_causal_mask, config, hidden, mb.attention_mask, None)
        return masking_utils.create_bidirectional_mask(config=config, inputs_embeds=hidden,
                                                       attention_mask=mb.attention_mask)

    def run_block(self, stage: StageModule, block: nn.Module, hidden: torch.Tensor, ctx: Any) -> torch.Tensor:
        return block(hidden, attention_mask=ctx)

    def head(self, stage: StageModule, hidden: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        pooled = stage.get_submodule(f"{self.prefix}.pooler")(hidden)
        pooled = stage.get_submodule("dropout")(pooled)
        return stage.get_submodule("classifier")(pooled)
