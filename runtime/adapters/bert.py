"""BertForSequenceClassification stages, mirroring transformers 5.24 BertModel.forward and
BertForSequenceClassification.forward.

first: bert.embeddings; blocks: bert.encoder.layer with the (bidirectional) attention mask built
from mb.attention_mask (None: no padding, no mask); last: bert.pooler, dropout, classifier.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from . import StageAdapter

if TYPE_CHECKING:
    from ppdsl.runtime.stage import MicroBatch, StageModule


class BertAdapter(StageAdapter):
    family = "bert"
    blocks = "bert.encoder.layer"
    first = ("bert.embeddings",)
    last = ("bert.pooler", "classifier")
    head_module = "classifier"

    def embed(self, stage: StageModule, mb: MicroBatch) -> torch.Tensor:
        embeddings = stage.get_submodule("bert.embeddings")
        return embeddings(
            input_ids=mb.input_ids,
            position_ids=None,
            token_type_ids=mb.token_type_ids,
            inputs_embeds=None,
            cache_length=0,
        )

    def context(self, stage: StageModule, hidden: torch.Tensor, mb: MicroBatch) -> Any:
        from transformers.masking_utils import create_bidirectional_mask, create_causal_mask

        config = stage.config
        if config.is_decoder:
            return create_causal_mask(config=config, inputs_embeds=hidden, attention_mask=mb.attention_mask, cache=None)
        return create_bidirectional_mask(config=config, inputs_embeds=hidden, attention_mask=mb.attention_mask)

    def run_block(self, stage: StageModule, block: nn.Module, hidden: torch.Tensor, ctx: Any) -> torch.Tensor:
        return block(hidden, ctx, None, encoder_attention_mask=None, cache=None, position_ids=None)

    def head(self, stage: StageModule, hidden: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        pooled = stage.get_submodule("bert.pooler")(hidden)
        pooled = stage.get_submodule("dropout")(pooled)
        return stage.get_submodule("classifier")(pooled)

    def loss(self, stage: StageModule, output: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        labels = mb.labels
        problem = _problem_type(stage.config, labels)
        if problem == "regression":
            if stage.head_partition is not None:
                raise ValueError("a regression head (num_labels = 1) cannot be split over tensor-parallel ranks")
            if stage.config.num_labels == 1:
                return F.mse_loss(output.squeeze(), labels.squeeze())
            return F.mse_loss(output, labels)
        if problem == "single_label_classification":
            part = stage.head_partition
            if part is None:
                return F.cross_entropy(output.view(-1, output.size(-1)), labels.view(-1))
            from ppdsl.runtime.tp import vocab_parallel_cross_entropy

            return vocab_parallel_cross_entropy(output, labels.view(-1), stage.tp_group, part.start, part.end)
        if stage.head_partition is not None:
            raise ValueError("multi-label classification with a split classifier is not supported")
        return F.binary_cross_entropy_with_logits(output, labels)


def _problem_type(config: Any, labels: torch.Tensor) -> str:
    # BertForSequenceClassification infers it on the first call (and writes it into the config);
    # here it is inferred without mutating the shared config.
    if config.problem_type is not None:
        return str(config.problem_type)
    if config.num_labels == 1:
        return "regression"
    if labels.dtype in (torch.long, torch.int):
        return "single_label_classification"
    return "multi_label_classification"
