"""Data for an image-text model (`OwnForward.inputs = "image_text"`, LLaVA's): an image and
``seq_len`` token ids per sample, the first of them the image's placeholders.

``image_text_folder(path, tokenizer, processor)``: ``path/captions.jsonl`` lines ``{"image":
"a.png", "text": "..."}`` (`ppdsl.core.image_folder.read_captions`). Each caption is tokenized
with the tokenizer's special tokens, once, at first use, and cut to the ``seq_len`` minus the
image tokens that follow the placeholders; shorter ones are padded with the tokenizer's pad id.
The labels are the ids with -100 at the placeholders and the padding: the loss counts the
caption only, as HF's ``labels=`` loss of LLaVA does. An image is decoded with Pillow and made
the model's ``pixel_values`` by the image processor (`runtime.data.images.image_processor`: a
saved one in ``processor``, else the model's default at its image size), per batch, only on the
rank that runs the vision tower (the first stage's). Sample ``g`` of the run is line
``perm_e[g % n]`` of epoch ``e = g // n`` (`runtime.data.order._Order`), as for every file source.

``synthetic(seed)``:
Each sample draws a class ``y`` of `CLASSES`; its image is class ``y``'s fixed random pattern
(drawn once from the seed) plus noise, as for image classifiers (`runtime.data.synthetic`). Its ids are
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

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from ppdsl.core.model_inputs import image_text_shape
from ppdsl.core.task_loss import IGNORE_INDEX
from ppdsl.lowering.plan import DataPlan, Plan
from ppdsl.runtime.data.batch import EVERYTHING, Batch, DataSource, Needs, needs_of
from ppdsl.runtime.data.synthetic import SYNTHETIC_ALPHABET, SYNTHETIC_IMAGE_NOISE, synthetic_rules
from ppdsl.runtime.parallel.rng import mix_seed

__all__ = ["CLASSES", "CaptionedImages", "ImageTextData", "image_text_of", "image_text_source"]

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
        rules = synthetic_rules(k)
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


@dataclass
class CaptionedImages(DataSource):
    """Images and their captions from an image-text folder (see the module docstring)."""

    path: str
    tokenizer: str
    processor: str | None
    model: Any  # the plan's ModelRef: the default image processor is the model's
    seed: int
    seq_len: int
    batch_size: int
    microbatch_size: int
    vocab_size: int
    image: tuple[int, int, int]
    image_tokens: int
    image_token: int
    images: bool  # this rank runs the vision tower: it decodes the images
    needs: Needs = EVERYTHING
    replicas: int = 1
    task = "causal_lm"
    _pairs: Any = field(default=None, repr=False)
    _ids: Any = field(default=None, repr=False)
    _labels: Any = field(default=None, repr=False)
    _order: Any = field(default=None, repr=False)
    _process: Any = field(default=None, repr=False)

    def rows(self) -> torch.Tensor:
        """Every caption's ids after the placeholders, read and tokenized on first use;
        ValueError (naming the file and line) for what the run cannot train on."""
        if self._ids is None:
            from ppdsl.core.image_folder import CAPTIONS, read_captions

            from ppdsl.runtime.data.order import _Order
            from ppdsl.runtime.data.tokenizer import _Tokenizer

            pairs = read_captions(self.path)
            if len(pairs) < self.batch_size * self.replicas:
                raise ValueError(f"image-text folder {self.path} holds {len(pairs)} captioned images, fewer than one "
                                 f"global batch (global_batch = {self.batch_size * self.replicas})")
            tokenizer = _Tokenizer(self.tokenizer)
            pad = tokenizer.pad_id
            if pad == self.image_token:
                raise ValueError(f"the tokenizer in {self.tokenizer} pads with id {pad}, the model's image_token_id: "
                                 "the padding would be taken for image places")
            length = self.seq_len - self.image_tokens
            ids = torch.full((len(pairs), self.seq_len), pad, dtype=torch.long)
            ids[:, : self.image_tokens] = self.image_token
            labels = torch.full((len(pairs), self.seq_len), IGNORE_INDEX, dtype=torch.long)
            for r, (pair, text) in enumerate(zip(pairs, tokenizer.encode([p.text for p in pairs], special=True))):
                bad = next((t for t in text if not 0 <= t < self.vocab_size or t == self.image_token), None)
                if bad is not None:
                    what = "the model's image_token_id" if bad == self.image_token else \
                        f"outside the language model's vocabulary (vocab_size = {self.vocab_size})"
                    raise ValueError(f"{os.path.join(self.path, CAPTIONS)}:{pair.line}: the tokenizer in "
                                     f"{self.tokenizer} gives the caption id {bad}, {what}")
                kept = torch.tensor(text[:length], dtype=torch.long)
                ids[r, self.image_tokens : self.image_tokens + len(kept)] = kept
                labels[r, self.image_tokens : self.image_tokens + len(kept)] = kept
            self._pairs, self._ids, self._labels = pairs, ids, labels
            self._order = _Order(len(pairs), self.seed)
        return self._ids

    @property
    def dp(self) -> int:
        return self.replicas

    def count(self) -> int:
        return len(self.rows())

    def batch(self, step: int, dp_rank: int, device: torch.device | str = "cpu") -> Batch:
        self.rows()
        start = step * self.batch_size * self.replicas + dp_rank * self.batch_size
        ids, labels, _, _, pixels = self.read(self._order.items(range(start, start + self.batch_size)))
        return self._assemble(ids, labels, None, device, pixels)

    def read(self, picked: list[int]) -> tuple[torch.Tensor, torch.Tensor, None, None, torch.Tensor]:
        """Captioned images `picked`: the image tokens then the caption's ids, their labels, and
        the pixel values (`runtime.data.batch.READ_SLOTS`; decoded only on the ranks that run the
        vision tower, zeros of their shape elsewhere)."""
        ids = self.rows()
        pixels = torch.zeros(()).expand(len(picked), *self.image)
        if self.images and self.needs.inputs:
            from ppdsl.core.image_folder import open_captioned
            from ppdsl.core.media_pairs import MediaError

            from ppdsl.runtime.data.images import image_processor

            if self._process is None:
                self._process = image_processor(self.processor, self.model, self.image)
            try:
                pixels = self._process([open_captioned(self._pairs[i], self.image[0]) for i in picked])
            except MediaError as exc:
                raise ValueError(f"image-text folder {self.path}: image {exc.path}: {exc.why}") from None
        return ids[picked], self._labels[picked], None, None, pixels


def image_text_source(plan: Plan, pp_rank: int | None, data: DataPlan, seed: int) -> DataSource:
    """The data of an image-text model: synthetic, or an image-text folder (check refuses the
    rest, E0476)."""
    found = image_text_of(plan)
    assert found is not None
    image, tokens, token = found
    train = plan.train
    common = dict(seed=seed, seq_len=train.seq_len, batch_size=plan.replica_batch,
                  microbatch_size=train.microbatch_size, vocab_size=_text_vocab(plan), image=image,
                  image_tokens=tokens, image_token=token, needs=needs_of(plan, pp_rank),
                  replicas=train.global_batch // plan.replica_batch)
    if data.kind == "synthetic":
        return ImageTextData(**common)  # type: ignore[arg-type]
    if data.kind == "image_text_folder":
        opts = data.options_dict
        return CaptionedImages(path=os.fspath(opts["path"]), tokenizer=opts["tokenizer"], processor=opts.get("processor"),
                               model=plan.model, images=pp_rank is None or plan.stages[0].rank == pp_rank,
                               **common)  # type: ignore[arg-type]
    raise ValueError(f"data = {data.kind}(...) gives no image-text pairs; model {plan.model.target!r} takes images "
                     "and token ids: use image_text_folder(...) or synthetic(...)")


def _text_vocab(plan: Plan) -> int:
    """The language model's vocabulary as the spec writes it (``text_config { vocab_size }``, or
    the config's own), else the class default's, which is larger than the text's alphabet."""
    config = plan.model.config_dict
    for where in (config.get("text_config"), config):
        if isinstance(where, dict) and isinstance(where.get("vocab_size"), int):
            return int(where["vocab_size"])
    vocab = plan.model.dims_dict.get("vocab")
    return int(vocab) if isinstance(vocab, int) else SYNTHETIC_ALPHABET + 1
