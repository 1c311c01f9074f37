"""Training data: the sources of `train.data`, read deterministically by every replica.

Every batch is a pure function of (seed, step, data-parallel rank), and a step's global batch of
(seed, step) alone (the replicas take consecutive rows of it): each rank reads or generates
the microbatches it needs by itself, without communication, and the single-process reference in
``verify`` reads exactly the same ones. The sources:

- ``synthetic(seed)``: generated, and learnable, so a short run shows the loss falling. Causal
  LM: each sequence follows ``x[t+1] = (a * x[t] + b) % K`` from a random start, with ``(a, b)``
  one of two fixed rules chosen per sequence, over the first ``K = min(vocab_size, 64)`` ids
  (specs/tiny_cpu.ppspec: from 5.0 to about 0.6 in its 40 steps). An encoder-decoder model
  (the plan's task `seq2seq_lm`): the same sources, and each target (the labels) is its
  source reversed, which the decoder learns only through the encoder.
  Classification: a class ``y`` is drawn per sequence and half of its tokens come from class
  ``y``'s ids (``id % num_labels == y``), the rest uniformly; the label is ``y``, the class whose
  ids are over-represented. A model fed images (`OwnForward.inputs = "pixels"`): a class ``y``
  per image, whose pixels are class ``y``'s fixed random pattern (drawn once from the seed) plus
  unit noise of half its scale; the token ids are then a placeholder.
- ``tokens(path, dtype)``: a flat binary (nanoGPT's ``train.bin``) or a ``.npy`` of uint16 /
  uint32 token ids, memory-mapped. It is cut into ``len // seq_len`` non-overlapping windows of
  ``seq_len`` tokens; labels are the inputs (the adapters shift them).
- ``text(path, tokenizer)``: a UTF-8 corpus, tokenized once (streamed, into the token cache of
  `runtime.data.cache`, memory-mapped by every rank) with the tokenizer of a local directory,
  then cut into windows like a token file.
- ``jsonl(path, tokenizer, text, label)`` / ``csv(...)``: classification examples, each text
  tokenized (with the tokenizer's special tokens), truncated and right-padded to ``seq_len``,
  with an attention mask and the integer label.
- ``hf_dataset(path, tokenizer, split, text, label, packing)``: rows of a Parquet or Arrow file
  (or a glob of shards, or a folder of them), a ``datasets`` save_to_disk directory, JSON
  lines or CSV (`ppdsl.core.tables`). For a classifier, examples as ``jsonl``'s; for a causal LM,
  documents, packed into windows with the tokenizer's EOS between them or padded one per sample
  (`runtime.data.docs`).
- ``hf_dataset(path, tokenizer, split, text, target)`` on an encoder-decoder model: source/target
  pairs, one padded sample per row (`runtime.data.pairs`).
- an image-text model (`OwnForward.inputs = "image_text"`, LLaVA): synthetic images and the text
  that depends on them, the loss on the text only (`runtime.data.image_text`).
- ``image_folder(path, processor, split)``: a model fed images: the images of a folder with one
  sub-folder per class, decoded per batch and processed to ``pixel_values`` (`runtime.data.images`).
- A speech model (Whisper): ``synthetic`` audio features that spell their targets, or
  ``audio_folder(path, tokenizer, processor)``: wav files and their transcripts (`runtime.data.speech`).

Order of file data: global sample position ``g = step * global_batch + dp_rank * batch + i``
takes item ``perm_e[g % n]`` of epoch ``e = g // n``, where ``perm_e`` is a permutation of the
``n`` windows (or examples) seeded by (seed, e). Replica ``dp_rank`` takes its contiguous slice
of the global batch, so the replicas of one step read disjoint items, every item is read once
per epoch, and the global batch does not depend on how it is split over replicas.

Only the ranks that need inputs or labels read them: ``make_data(plan, pp_rank=r)`` gives the
first pipeline stage's ranks the input ids and the last stage's ranks the labels; other tensors
are zero placeholders of the right shape (expanded, no memory). A pipeline rank that holds
neither stage never opens a token file. The attention mask is real on every rank, because every
block uses it: for jsonl / csv data every rank therefore reads the examples (to know their
lengths). ``make_data(plan)`` without ``pp_rank`` (the reference) reads everything.

Errors: a file that is missing, malformed or too short raises a ValueError naming it (the
launcher turns ValueError into exit status 2) when the source is built or first read, never a
hang: a path that is not a regular file (a FIFO) is refused before it is opened.

A file changed during the run: jsonl and csv files are read whole on first use and text
corpora and documents are tokenized into the cache then, so a later change or removal does not
reach the run (the next start tokenizes the new contents). A token file is memory-mapped: each step first
checks it (one fstat of a descriptor kept open): a file that shrank (truncated) raises a
`runtime.run.failure.RunFault` naming it (exit 1), before a read past its new end would kill the
process with SIGBUS; a removed file (the mapping keeps its data) or one rewritten in place gets
one warning line. A checkpoint records each data file's size and a digest of its first and last
MiB (`data_identity.data_file_identities`); a resume whose file differs warns.

The file sources are in `runtime.data.files`; weighted mixtures of them (``mix(...)``) and the
held-out split of ``eval { data = holdout(fraction) }`` in `runtime.data.mix`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ppdsl.core.families import by_name
from ppdsl.lowering.plan import DataPlan, ModelRef, Plan
from ppdsl.runtime.parallel.rng import mix_seed
from ppdsl.runtime.stage.module import MicroBatch

Task = Literal["causal_lm", "classification", "seq2seq"]

SYNTHETIC_ALPHABET = 64  # synthetic tokens use ids below min(vocab_size, this)
SYNTHETIC_RULES = ((1, 1), (3, 7))  # (a, b) of x[t+1] = (a * x[t] + b) % K
SYNTHETIC_IMAGE_NOISE = 0.5  # images: each class's pattern plus this much unit noise


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


# ---------------------------------------------------------------------------------------------
# synthetic
# ---------------------------------------------------------------------------------------------


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
            input_ids = self._rule_tokens(n, gen)
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

    def _rule_tokens(self, b: int, gen: torch.Generator) -> torch.Tensor:
        s, k = self.seq_len, self.alphabet
        rules = [(a if math.gcd(a, k) == 1 else 1, c % k) for a, c in SYNTHETIC_RULES]
        which = torch.randint(0, len(rules), (b,), generator=gen)
        a = torch.tensor([r[0] for r in rules])[which]
        c = torch.tensor([r[1] for r in rules])[which]
        out = torch.empty((b, s), dtype=torch.long)
        out[:, 0] = torch.randint(0, k, (b,), generator=gen)
        for t in range(1, s):
            out[:, t] = (a * out[:, t - 1] + c) % k
        return out

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


def image_of(plan: Plan) -> tuple[int, ...]:
    """(C, H, W) of one image where the model is fed images (check's trace: OwnForward), else ()."""
    own = plan.own_forward
    return tuple(own.input_shape) if own is not None and own.inputs == "pixels" else ()


# ---------------------------------------------------------------------------------------------
# the plan's source
# ---------------------------------------------------------------------------------------------


def make_data(plan: Plan, pp_rank: int | None = None, data: DataPlan | None = None,
              cp_rank: int | None = None) -> DataSource:
    """The data source the plan names (`data`: another one, such as ``plan.train.eval.data``, read
    with the same batch shape). `pp_rank`: this rank's pipeline rank, so that only the first
    stage's ranks read inputs and only the last stage's read labels; None reads all. `cp_rank`
    (with mesh.cp > 1): the microbatches hold this cp rank's part of each sequence
    (`runtime.parallel.context`); None: whole sequences.
    ValueError for a kind the runtime does not know or a source that does not fit the model."""
    source = _source(plan, pp_rank, data)
    if cp_rank is None or plan.mesh.cp == 1:
        return source
    from ppdsl.runtime.parallel.context import ShardedData

    return ShardedData(source, plan.mesh.cp, cp_rank)  # type: ignore[return-value]


def _source(plan: Plan, pp_rank: int | None, data: DataPlan | None, whole: bool = True) -> DataSource:
    train = plan.train
    data = train.data if data is None else data
    holdout = train.eval is not None and train.eval.data.kind == "holdout"
    if whole and (data.kind in ("mix", "holdout") or (holdout and data is train.data)):  # runtime/data/mix.py
        from ppdsl.runtime.data.mix import from_plan

        return from_plan(plan, data, needs_of(plan, pp_rank), lambda part: _source(plan, pp_rank, part, whole=False))
    kind = data.kind
    opts = data.options_dict
    seed = opts.get("seed")
    seed = train.seed if seed is None else int(seed)
    if plan.own_forward is not None and plan.own_forward.inputs == "speech":  # runtime/data/speech.py
        from ppdsl.runtime.data.speech import speech_source

        return speech_source(plan, data, seed, needs_of(plan, pp_rank))
    if plan.own_forward is not None and plan.own_forward.inputs == "image_text":  # runtime/data/image_text.py
        from ppdsl.runtime.data.image_text import image_text_source

        return image_text_source(plan, pp_rank, data, seed)
    if kind == "synthetic":
        return synthetic(plan, seed, pp_rank)
    if kind == "image_folder" or image_of(plan):
        return _images(plan, pp_rank, data, seed)
    if plan.model.task == "seq2seq_lm":
        return _pairs(plan, pp_rank, data, seed)
    from ppdsl.runtime.data.files import ExampleData, TextData, TokenData

    task = task_of(plan.model)
    common = dict(
        seed=seed, seq_len=train.seq_len, batch_size=plan.replica_batch,
        microbatch_size=train.microbatch_size, dp=plan.mesh.dp, vocab_size=_vocab_or_none(plan.model),
        needs=needs_of(plan, pp_rank),
    )
    if kind in ("tokens", "text"):
        if task != "causal_lm":
            raise ValueError(f"data = {kind}(...) is a token stream for causal language models; model "
                             f"{plan.model.target!r} classifies sequences: use jsonl(...) or csv(...)")
        if kind == "tokens":
            return TokenData(path=opts["path"], dtype=opts.get("dtype"), **common)  # type: ignore[arg-type]
        return TextData(path=opts["path"], dtype=None, tokenizer=opts["tokenizer"], **common)  # type: ignore[arg-type]
    if kind in ("jsonl", "csv"):
        if task != "classification":
            raise ValueError(f"data = {kind}(...) gives classification examples; model {plan.model.target!r} is a "
                             "causal language model: use tokens(...) or text(...)")
        return ExampleData(kind=kind, path=opts["path"], tokenizer=opts["tokenizer"], text=opts.get("text", "text"),
                           label=opts.get("label", "label"), num_labels=num_labels_of(plan.model),
                           **common)  # type: ignore[arg-type]
    if kind == "hf_dataset":
        if opts.get("target") is not None:
            raise ValueError(f"hf_dataset(..., target = ...) gives source/target pairs for an encoder-decoder model; "
                             f"model {plan.model.target!r} is not one")
        table = dict(path=opts["path"], tokenizer=opts["tokenizer"], split=opts.get("split"), text=opts.get("text", "text"))
        if task == "classification":
            if opts.get("messages") is not None:
                raise ValueError(f"hf_dataset(..., messages = ...) gives conversations for a causal language model; "
                                 f"model {plan.model.target!r} classifies sequences")
            return ExampleData(kind=kind, label=opts.get("label", "label"), num_labels=num_labels_of(plan.model),
                               **table, **common)  # type: ignore[arg-type]
        if opts.get("messages") is not None:  # conversations: the loss on the assistant's tokens
            from ppdsl.runtime.data.chat import ChatData

            return ChatData(path=opts["path"], tokenizer=opts["tokenizer"], split=opts.get("split"),
                            messages=opts["messages"], template=opts.get("chat_template"), mask=plan.mesh.cp == 1,
                            packed=opts.get("packing") == "documents", **common)  # type: ignore[arg-type]
        from ppdsl.runtime.data.docs import PackedDocuments, PaddedDocuments

        packing = opts.get("packing", True)  # train.packing, folded in by check: True, False or "documents"
        if packing:
            return PackedDocuments(dtype=None, documents=packing == "documents", **table, **common)  # type: ignore[arg-type]
        # right padding under causal attention: the mask changes nothing for the real tokens, and
        # context parallelism's attention builds its own causal mask (runtime/data/docs.py)
        return PaddedDocuments(mask=plan.mesh.cp == 1, **table, **common)  # type: ignore[arg-type]
    raise ValueError(f"data = {kind}(...) is not supported by the runtime; use synthetic, tokens, text, jsonl, csv, "
                     "hf_dataset or image_folder")


def _pairs(plan: Plan, pp_rank: int | None, data: DataPlan, seed: int) -> DataSource:
    """hf_dataset(..., target = ...) (`runtime.data.pairs`) for an encoder-decoder model; any other file source there is refused."""
    opts, train = data.options_dict, plan.train
    if data.kind != "hf_dataset" or opts.get("target") is None:
        raise ValueError(f"model {plan.model.target!r} is an encoder-decoder model, trained on source and target pairs: "
                         "use hf_dataset(path, tokenizer, text = \"...\", target = \"...\") or synthetic(...)")
    from ppdsl.runtime.data.pairs import PairData

    return PairData(path=opts["path"], tokenizer=opts["tokenizer"], split=opts.get("split"), text=opts.get("text", "text"),
                    target=opts["target"], seed=seed, seq_len=train.seq_len,
                    batch_size=plan.replica_batch, microbatch_size=train.microbatch_size,
                    dp=plan.mesh.dp, vocab_size=_vocab_or_none(plan.model), needs=needs_of(plan, pp_rank))


def _images(plan: Plan, pp_rank: int | None, data: DataPlan, seed: int) -> DataSource:
    """image_folder(...) (`runtime.data.images`) for a model fed images; any other file source there is refused."""
    if not image_of(plan):
        raise ValueError(f"data = image_folder(...) gives images; model {plan.model.target!r} takes token ids")
    if data.kind != "image_folder":
        raise ValueError(f"data = {data.kind}(...) gives token ids; model {plan.model.target!r} is fed images: use "
                         "image_folder(...) or synthetic(...)")
    from ppdsl.runtime.data.images import ImageData

    opts, train = data.options_dict, plan.train
    return ImageData(path=opts["path"], split=opts.get("split"), processor=opts.get("processor"), model=plan.model,
                     image=image_of(plan), num_labels=num_labels_of(plan.model), seed=seed, seq_len=train.seq_len,
                     batch_size=plan.replica_batch, microbatch_size=train.microbatch_size,
                     dp=plan.mesh.dp, needs=needs_of(plan, pp_rank))


__all__: Sequence[str] = (
    "Batch", "DataSource", "Needs", "SyntheticData", "make_data",
    "image_of", "needs_of", "synthetic", "task_of",
)
