"""What every data source gives the trainer, and what it is told: a replica's `Batch` of a step
(split into microbatches), the `DataSource` interface, which tensors a rank's stages read
(`Needs`), and the model facts the sources shape their batches by (task, vocabulary, labels,
image shape). The sources themselves and the order they read in are described in
`runtime.data.source`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from ppdsl.lowering.plan import ModelRef, Plan
from ppdsl.runtime.stage.module import MicroBatch

Task = Literal["causal_lm", "classification", "seq2seq"]


def task_of(model: ModelRef) -> Task:
    """What the data's labels are, by the plan's task: one class id per sample, the target
    sequence of a source, or the next tokens."""
    from ppdsl.core.task_loss import CLASSIFICATION_TASKS

    if model.task in CLASSIFICATION_TASKS:
        return "classification"
    return "seq2seq" if model.task == "seq2seq_lm" else "causal_lm"


def vocab_size_of(model: ModelRef) -> int:
    v = _vocab_or_none(model)
    if v is None:
        raise ValueError(f"model {model.target!r}: synthetic data needs vocab_size in its config")
    return v


def _vocab_or_none(model: ModelRef) -> int | None:
    vocab = model.dims_dict.get("vocab")  # check's: the spec's config over config.json over the HF defaults
    return int(vocab) if isinstance(vocab, int) else None


def num_labels_of(model: ModelRef) -> int:
    labels = model.dims_dict.get("labels")  # check's: num_labels, else id2label's length, else the HF default
    return int(labels) if isinstance(labels, int) else 2  # transformers' PretrainedConfig default


@dataclass(frozen=True)
class Needs:
    """What a rank's stages read from a microbatch (beyond the attention mask)."""

    inputs: bool = True  # input_ids and token_type_ids: the first stage
    labels: bool = True  # labels: the last stage


EVERYTHING = Needs()


def needs_of(plan: Plan, pp_rank: int | None) -> Needs:
    """The first stage's pipeline rank needs the inputs (every rank for the own forward), the last
    stage's the labels (under V placement both sit on pipeline rank 0). None: everything (the
    single-process reference)."""
    if pp_rank is None:
        return EVERYTHING
    # the model's own forward reads the tokens on every stage (a decoder classifier pools at the
    # last non-padding token; masks and positions come from them)
    inputs = plan.stages[0].rank == pp_rank or plan.own_forward is not None
    return Needs(inputs=inputs, labels=plan.stages[-1].rank == pp_rank)


@dataclass(frozen=True)
class Batch:
    """One data-parallel replica's batch for one step, before the split into microbatches."""

    input_ids: torch.Tensor  # [batch, seq] int64
    labels: torch.Tensor  # [batch, seq] (causal LM) or [batch] (classification), int64
    attention_mask: torch.Tensor | None  # [batch, seq] int64, 1 = real token
    token_type_ids: torch.Tensor | None
    # the number each microbatch's summed token losses are divided by: None, each microbatch's
    # mean (HF's convention); chat data: N / (microbatches * dp), N the global batch's counted
    # targets, so that the step's loss is the sum over the global batch over N (runtime.data.chat)
    token_divisor: float | None = None
    pixel_values: torch.Tensor | None = None  # [batch, C, H, W]: a model fed images (input_ids a placeholder)
    input_features: torch.Tensor | None = None  # a speech model's audio features (runtime.data.speech)
    # [batch, seq] int64: packing = "documents", each token's position in its document (restarting
    # at 0 after each EOS), from which the blocks' masks keep attention inside each document
    position_ids: torch.Tensor | None = None

    def split(self, microbatch_size: int) -> list[MicroBatch]:
        """Consecutive microbatches of `microbatch_size` sequences."""
        n = self.input_ids.shape[0]
        assert n % microbatch_size == 0, (n, microbatch_size)

        def part(t: torch.Tensor | None, i: int) -> torch.Tensor | None:
            return None if t is None else t[i : i + microbatch_size]

        extra = {} if self.token_divisor is None else {"token_divisor": self.token_divisor}
        return [
            MicroBatch(
                input_ids=part(self.input_ids, i),
                labels=part(self.labels, i),
                attention_mask=part(self.attention_mask, i),
                token_type_ids=part(self.token_type_ids, i),
                **extra,
                **({} if self.pixel_values is None else {"pixel_values": part(self.pixel_values, i)}),
                **({} if self.input_features is None else {"input_features": part(self.input_features, i)}),
                **({} if self.position_ids is None else {"position_ids": part(self.position_ids, i)}),
            )
            for i in range(0, n, microbatch_size)
        ]


def _placeholder(shape: tuple[int, ...], device: torch.device | str) -> torch.Tensor:
    """Zeros of `shape` that take no memory: what a rank gets for a tensor it does not use."""
    return torch.zeros((), dtype=torch.long, device=device).expand(shape)


# what a file source's ``read(items)`` gives, in this order (None where it has none): the
# interface `runtime.data.mix` mixes and holds out by, with ``count()``
READ_SLOTS = ("input_ids", "labels", "attention_mask", "position_ids", "pixel_values", "input_features")


class DataSource:
    """The interface the trainer uses: ``microbatches(step, dp_rank, device)``. A file
    source a mixture or holdout reads also has ``count()`` (its items) and ``read(items)`` (those
    items' tensors, `READ_SLOTS`)."""

    task: Task
    seq_len: int
    batch_size: int  # per data-parallel replica and step: microbatch_size * microbatches
    microbatch_size: int
    needs: Needs

    def batch(self, step: int, dp_rank: int, device: torch.device | str = "cpu") -> Batch:
        raise NotImplementedError

    def assemble_read(self, got: Sequence[torch.Tensor | None], device: torch.device | str) -> Batch:
        """The batch of what ``read(items)`` gives (`READ_SLOTS`, None where there is none), as
        this source's own ``batch`` would make it: a mixture or held-out side of it assembles its
        rows the way its first part does."""
        ids, labels, mask, positions, pixels = (*got, *[None] * len(READ_SLOTS))[:5]  # a source's read gives a prefix
        return self._assemble(ids, labels, mask, device, pixel_values=pixels, position_ids=positions)

    def microbatches(
        self, step: int, dp_rank: int, device: torch.device | str = "cpu"
    ) -> list[MicroBatch]:
        return self.batch(step, dp_rank, device).split(self.microbatch_size)

    def _assemble(
        self,
        input_ids: torch.Tensor | None,
        labels: torch.Tensor | None,
        mask: torch.Tensor | None,
        device: torch.device | str,
        pixel_values: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> Batch:
        """The batch this rank sees: placeholders for what its stages do not use (a model fed
        images: ``pixel_values``, its token ids a placeholder). Position ids, like the mask, are
        real on every rank: every stage's blocks build their masks from them."""
        shape = (self.batch_size, self.seq_len)
        label_shape = (self.batch_size,) if self.task == "classification" else shape
        inputs = input_ids.to(device) if self.needs.inputs and input_ids is not None else _placeholder(shape, device)
        out_labels = labels.to(device) if self.needs.labels and labels is not None else _placeholder(label_shape, device)
        token_types = None
        if self.task == "classification" and self.needs.inputs and pixel_values is None:
            token_types = torch.zeros(shape, dtype=torch.long, device=device)
        pixels = None
        if pixel_values is not None:
            pixels = pixel_values.to(device) if self.needs.inputs else \
                torch.zeros((), dtype=pixel_values.dtype, device=device).expand(pixel_values.shape)
        return Batch(inputs, out_labels, None if mask is None else mask.to(device), token_types, pixel_values=pixels,
                     position_ids=None if position_ids is None else position_ids.to(device))


def image_of(plan: Plan) -> tuple[int, ...]:
    """(C, H, W) of one image where the model is fed images (check's trace: OwnForward), else ()."""
    own = plan.own_forward
    return tuple(own.input_shape) if own is not None and own.inputs == "pixels" else ()



__all__: Sequence[str] = (
    "Batch", "DataSource", "EVERYTHING", "Needs", "READ_SLOTS", "Task",
    "image_of", "needs_of", "num_labels_of", "task_of", "vocab_size_of",
)
