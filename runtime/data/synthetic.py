"""Synthetic training data (``synthetic(seed)``): generated, and learnable, so a short run shows
the loss falling; each step's global batch a pure function of (seed, step).

Causal LM: each sequence follows ``x[t+1] = (a * x[t] + b) % K`` from a random start, with
``(a, b)`` one of two fixed rules chosen per sequence, over the first ``K = min(vocab_size, 64)``
ids (specs/tiny_cpu.ppspec: from 5.0 to about 0.6 in its 40 steps). An encoder-decoder model (the
plan's task `seq2seq_lm`): the same sources, and each target (the labels) is its source reversed,
which the decoder learns only through the encoder. Classification: a class ``y`` is drawn per
sequence and half of its tokens come from class ``y``'s ids (``id % num_labels == y``), the rest
uniformly; the label is ``y``. A model fed images (`OwnForward.inputs = "pixels"`): a class ``y``
per image, whose pixels are class ``y``'s fixed random pattern (drawn once from the seed) plus
unit noise of half its scale; the token ids are then a placeholder. See `runtime.data.source`
for every source.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ppdsl.core.families import by_name
from ppdsl.lowering.plan import Plan
from ppdsl.runtime.data.batch import (
    EVERYTHING, Batch, DataSource, Needs, Task, image_of, needs_of, num_labels_of, task_of, vocab_size_of,
)
from ppdsl.runtime.parallel.rng import mix_seed

SYNTHETIC_ALPHABET = 64  # synthetic tokens use ids below min(vocab_size, this)
SYNTHETIC_RULES = ((1, 1), (3, 7))  # (a, b) of x[t+1] = (a * x[t] + b) % K
SYNTHETIC_IMAGE_NOISE = 0.5  # images: each class's pattern plus this much unit noise


def synthetic_rules(k: int) -> list[tuple[int, int]]:
    """`SYNTHETIC_RULES` over an alphabet of `k` ids (a multiplier that is not coprime to `k` is 1)."""
    return [(a if math.gcd(a, k) == 1 else 1, c % k) for a, c in SYNTHETIC_RULES]


def rule_tokens(b: int, s: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """`b` sequences of `s` ids below `k`, each following one of `synthetic_rules(k)` (drawn per
    sequence) from a random start: the causal-LM samples, and a speech model's targets."""
    rules = synthetic_rules(k)
    which = torch.randint(0, len(rules), (b,), generator=gen)
    a = torch.tensor([r[0] for r in rules])[which]
    c = torch.tensor([r[1] for r in rules])[which]
    out = torch.empty((b, s), dtype=torch.long)
    out[:, 0] = torch.randint(0, k, (b,), generator=gen)
    for t in range(1, s):
        out[:, t] = (a * out[:, t - 1] + c) % k
    return out


@dataclass(frozen=True)
class SyntheticData(DataSource):
    """Generated sequences a small model can learn (see the module docstring)."""

    seed: int
    task: Task
    vocab_size: int
    num_labels: int
    seq_len: int
    batch_size: int
    microbatch_size: int
    padding: bool  # random right padding with an attention mask (encoder models)
    needs: Needs = EVERYTHING
    replicas: int = 1  # data-parallel replicas: the global batch is batch_size * replicas
    image: tuple[int, ...] = ()  # a model fed images: (C, H, W) of one (OwnForward.input_shape)

    @property
    def alphabet(self) -> int:
        return max(1, min(self.vocab_size, SYNTHETIC_ALPHABET))

    def batch(self, step: int, dp_rank: int, device: torch.device | str = "cpu") -> Batch:
        # the step's whole global batch from one generator, this replica's rows of it: the samples
        # do not depend on how many replicas share them (a run resumed at another dp sees the same)
        gen = torch.Generator().manual_seed(mix_seed(self.seed, step, 0))
        n, s = self.batch_size * self.replicas, self.seq_len
        rows = slice(dp_rank * self.batch_size, (dp_rank + 1) * self.batch_size)
        if self.image:
            labels = torch.randint(0, max(1, self.num_labels), (n,), generator=gen)
            images = self._images(labels, gen)
            return self._assemble(None, labels[rows], None, device, images[rows])
        if self.task == "classification":
            labels = torch.randint(0, max(1, self.num_labels), (n,), generator=gen)
            input_ids = self._class_tokens(labels, gen)
        else:
            input_ids = rule_tokens(n, self.seq_len, self.alphabet, gen)
            # seq2seq: the target is the source reversed (the decoder must read the encoder)
            labels = input_ids.flip(-1) if self.task == "seq2seq" else input_ids.clone()
        mask = None
        if self.padding:
            lengths = torch.randint(max(1, s // 2), s + 1, (n,), generator=gen)
            mask = (torch.arange(s).unsqueeze(0) < lengths.unsqueeze(1)).long()
        return self._assemble(input_ids[rows], labels[rows], None if mask is None else mask[rows], device)

    def _images(self, labels: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        """Class ``y``'s fixed pattern (drawn once from the seed, the same at every step) plus
        noise of half its scale: float32 images a small model tells apart within tens of steps."""
        patterns = torch.randn((max(1, self.num_labels), *self.image),
                               generator=torch.Generator().manual_seed(mix_seed(self.seed, 1)))
        noise = torch.randn((labels.numel(), *self.image), generator=gen)
        return patterns[labels] + SYNTHETIC_IMAGE_NOISE * noise

    def _class_tokens(self, labels: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        b, s = labels.numel(), self.seq_len
        n = max(1, self.num_labels)
        k = max(self.alphabet, min(self.vocab_size, n))
        per_class = max(1, k // n)
        uniform = torch.randint(0, k, (b, s), generator=gen)
        marked = torch.randint(0, per_class, (b, s), generator=gen) * n + labels.unsqueeze(1)
        pick = torch.rand((b, s), generator=gen) < 0.5
        pick[:, 0] = True  # the first token (where BERT's pooler reads) always shows the class
        return torch.where(pick, marked.clamp(max=self.vocab_size - 1), uniform)


def synthetic(plan: Plan, seed: int | None = None, pp_rank: int | None = None) -> SyntheticData:
    """The synthetic data of `plan` (seed: the plan's data option, else its train seed)."""
    train = plan.train
    if seed is None:
        seed = train.data.options_dict.get("seed")  # resolve fills it in; a hand-made plan may not
        seed = train.seed if seed is None else int(seed)
    image = image_of(plan)
    task = task_of(plan.model)
    return SyntheticData(
        replicas=train.global_batch // plan.replica_batch,
        seed=seed,
        task=task,
        vocab_size=0 if image else vocab_size_of(plan.model),
        num_labels=num_labels_of(plan.model) if task == "classification" else 0,
        seq_len=train.seq_len,
        batch_size=plan.replica_batch,
        microbatch_size=train.microbatch_size,
        padding=by_name(plan.model.family).synthetic_padding and task == "classification" and not image,
        needs=needs_of(plan, pp_rank),
        image=image,
    )



__all__: Sequence[str] = (
    "SYNTHETIC_ALPHABET", "SYNTHETIC_IMAGE_NOISE", "SYNTHETIC_RULES", "SyntheticData", "rule_tokens", "synthetic",
    "synthetic_rules",
)
