"""Any python factory described as ``first modules -> blocks -> last modules`` (ppdsl's own
decoder included). HF classes no family claims never get here: run, verify and plan refuse them.

first stage: if the model defines ``embed(input_ids)`` (ppdsl.models.decoder.Decoder does) it
runs on the stage's part of the model; otherwise the first listed module embeds the tokens, every
further ``nn.Embedding`` among the first modules embeds the positions ``arange(seq)`` and is
added, and any other first module is applied in order. Blocks map one hidden tensor to another.
last stage: ``head(hidden)`` if the model defines it, else the last modules in order. The loss
is causal-LM cross entropy (labels shifted like transformers does).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ppdsl.runtime.stage.adapters.base import StageAdapter

if TYPE_CHECKING:
    from ppdsl.runtime.stage.build import MicroBatch, StageModule


class GenericStage(StageAdapter):
    fixed_layout = False

    def embed(self, stage: StageModule, mb: MicroBatch) -> torch.Tensor:
        embed = getattr(stage.shell, "embed", None)
        if callable(embed):
            return embed(mb.input_ids)
        modules = [stage.get_submodule(path) for path in stage.assignment.first]
        hidden = modules[0](mb.input_ids)
        position_ids = torch.arange(mb.input_ids.shape[-1], device=mb.input_ids.device)
        for module in modules[1:]:
            hidden = hidden + module(position_ids) if isinstance(module, nn.Embedding) else module(hidden)
        return hidden

    def head(self, stage: StageModule, hidden: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        head = getattr(stage.shell, "head", None)
        if callable(head):
            return head(hidden)
        for path in stage.assignment.last:
            hidden = stage.get_submodule(path)(hidden)
        return hidden
