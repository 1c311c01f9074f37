"""Training data: deterministic synthetic batches.

Every batch is a pure function of (seed, step, data-parallel rank), so each rank generates the
microbatches it needs by itself, without communication, and the single-process reference in
``verify`` generates exactly the same ones.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ppdsl.lowering.plan import ModelRef, Plan

Task = Literal["causal_lm", "classification"]

_MASK64 = (1 << 63) - 1


def task_of(model: ModelRef) -> Task:
    """What the labels are: next tokens (causal LM) or one class id per sequence."""
    config = model.config_dict
    if "ForSequenceClassification" in model.target:
        return "classification"
    if model.family == "bert" and "num_labels" in config:
        return "classification"
    return "causal_lm"


def vocab_size_of(model: ModelRef) -> int:
    config = model.config_dict
    if "vocab_size" not in config:
        raise ValueError(f"model {model.target!r}: synthetic data needs vocab_size in its config")
    return int(config["vocab_size"])


def num_labels_of(model: ModelRef) -> int:
    config = model.config_dict
    if "num_labels" in config:
        return int(config["num_labels"])
    if "id2label" in config:
        return len(config["id2label"])
    return 2  # transformers' PretrainedConfig default


@dataclass(frozen=True)
class Batch:
    """One data-parallel replica's batch for one step, before the split into microbatches."""

    input_ids: torch.Tensor  # [batch, seq] int64
    labels: torch.Tensor  # [batch, seq] (causal LM) or [batch] (classification), int64
    attention_mask: torch.Tensor | None  # [batch, seq] int64, 1 = real token
    token_type_ids: torch.Tensor | None

    def split(self, microbatch_size: int, factory: Callable[..., Any]) -> list[Any]:
        """Consecutive microbatches of `microbatch_size` sequences, built by `factory`
        (``runtime.stage.MicroBatch``)."""
        n = self.input_ids.shape[0]
        assert n % microbatch_size == 0, (n, microbatch_size)

        def part(t: torch.Tensor | None, i: int) -> torch.Tensor | None:
            return None if t is None else t[i : i + microbatch_size]

        return [
            factory(
                input_ids=part(self.input_ids, i),
                labels=part(self.labels, i),
                attention_mask=part(self.attention_mask, i),
                token_type_ids=part(self.token_type_ids, i),
            )
            for i in range(0, n, microbatch_size)
        ]


@dataclass(frozen=True)
class SyntheticData:
    """Random token ids (uniform over the vocabulary) with matching labels."""

    seed: int
    task: Task
    vocab_size: int
    num_labels: int
    seq_len: int
    batch_size: int  # per data-parallel replica and step: microbatch_size * microbatches
    microbatch_size: int
    padding: bool  # random right padding with an attention mask (encoder models)

    def batch(self, step: int, dp_rank: int, device: torch.device | str = "cpu") -> Batch:
        gen = torch.Generator().manual_seed(_mix(self.seed, step, dp_rank))
        shape = (self.batch_size, self.seq_len)
        input_ids = torch.randint(0, self.vocab_size, shape, generator=gen)
        mask = None
        if self.padding:
            lengths = torch.randint(max(1, self.seq_len // 2), self.seq_len + 1, (self.batch_size,), generator=gen)
            mask = (torch.arange(self.seq_len).unsqueeze(0) < lengths.unsqueeze(1)).long()
        if self.task == "classification":
            labels = torch.randint(0, self.num_labels, (self.batch_size,), generator=gen)
            token_types = torch.zeros(shape, dtype=torch.long)
        else:
            labels = input_ids.clone()
            token_types = None
        return Batch(
            input_ids=input_ids.to(device),
            labels=labels.to(device),
            attention_mask=None if mask is None else mask.to(device),
            token_type_ids=None if token_types is None else token_types.to(device),
        )

    def microbatches(
        self, step: int, dp_rank: int, device: torch.device | str = "cpu", factory: Callable[..., Any] | None = None
    ) -> list[Any]:
        if factory is None:
            from .stage import MicroBatch as factory  # noqa: N813
        return self.batch(step, dp_rank, device).split(self.microbatch_size, factory)


def synthetic(plan: Plan, seed: int | None = None) -> SyntheticData:
    """The synthetic data of `plan` (seed: the plan's data option, else its train seed)."""
    train = plan.train
    if seed is None:
        seed = int(train.data.options_dict.get("seed", train.seed))
    task = task_of(plan.model)
    return SyntheticData(
        seed=seed,
        task=task,
        vocab_size=vocab_size_of(plan.model),
        num_labels=num_labels_of(plan.model) if task == "classification" else 0,
        seq_len=train.seq_len,
        batch_size=train.microbatch_size * train.microbatches,
        microbatch_size=train.microbatch_size,
        padding=plan.model.family == "bert",
    )


def make_data(plan: Plan) -> SyntheticData:
    """The data source the plan names; ValueError for a kind the runtime does not know."""
    kind = plan.train.data.kind
    if kind != "synthetic":
        raise ValueError(f"data = {kind}(...) is not supported by the runtime yet; use synthetic(seed = N)")
    return synthetic(plan)


def _mix(*values: int) -> int:
    """A 63-bit seed from small integers (splitmix64 steps; stable across processes)."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (v & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
        h = h * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 29
    return h & _MASK64


__all__: Sequence[str] = ("Batch", "SyntheticData", "make_data", "synthetic", "task_of")
