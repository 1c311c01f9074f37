"""The torch half's base class: how one model family runs a slice ``first -> blocks -> last``.

A `StageModule` (runtime/stage/build.py) holds this rank's modules under their full-model paths; its
``forward(x, mb)`` is the same for every family:

    h = adapter.embed(stage, mb)            if the stage is the first, else the received x
    ctx = adapter.context(stage, h, mb)     what every block needs (masks, rotary cos/sin, ...)
    h = adapter.run_block(stage, block, h, ctx)   for each of the stage's blocks
    out = adapter.head(stage, h, mb)        if the stage is the last (logits)

and ``stage.loss(out, mb)`` calls ``adapter.loss``. Each family's ``stage.py`` mirrors the op sequence of
its transformers 5.24 ``forward`` exactly, so a chain of stages reproduces the reference
model's logits bit for bit on CPU. Adapters hold no state besides their family's descriptor:
one instance serves every stage. A family's ``attention_changes`` rewrites the head counts of
its attention class once its projections are split over tp (runtime/parallel/tp/attention.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ppdsl.runtime.stage.init import HFInitRule, InitRule, TorchDefaultInitRule

if TYPE_CHECKING:
    from ppdsl.lowering.plan import ModelRef, Plan
    from ppdsl.runtime.stage.build import MicroBatch, StageModule

from ppdsl.core import task_loss
from ppdsl.core.families.descriptor import Family
from ppdsl.core.phrasing import not_divisible_by_tp

__all__ = ["StageAdapter", "causal_lm_loss", "divide_attrs", "positions", "sequence_classification_loss",
           "shifted_causal_lm_loss"]

IGNORE_INDEX = task_loss.IGNORE_INDEX


class StageAdapter:
    """Base class; a family overrides the class attributes and the forward pieces.

    ``blocks``, ``first`` and ``last`` are the module paths the forward relies on, from the
    descriptor (None: take whatever the plan says).
    """

    # False: the layout comes from the plan alone (python factories)
    fixed_layout: bool = True
    # True: `run_stage` runs the model's own forward on the stage (family "own"), in place of the
    # embed / context / run_block / head pieces; the stage keeps the real intermediate modules
    own_forward: bool = False

    def __init__(self, family: Family) -> None:
        self.descriptor = family
        self.family = family.name
        self.blocks: str | None = family.blocks if self.fixed_layout else None
        self.first: tuple[str, ...] | None = family.first if self.fixed_layout else None
        self.last: tuple[str, ...] | None = family.last if self.fixed_layout else None

    @staticmethod
    def attention_changes(module: nn.Module, tp: int) -> list[tuple[str, int, int]]:
        """(attribute, global value, local value) for each head-count / width attribute of this
        family's attention ``module`` to rewrite once its projections are column-split over tp."""
        raise ValueError(f"{type(module).__name__} has no tensor-parallel rule")

    # ---- layout -----------------------------------------------------------------------------

    def check_layout(self, plan: Plan) -> None:
        """ValueError when the plan's block list or first / last modules are not the ones this
        adapter's forward runs (a plan for another family, or a hand-edited one)."""
        if self.fixed_layout:  # the descriptor's rule, which `ppdsl check` reports as E0402
            problem = self.descriptor.layout_problem(plan.blocks, plan.stages[0].first, plan.stages[-1].last)
            if problem is not None:
                raise ValueError(problem)
            return
        _check_modules(self.family, "first", self.first, plan.stages[0].first)
        _check_modules(self.family, "last", self.last, plan.stages[-1].last)

    def prepare(self, stage: StageModule, plan: Plan, skeleton: nn.Module) -> None:
        """Set up an assembled stage before it is materialised (the own forward's hooks)."""

    def run_stage(self, stage: StageModule, x: torch.Tensor | None, mb: MicroBatch) -> torch.Tensor:
        """The whole stage's forward, for adapters with ``own_forward``."""
        raise NotImplementedError

    def init_rule(self, model: nn.Module, ref: ModelRef) -> InitRule:
        """HF models: transformers' _init_weights semantics; python factories: torch defaults."""
        if ref.kind in ("hf", "hf_pretrained"):
            return HFInitRule(std=_hf_std(model))
        return TorchDefaultInitRule()

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
        if stage.task == "sequence_classification":
            return sequence_classification_loss(stage, output, mb.labels)
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


def positions(seq_len: int, device: torch.device, mb: MicroBatch | None = None) -> torch.Tensor:
    """HF's default position ids without a cache: arange(seq).unsqueeze(0); under context
    parallelism the global positions of the microbatch's tokens; packed documents
    (``packing = "documents"``) the microbatch's, restarting at each document, from which
    transformers' mask builders make the block-diagonal causal mask."""
    shard = None if mb is None else mb.sequence_shard
    if shard is not None:
        return shard.position_ids
    documents = None if mb is None else getattr(mb, "position_ids", None)
    if documents is not None:
        return documents
    return torch.arange(seq_len, device=device).unsqueeze(0)


def causal_lm_loss(stage: StageModule, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy, the way transformers' ForCausalLMLoss computes it
    (`ppdsl.core.task_loss`), so the loss equals ``model(..., labels=labels).loss`` bit for bit.
    With a vocab-split head (column split without gather) the logits are this rank's vocabulary
    slice."""
    return shifted_causal_lm_loss(stage, logits, task_loss.shifted_labels(labels))


def shifted_causal_lm_loss(stage: StageModule, logits: torch.Tensor, targets: torch.Tensor,
                           reduction: str = "mean") -> torch.Tensor:
    """Cross entropy of the logits against already shifted next-token `targets` (context
    parallelism shifts over the whole sequence before a rank takes its tokens): the mean, or per
    token (``reduction = "none"``)."""
    part = stage.head_partition
    if part is None:
        return task_loss.next_token_loss(logits, targets, reduction)
    from ppdsl.runtime.parallel.tp import vocab_parallel_cross_entropy

    return vocab_parallel_cross_entropy(logits, targets, stage.tp_group, part.start, part.end, IGNORE_INDEX,
                                        reduction=reduction)  # type: ignore[arg-type]


def sequence_classification_loss(stage: StageModule, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The loss of transformers' ...ForSequenceClassification heads (`ppdsl.core.task_loss`);
    a split classifier: vocab-parallel CE."""
    part = stage.head_partition
    if part is None:
        return task_loss.classification_loss(stage.config, output, labels)
    problem = task_loss.problem_type(stage.config, labels)
    if problem == "regression":
        raise ValueError("a regression head (num_labels = 1) cannot be split over tensor-parallel ranks")
    if problem == "single_label_classification":
        from ppdsl.runtime.parallel.tp import vocab_parallel_cross_entropy

        return vocab_parallel_cross_entropy(output, labels.view(-1), stage.tp_group, part.start, part.end)
    raise ValueError("multi-label classification with a split classifier is not supported")


def divide_attrs(module: nn.Module, names: tuple[str, ...], tp: int, what: str,
                 required: tuple[str, ...] = ()) -> list[tuple[str, int, int]]:
    """Divide each present attribute in `names` by tp (those in `required` must exist)."""
    changes = []
    for name in names:
        if not hasattr(module, name):
            if name in required:
                raise ValueError(f"{type(module).__name__} has no attribute {name!r}; "
                                 "unsupported transformers version?")
            continue
        value = int(getattr(module, name))
        if value % tp != 0:
            raise ValueError(
                not_divisible_by_tp(f"{type(module).__name__}.{name} = {value} ({what})", tp)
            )
        changes.append((name, value, value // tp))
    return changes
