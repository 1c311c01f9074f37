"""RobertaForSequenceClassification stages, mirroring transformers 5.24 RobertaModel.forward
(add_pooling_layer=False) and RobertaForSequenceClassification.forward.

Reproduced by the own forward at pp 2 x tp 2, sequence parallelism included
(benchmarks/own_forward_vs_families.py); kept until the tests that build plans with this family move
to the own forward, then deleted (issue 30).

first: roberta.embeddings, which derive the position ids from the input ids (padding_idx + 1
onwards, padding_idx at padding tokens) when given None, as RobertaModel passes them; blocks:
roberta.encoder.layer with the bidirectional mask; last: classifier (RobertaClassificationHead:
first token, dense, tanh, out_proj), whose out_proj is the head a tp split applies to.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..bert.stage import BertStage

if TYPE_CHECKING:
    from ppdsl.runtime.stage import MicroBatch, StageModule


class RobertaStage(BertStage):
    prefix = "roberta"
    head_module = "classifier.out_proj"

    def head(self, stage: StageModule, hidden: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        return stage.get_submodule("classifier")(hidden)
