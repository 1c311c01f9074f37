"""Stage forward adapters: how one model family runs a slice ``first -> blocks -> last``.

A `StageModule` (runtime/stage.py) holds this rank's modules under their full-model paths; its
``forward(x, mb)`` is the same for every family:

    h = adapter.embed(stage, mb)            if the stage is the first, else the received x
    ctx = adapter.context(stage, h, mb)     what every block needs (masks, rotary cos/sin, ...)
    h = adapter.run_block(stage, block, h, ctx)   for each of the stage's blocks
    out = adapter.head(stage, h, mb)        if the stage is the last (logits)

and ``stage.loss(out, mb)`` calls ``adapter.loss``. Each family file mirrors the op sequence of
its transformers 5.24 ``forward`` exactly, so a chain of stages reproduces the reference
model's logits bit for bit on CPU. Adapters hold no state: one instance serves every stage.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from ppdsl.runtime.init import HFInitRule, InitRule, TorchDefaultInitRule

if TYPE_CHECKING:
    from ppdsl.lowering.plan import ModelRef, Plan
    from ppdsl.runtime.stage import MicroBatch, StageModule

__all__ = ["FAMILIES", "StageAdapter", "causal_lm_loss", "get_adapter", "positions"]

FAMILIES = ("gpt2", "bert", "llama", "generic")
IGNORE_INDEX = -100


class StageAdapter:
    """Base class; a family overrides the class attributes and the forward pieces.

    ``blocks``, ``first`` and ``last`` are the module paths the forward relies on (None: take
    whatever the plan says); ``head`` is the output projection whose tensor-parallel split
    decides between a plain and a vocab-parallel loss.
    """

    family: str = ""
    blocks: str | None = None
    first: tuple[str, ...] | None = None
    last: tuple[str, ...] | None = None
    head_module: str | None = None

    # ---- layout -----------------------------------------------------------------------------

    def check_layout(self, plan: Plan) -> None:
        """ValueError when the plan's block list or first / last modules are not the ones this
        adapter's forward runs (a plan for another family, or a hand-edited one)."""
        if self.blocks is not None and plan.blocks != self.blocks:
            raise ValueError(
                f"{self.family} stages run the blocks '{self.blocks}', but the plan cuts '{plan.blocks}'"
            )
        _check_modules(self.family, "first", self.first, plan.stages[0].first)
        _check_modules(self.family, "last", self.last, plan.stages[-1].last)

    def head_path(self, plan: Plan) -> str:
        return self.head_module if self.head_module is not None else plan.stages[-1].last[-1]

    def init_rule(self, model: nn.Module, ref: ModelRef) -> InitRule:
        """HF models: transformers' _init_weights semantics; python factories: torch defaults."""
        if ref.kind in ("hf", "hf_pretrained"):
            return HFInitRule(std=_hf_std(model))
        return TorchDefaultInitRule()

    def hidden_size(self, model: nn.Module, plan: Plan) -> int:
        config = getattr(model, "config", None)
        if config is not None and getattr(config, "hidden_size", None):
            return int(config.hidden_size)
        first = model.get_submodule(plan.stages[0].first[0])
        if isinstance(first, nn.Embedding):
            return first.embedding_dim
        raise ValueError(
            f"cannot tell the hidden size of {type(model).__name__}: no config.hidden_size and "
            f"'{plan.stages[0].first[0]}' is not an nn.Embedding"
        )

    # ---- forward pieces ---------------------------------------------------------------------

    def embed(self, stage: StageModule, mb: MicroBatch) -> torch.Tensor:
        raise NotImplementedError

    def context(self, stage: StageModule, hidden: torch.Tensor, mb: MicroBatch) -> Any:
        return None

    def run_block(self, stage: StageModule, block: nn.Module, hidden: torch.Tensor, ctx: Any) -> torch.Tensor:
        return block(hidden)

    def head(self, stage: StageModule, hidden: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        raise NotImplementedError

    def loss(self, stage: StageModule, output: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        return causal_lm_loss(stage, output, mb.labels)


def _check_modules(family: str, where: str, expected: tuple[str, ...] | None, got: tuple[str, ...]) -> None:
    if expected is None:
        if not got:
            raise ValueError(f"{family} stages need at least one '{where}' module")
        return
    if set(got) != set(expected):
        raise ValueError(
            f"{family} stages run {', '.join(expected)} as the '{where}' modules, "
            f"but the plan lists {', '.join(got) or 'none'}"
        )


def _hf_std(model: nn.Module) -> float:
    config = getattr(model, "config", None)
    # PreTrainedModel._init_weights: `initializer_range or 0.02`
    return float(getattr(config, "initializer_range", None) or 0.02)


def positions(seq_len: int, device: torch.device) -> torch.Tensor:
    """HF's default position ids without a cache: arange(seq).unsqueeze(0)."""
    return torch.arange(seq_len, device=device).unsqueeze(0)


def causal_lm_loss(stage: StageModule, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy, the way transformers' ForCausalLMLoss computes it (labels
    padded with -100 and shifted left, logits upcast to fp32, all positions flattened), so the
    loss equals ``model(..., labels=labels).loss`` bit for bit. With a vocab-split head (column
    split without gather) the logits are this rank's vocabulary slice."""
    logits = logits.float()
    shifted = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].contiguous()
    part = stage.head_partition
    if part is None:
        return F.cross_entropy(logits.view(-1, logits.size(-1)), shifted.view(-1), ignore_index=IGNORE_INDEX)
    from ppdsl.runtime.tp import vocab_parallel_cross_entropy

    return vocab_parallel_cross_entropy(logits, shifted, stage.tp_group, part.start, part.end, IGNORE_INDEX)


def get_adapter(family: str) -> StageAdapter:
    """The adapter for a plan's ``model.family``."""
    if family == "gpt2":
        from .gpt2 import GPT2Adapter

        return GPT2Adapter()
    if family == "bert":
        from .bert import BertAdapter

        return BertAdapter()
    if family == "llama":
        from .llama import LlamaAdapter

        return LlamaAdapter()
    if family == "generic":
        from .generic import GenericAdapter

        return GenericAdapter()
    raise ValueError(f"unknown model family '{family}'; expected one of {', '.join(FAMILIES)}")
