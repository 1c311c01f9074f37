"""Synthetic data for an image-text model (`OwnForward.inputs = "image_text"`, LLaVA's): an image
and ``seq_len`` token ids per sample, the text depending on the image.

Each sample draws a class ``y`` of `CLASSES`; its image is class ``y``'s fixed random pattern
(drawn once from the seed) plus noise, as for image classifiers (`runtime.data`). Its ids are
the config's image token, as many times as check counted the image's features
(`ppdsl.core.model_inputs.image_text_shape`), then text: ``x[t+1] = (a * x[t] + b) % K`` with the
start and the rule ``(a, b)`` both class ``y``'s, over the first ``K`` text ids (the image token
left out). The first text token is known only from the image, the rest from the rule it picked,
so a small model's loss falls once it reads the image.

The labels are the ids, with -100 at the image tokens: the loss (the causal LM's, as HF's
``labels=`` loss of LLaVA) counts the text only, the first text token predicted from the last
image position. Every batch is a pure function of (seed, step), each replica its rows of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ppdsl.core.model_inputs import image_text_shape
from ppdsl.core.task_loss import IGNORE_INDEX
from ppdsl.lowering.plan import DataPlan, Plan
from .data import EVERYTHING, SYNTHETIC_ALPHABET, SYNTHETIC_IMAGE_NOISE, SYNTHETIC_RULES, Batch, DataSource, Needs, needs_of
from .rng import mix_seed

__all__ = ["CLASSES", "ImageTextData", "image_text_of", "image_text_source"]

CLASSES = 4  # image classes, each with its own text


@dataclass(frozen=True)
class ImageTextData(DataSource):
    """Images and the token ids that describe them (see the module docstring)."""

    seed: int
    seq_len: int
    batch_size: int
    microbatch_size: int
    vocab_size: int
    image: tuple[int, int, int]  # (C, H, W)
    image_tokens: int  # placeholders per sample, at its start
    image_token: int  # their id
    needs: Needs = EVERYTHING
    replicas: int = 1
    task = "causal_lm"

    def text_ids(self) -> torch.Tensor:
        """The ids the text is written in: the first `SYNTHETIC_ALPHABET` of the vocabulary but the image token."""
        ids = torch.arange(min(self.vocab_size, SYNTHETIC_ALPHABET + 1))
        return ids[ids != self.image_token][:SYNTHETIC_ALPHABET]

    def batch(self, step: int, dp_rank: int, device: torch.device | str = "cpu") -> Batch:
        gen = torch.Generator().manual_seed(mix_seed(self.seed, step, 0))
        n = self.batch_size * self.replicas
        rows = slice(dp_rank * self.batch_size, (dp_rank + 1) * self.batch_size)
        classes = torch.randint(0, CLASSES, (n,), generator=gen)
        patterns = torch.randn((CLASSES, *self.image), generator=torch.Generator().manual_seed(mix_seed(self.seed, 1)))
        images = patterns[classes] + SYNTHETIC_IMAGE_NOISE * torch.randn((n, *self.image), generator=gen)
        text = self.text_ids()[self._text(classes, len(self.text_ids()))]
        ids = torch.cat([torch.full((n, self.image_tokens), self.image_token, dtype=torch.long), text], dim=1)
        labels = ids.clone()
        labels[:, : self.image_tokens] = IGNORE_INDEX
        return self._assemble(ids[rows], labels[rows], None, device, images[rows])

    def _text(self, classes: torch.Tensor, k: int) -> torch.Tensor:
        """Indices into the text ids: class ``y``'s start and rule."""
        length = self.seq_len - self.image_tokens
        rules = [(a if math.gcd(a, k) == 1 else 1, b % k) for a, b in SYNTHETIC_RULES]
        a = torch.tensor([rules[int(y) % len(rules)][0] for y in classes])
        b = torch.tensor([rules[int(y) % len(rules)][1] for y in classes])
        out = torch.empty((classes.numel(), length), dtype=torch.long)
        out[:, 0] = (classes * (k // CLASSES)) % k
        for t in range(1, length):
            out[:, t] = (a * out[:, t - 1] + b) % k
        return out


def image_text_of(plan: Plan) -> tuple[tuple[int, int, int], int, int] | None:
    """((C, H, W), image tokens, their id) of an image-text model (check's trace), else None."""
    own = plan.own_forward
    return image_text_shape(tuple(own.input_shape)) if own is not None and own.inputs == "image_text" else None


def image_text_source(plan: Plan, pp_rank: int | None, data: DataPlan, seed: int) -> DataSource:
    """The data of an image-text model: synthetic only (check refuses the rest, E0476)."""
    found = image_text_of(plan)
    assert found is not None
    if data.kind != "synthetic":
        raise ValueError(f"data = {data.kind}(...) gives no image-text pairs; model {plan.model.target!r} takes images "
                         "and token ids: use synthetic(...)")
    image, tokens, token = found
    train = plan.train
    return ImageTextData(seed=seed, seq_len=train.seq_len, batch_size=train.microbatch_size * train.microbatches,
                         microbatch_size=train.microbatch_size, vocab_size=_text_vocab(plan), image=image,
                         image_tokens=tokens, image_token=token, needs=needs_of(plan, pp_rank),
                         replicas=train.global_batch // (train.microbatch_size * train.microbatches))


def _text_vocab(plan: Plan) -> int:
    """The language model's vocabulary as the spec writes it (``text_config { vocab_size }``, or
    the config's own), else the class default's, which is larger than the text's alphabet."""
    config = plan.model.config_dict
    for where in (config.get("text_config"), config):
        if isinstance(where, dict) and isinstance(where.get("vocab_size"), int):
            return int(where["vocab_size"])
    vocab = plan.model.dims_dict.get("vocab")
    return int(vocab) if isinstance(vocab, int) else SYNTHETIC_ALPHABET + 1
