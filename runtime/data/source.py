"""Training data: the sources of `train.data`, read deterministically by every replica.

Every batch is a pure function of (seed, step, data-parallel rank), and a step's global batch of
(seed, step) alone (the replicas take consecutive rows of it): each rank reads or generates
the microbatches it needs by itself, without communication, and the single-process reference in
``verify`` reads exactly the same ones. The sources:

- ``synthetic(seed)``: generated, and learnable, so a short run shows the loss falling: rule-following
  token sequences, reversed targets for an encoder-decoder model, over-represented class ids, or
  a class's pattern plus noise for a model fed images (`runtime.data.synthetic`).
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
MiB (`runtime.data.identity.data_file_identities`); a resume whose file differs warns.

The batch a source gives and the interface every source implements are in `runtime.data.batch`.
The file sources are in `runtime.data.files` (token files and corpora) and `runtime.data.examples`
(classification examples); weighted mixtures of them (``mix(...)``) and the
held-out split of ``eval { data = holdout(fraction) }`` in `runtime.data.mix`.
"""

from __future__ import annotations

from collections.abc import Sequence

from ppdsl.lowering.plan import DataPlan, Plan
from ppdsl.runtime.data.batch import DataSource, _vocab_or_none, image_of, needs_of, num_labels_of, task_of
from ppdsl.runtime.data.synthetic import synthetic


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
    from ppdsl.runtime.data.examples import ExampleData
    from ppdsl.runtime.data.files import TextData, TokenData

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



__all__: Sequence[str] = ("make_data",)
