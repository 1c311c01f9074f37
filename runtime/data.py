"""Training data: the sources of `train.data`, read deterministically by every replica.

Every batch is a pure function of (seed, step, data-parallel rank), and a step's global batch of
(seed, step) alone (the replicas take consecutive rows of it): each rank reads or generates
the microbatches it needs by itself, without communication, and the single-process reference in
``verify`` reads exactly the same ones. The sources:

- ``synthetic(seed)``: generated, and learnable, so a short run shows the loss falling. Causal
  LM: each sequence follows ``x[t+1] = (a * x[t] + b) % K`` from a random start, with ``(a, b)``
  one of two fixed rules chosen per sequence, over the first ``K = min(vocab_size, 64)`` ids
  (specs/tiny_cpu.ppspec: from 5.0 to about 0.6 in its 40 steps).
  Classification: a class ``y`` is drawn per sequence and half of its tokens come from class
  ``y``'s ids (``id % num_labels == y``), the rest uniformly; the label is ``y``, the class whose
  ids are over-represented.
- ``tokens(path, dtype)``: a flat binary (nanoGPT's ``train.bin``) or a ``.npy`` of uint16 /
  uint32 token ids, memory-mapped. It is cut into ``len // seq_len`` non-overlapping windows of
  ``seq_len`` tokens; labels are the inputs (the adapters shift them).
- ``text(path, tokenizer)``: a UTF-8 corpus, tokenized once (in memory) with the tokenizer of a
  local directory, then cut into windows like a token file.
- ``jsonl(path, tokenizer, text, label)`` / ``csv(...)``: classification examples, each text
  tokenized (with the tokenizer's special tokens), truncated and right-padded to ``seq_len``,
  with an attention mask and the integer label.

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

A file changed during the run: text, jsonl and csv files are read whole on first use, so a
later change or removal does not reach the run. A token file is memory-mapped: each step first
checks it (one fstat of a descriptor kept open): a file that shrank (truncated) raises a
`runtime.failure.RunFault` naming it (exit 1), before a read past its new end would kill the
process with SIGBUS; a removed file (the mapping keeps its data) or one rewritten in place gets
one warning line. A checkpoint records each data file's size and a digest of its first and last
MiB (`data_file_identities`); a resume whose file differs warns (`changed_data_files`).
"""

from __future__ import annotations

import hashlib
import math
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from ppdsl.core.families import by_name
from ppdsl.lowering.plan import DataPlan, ModelRef, Plan
from ppdsl.runtime.failure import RunFault
from ppdsl.runtime.rng import mix_seed

Task = Literal["causal_lm", "classification"]

SYNTHETIC_ALPHABET = 64  # synthetic tokens use ids below min(vocab_size, this)
SYNTHETIC_RULES = ((1, 1), (3, 7))  # (a, b) of x[t+1] = (a * x[t] + b) % K
PERMUTE_MAX = 1 << 24  # up to this many items an epoch's order is a stored permutation; above, an affine map
TEXT_CHUNK = 1 << 20  # characters per tokenizer call when a corpus is tokenized


def task_of(model: ModelRef) -> Task:
    """What the labels are: next tokens (causal LM) or one class id per sequence.
    The same rule as check's (`ppdsl.core.labels`)."""
    from ppdsl.core.labels import is_classification

    return "classification" if is_classification(model.family, model.target) else "causal_lm"


def vocab_size_of(model: ModelRef) -> int:
    v = _vocab_or_none(model)
    if v is None:
        raise ValueError(f"model {model.target!r}: synthetic data needs vocab_size in its config")
    return v


def _vocab_or_none(model: ModelRef) -> int | None:
    config = model.config_dict
    for key in ("vocab_size", "n_vocab"):
        if isinstance(config.get(key), int):
            return int(config[key])
    vocab = model.dims_dict.get("vocab")  # resolved by check: hf_pretrained's config.json, HF defaults
    return int(vocab) if isinstance(vocab, int) else None


def num_labels_of(model: ModelRef) -> int:
    config = model.config_dict
    if "num_labels" in config:
        return int(config["num_labels"])
    if "id2label" in config:
        return len(config["id2label"])
    labels = model.dims_dict.get("labels")
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


def _placeholder(shape: tuple[int, ...], device: torch.device | str) -> torch.Tensor:
    """Zeros of `shape` that take no memory: what a rank gets for a tensor it does not use."""
    return torch.zeros((), dtype=torch.long, device=device).expand(shape)


class DataSource:
    """The interface the trainer uses: ``microbatches(step, dp_rank, device, factory)``."""

    task: Task
    seq_len: int
    batch_size: int  # per data-parallel replica and step: microbatch_size * microbatches
    microbatch_size: int
    needs: Needs

    def batch(self, step: int, dp_rank: int, device: torch.device | str = "cpu") -> Batch:
        raise NotImplementedError

    def microbatches(
        self, step: int, dp_rank: int, device: torch.device | str = "cpu", factory: Callable[..., Any] | None = None
    ) -> list[Any]:
        if factory is None:
            from .stage import MicroBatch as factory  # noqa: N813
        return self.batch(step, dp_rank, device).split(self.microbatch_size, factory)

    def _assemble(
        self,
        input_ids: torch.Tensor | None,
        labels: torch.Tensor | None,
        mask: torch.Tensor | None,
        device: torch.device | str,
    ) -> Batch:
        """The batch this rank sees: placeholders for what its stages do not use."""
        shape = (self.batch_size, self.seq_len)
        label_shape = (self.batch_size,) if self.task == "classification" else shape
        inputs = input_ids.to(device) if self.needs.inputs and input_ids is not None else _placeholder(shape, device)
        out_labels = labels.to(device) if self.needs.labels and labels is not None else _placeholder(label_shape, device)
        token_types = None
        if self.task == "classification" and self.needs.inputs:
            token_types = torch.zeros(shape, dtype=torch.long, device=device)
        return Batch(inputs, out_labels, None if mask is None else mask.to(device), token_types)


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

    @property
    def alphabet(self) -> int:
        return max(1, min(self.vocab_size, SYNTHETIC_ALPHABET))

    def batch(self, step: int, dp_rank: int, device: torch.device | str = "cpu") -> Batch:
        # the step's whole global batch from one generator, this replica's rows of it: the samples
        # do not depend on how many replicas share them (a run resumed at another dp sees the same)
        gen = torch.Generator().manual_seed(mix_seed(self.seed, step, 0))
        n, s = self.batch_size * self.replicas, self.seq_len
        if self.task == "classification":
            labels = torch.randint(0, max(1, self.num_labels), (n,), generator=gen)
            input_ids = self._class_tokens(labels, gen)
        else:
            input_ids = self._rule_tokens(n, gen)
            labels = input_ids.clone()
        mask = None
        if self.padding:
            lengths = torch.randint(max(1, s // 2), s + 1, (n,), generator=gen)
            mask = (torch.arange(s).unsqueeze(0) < lengths.unsqueeze(1)).long()
        rows = slice(dp_rank * self.batch_size, (dp_rank + 1) * self.batch_size)
        return self._assemble(input_ids[rows], labels[rows], None if mask is None else mask[rows], device)

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
    task = task_of(plan.model)
    return SyntheticData(
        replicas=train.global_batch // (train.microbatch_size * train.microbatches),
        seed=seed,
        task=task,
        vocab_size=vocab_size_of(plan.model),
        num_labels=num_labels_of(plan.model) if task == "classification" else 0,
        seq_len=train.seq_len,
        batch_size=train.microbatch_size * train.microbatches,
        microbatch_size=train.microbatch_size,
        padding=by_name(plan.model.family).synthetic_padding,
        needs=needs_of(plan, pp_rank),
    )


# ---------------------------------------------------------------------------------------------
# file data: order, token windows, examples
# ---------------------------------------------------------------------------------------------


class _Order:
    """Which of `n` items fills each global sample position: one seeded permutation per epoch."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed = n, seed
        self._cache: dict[int, Any] = {}

    def items(self, positions: Sequence[int]) -> list[int]:
        out = []
        for g in positions:
            epoch, k = divmod(int(g), self.n)
            out.append(self._item(epoch, k))
        return out

    def _item(self, epoch: int, k: int) -> int:
        perm = self._perm(epoch)
        if isinstance(perm, tuple):  # affine: k -> (a * k + b) mod n, a coprime to n
            a, b = perm
            return (a * k + b) % self.n
        return int(perm[k])

    def _perm(self, epoch: int) -> Any:
        if epoch in self._cache:
            return self._cache[epoch]
        import numpy as np

        rng = np.random.default_rng(mix_seed(self.seed, epoch))
        if self.n <= PERMUTE_MAX:
            perm: Any = rng.permutation(self.n)
        else:
            a = int(rng.integers(1, self.n))
            while math.gcd(a, self.n) != 1:
                a = a % (self.n - 1) + 1
            perm = (a, int(rng.integers(0, self.n)))
        if len(self._cache) >= 2:
            self._cache.pop(min(self._cache))
        self._cache[epoch] = perm
        return perm


def _regular_file(path: str, what: str) -> None:
    """ValueError unless `path` is a regular file (a FIFO would block on open: never a hang)."""
    if not os.path.lexists(path):
        raise ValueError(f"{what} {path} does not exist")
    if not os.path.isfile(path):
        raise ValueError(f"{what} {path} is not a regular file")


class _WatchedFile:
    """A memory-mapped file, watched through a descriptor kept open (it names the mapped file
    even after a rename or removal of the path)."""

    def __init__(self, path: str, what: str) -> None:
        self.path, self.what = path, what
        self.fd = os.open(path, os.O_RDONLY)
        st = os.fstat(self.fd)
        self.size, self.mtime_ns = st.st_size, st.st_mtime_ns
        self.warned: set[str] = set()

    def check(self) -> None:
        st = os.fstat(self.fd)
        if st.st_size < self.size:
            raise RunFault(
                f"{self.what} {self.path} shrank from {self.size} to {st.st_size} bytes while the run read it "
                "(truncated or rewritten in place); reading on would crash the process (SIGBUS). Restore the file, "
                "then resume from the newest checkpoint (ppdsl run --resume) or run again")
        if st.st_nlink == 0:
            self._warn("removed", f"{self.what} {self.path} was removed during the run: the run goes on reading "
                                  "the file it opened, but a resume will not find it")
        elif st.st_mtime_ns != self.mtime_ns:
            self._warn("modified", f"{self.what} {self.path} was modified in place during the run: the steps "
                                   "from here on read its new contents")

    def _warn(self, kind: str, text: str) -> None:
        if kind not in self.warned:
            self.warned.add(kind)
            print(f"ppdsl: warning: {text}", file=sys.stderr, flush=True)


@dataclass
class TokenData(DataSource):
    """Windows of `seq_len` tokens from a memory-mapped token file (or a tokenized corpus)."""

    path: str
    dtype: str | None
    seed: int
    seq_len: int
    batch_size: int
    microbatch_size: int
    dp: int
    vocab_size: int | None
    needs: Needs = EVERYTHING
    task: Task = "causal_lm"
    _tokens: Any = field(default=None, repr=False)
    _order: Any = field(default=None, repr=False)
    _watch: _WatchedFile | None = field(default=None, repr=False)

    what = "token file"
    mapped = True  # the ids are a memory map of the file (watched each step), not a copy

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.dp

    def tokens(self) -> Any:
        """The token ids (a numpy memmap), opened and checked on first use."""
        if self._tokens is None:
            ids = self._load()
            n = int(ids.shape[0])
            windows = n // self.seq_len
            if windows < self.global_batch:
                raise ValueError(
                    f"{self.what} {self.path} holds {n} tokens, fewer than one global batch needs "
                    f"(global_batch * seq_len = {self.global_batch} * {self.seq_len} = {self.global_batch * self.seq_len})"
                )
            self._tokens = ids
            self._order = _Order(windows, self.seed)
            if self.mapped:
                self._watch = _WatchedFile(self.path, self.what)
        elif self._watch is not None:
            self._watch.check()
        return self._tokens

    def _load(self) -> Any:
        import numpy as np

        _regular_file(self.path, self.what)
        try:
            with open(self.path, "rb") as f:
                magic = f.read(6)
            if magic == b"\x93NUMPY":
                ids = np.load(self.path, mmap_mode="r", allow_pickle=False)
                if ids.dtype.byteorder == ">" or ids.dtype.name not in ("uint16", "uint32") or ids.ndim != 1:
                    raise ValueError(f"holds a {ids.ndim}-D array of {ids.dtype.str}; expected 1-D uint16 or uint32 token ids")
                if self.dtype is not None and ids.dtype.name != self.dtype:
                    raise ValueError(f"holds {ids.dtype.name}, but the spec says dtype = \"{self.dtype}\"")
            else:
                dtype = np.dtype(self.dtype or "uint16")
                size = os.path.getsize(self.path)
                if size == 0:
                    raise ValueError("is empty")
                if size % dtype.itemsize:
                    raise ValueError(f"holds {size} bytes, not a whole number of {dtype.name} tokens")
                ids = np.memmap(self.path, dtype=dtype, mode="r")
        except (OSError, ValueError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            raise ValueError(f"{self.what} {self.path}: {why}") from None
        return ids

    def batch(self, step: int, dp_rank: int, device: torch.device | str = "cpu") -> Batch:
        if not (self.needs.inputs or self.needs.labels):
            return self._assemble(None, None, None, device)  # a middle stage: nothing is read
        import numpy as np

        ids = self.tokens()
        start = step * self.global_batch + dp_rank * self.batch_size
        items = self._order.items(range(start, start + self.batch_size))
        s = self.seq_len
        try:
            windows = np.stack([np.asarray(ids[i * s : (i + 1) * s], dtype=np.int64) for i in items])
        except (OSError, ValueError) as exc:
            raise ValueError(f"{self.what} {self.path}: cannot read step {step}: {exc}") from None
        if self.vocab_size is not None and windows.size and int(windows.max()) >= self.vocab_size:
            row, col = np.argwhere(windows >= self.vocab_size)[0]
            raise ValueError(
                f"{self.what} {self.path}: token id {int(windows[row, col])} at position "
                f"{int(items[row]) * s + int(col)} is outside the model's vocabulary (vocab_size = {self.vocab_size})"
            )
        input_ids = torch.from_numpy(windows)
        return self._assemble(input_ids, input_ids.clone(), None, device)


@dataclass
class TextData(TokenData):
    """A UTF-8 corpus, tokenized once with a local tokenizer, then windows as a token file."""

    tokenizer: str = ""
    what = "text corpus"
    mapped = False

    def _load(self) -> Any:
        import numpy as np

        _regular_file(self.path, self.what)
        try:
            with open(self.path, encoding="utf-8") as f:
                text = f.read()
        except UnicodeDecodeError as exc:
            raise ValueError(f"{self.what} {self.path} is not UTF-8 text (byte {exc.start})") from None
        except OSError as exc:
            raise ValueError(f"{self.what} {self.path}: {exc.strerror or exc}") from None
        tok = _Tokenizer(self.tokenizer)
        pieces, size, chunks = [], 0, []
        for line in text.splitlines(keepends=True):  # whole lines per call: no word is cut
            pieces.append(line)
            size += len(line)
            if size >= TEXT_CHUNK:
                chunks.append("".join(pieces))
                pieces, size = [], 0
        if pieces:
            chunks.append("".join(pieces))
        ids = [i for row in tok.encode(chunks, special=False) for i in row]
        return np.asarray(ids, dtype=np.int64)


class _Tokenizer:
    """A tokenizer from a local directory: tokenizer.json through the `tokenizers` library, or
    anything else transformers' AutoTokenizer reads (local files only; nothing is downloaded)."""

    def __init__(self, directory: str, max_length: int | None = None):
        self.directory = directory
        if not os.path.isdir(directory):
            raise ValueError(f"tokenizer directory {directory} does not exist")
        tj = os.path.join(directory, "tokenizer.json")
        try:
            if os.path.isfile(tj):
                from tokenizers import Tokenizer

                self._fast: Any = Tokenizer.from_file(tj)
                self._fast.no_padding()
                if max_length is None:
                    self._fast.no_truncation()
                else:
                    self._fast.enable_truncation(max_length)
                self._auto = None
            else:
                from transformers import AutoTokenizer

                self._fast = None
                self._auto = AutoTokenizer.from_pretrained(directory, local_files_only=True)
        except Exception as exc:  # noqa: BLE001 - any failure to load is the user's file: say which
            raise ValueError(f"cannot load the tokenizer in {directory}: {type(exc).__name__}: {exc}") from None
        self.max_length = max_length

    @property
    def pad_id(self) -> int:
        if self._fast is not None:
            for name in ("[PAD]", "<pad>", "<|pad|>", "<|endoftext|>"):
                i = self._fast.token_to_id(name)
                if i is not None:
                    return int(i)
            return 0
        pad = self._auto.pad_token_id
        return int(pad) if pad is not None else 0

    def encode(self, texts: list[str], special: bool) -> list[list[int]]:
        if not texts:
            return []
        if self._fast is not None:
            return [e.ids for e in self._fast.encode_batch(texts, add_special_tokens=special)]
        kw: dict[str, Any] = {"add_special_tokens": special}
        if self.max_length is not None:
            kw.update(truncation=True, max_length=self.max_length)
        return [list(r) for r in self._auto(texts, **kw)["input_ids"]]


@dataclass
class ExampleData(DataSource):
    """Classification examples from a JSON-lines or CSV file: text -> padded ids + mask, label."""

    kind: str  # jsonl | csv
    path: str
    tokenizer: str
    text: str
    label: str
    seed: int
    seq_len: int
    batch_size: int
    microbatch_size: int
    dp: int
    num_labels: int
    vocab_size: int | None
    needs: Needs = EVERYTHING
    task: Task = "classification"
    _examples: Any = field(default=None, repr=False)
    _tok: Any = field(default=None, repr=False)
    _order: Any = field(default=None, repr=False)

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.dp

    def examples(self) -> list[tuple[str, int]]:
        if self._examples is None:
            rows = self._read()
            if len(rows) < self.global_batch:
                raise ValueError(f"{self.kind} file {self.path} holds {len(rows)} examples, fewer than one global "
                                 f"batch (global_batch = {self.global_batch})")
            self._examples = rows
            self._order = _Order(len(rows), self.seed)
            self._tok = _Tokenizer(self.tokenizer, max_length=self.seq_len)
        return self._examples

    def _read(self) -> list[tuple[str, int]]:
        import csv
        import json

        from ppdsl.core.labels import class_id

        _regular_file(self.path, f"{self.kind} file")
        out: list[tuple[str, int]] = []

        def add(row: Any, where: str) -> None:
            if not isinstance(row, dict):
                raise ValueError(f"{where}: not a JSON object")
            for key in (self.text, self.label):
                if row.get(key) is None:
                    raise ValueError(f"{where}: no field '{key}'")
            if not isinstance(row[self.text], str):
                raise ValueError(f"{where}: field '{self.text}' is not a string")
            label = class_id(row[self.label])
            if label is None or not 0 <= label < self.num_labels:
                raise ValueError(f"{where}: label {row[self.label]!r} is not a class id 0..{self.num_labels - 1} "
                                 f"(num_labels = {self.num_labels})")
            out.append((row[self.text], label))

        try:
            with open(self.path, encoding="utf-8", newline="") as f:
                if self.kind == "jsonl":
                    for lineno, line in enumerate(f, 1):
                        if line.strip():
                            try:
                                row = json.loads(line)
                            except ValueError as exc:
                                raise ValueError(f"{self.path}:{lineno}: not JSON: {exc}") from None
                            add(row, f"{self.path}:{lineno}")
                else:
                    reader = csv.DictReader(f)
                    for row in reader:
                        add(row, f"{self.path}:{reader.line_num}")
        except UnicodeDecodeError as exc:
            raise ValueError(f"{self.kind} file {self.path} is not UTF-8 text (byte {exc.start})") from None
        except csv.Error as exc:
            raise ValueError(f"{self.kind} file {self.path}: {exc}") from None
        except OSError as exc:
            raise ValueError(f"{self.kind} file {self.path}: {exc.strerror or exc}") from None
        return out

    def batch(self, step: int, dp_rank: int, device: torch.device | str = "cpu") -> Batch:
        rows = self.examples()
        start = step * self.global_batch + dp_rank * self.batch_size
        picked = [rows[i] for i in self._order.items(range(start, start + self.batch_size))]
        encoded = self._tok.encode([t for t, _ in picked], special=True)
        s = self.seq_len
        ids = torch.full((self.batch_size, s), self._tok.pad_id, dtype=torch.long)
        mask = torch.zeros((self.batch_size, s), dtype=torch.long)
        for r, row in enumerate(encoded):
            row = row[:s]
            if row:
                ids[r, : len(row)] = torch.tensor(row, dtype=torch.long)
            mask[r, : max(1, len(row))] = 1  # at least one position attends (an empty text)
        if self.vocab_size is not None and int(ids.max()) >= self.vocab_size:
            raise ValueError(f"{self.kind} file {self.path}: the tokenizer in {self.tokenizer} gives id "
                             f"{int(ids.max())}, outside the model's vocabulary (vocab_size = {self.vocab_size})")
        labels = torch.tensor([lab for _, lab in picked], dtype=torch.long)
        return self._assemble(ids, labels, mask, device)


# ---------------------------------------------------------------------------------------------
# the identity of data files (checkpoints record it)
# ---------------------------------------------------------------------------------------------

DIGEST_BYTES = 1 << 20  # the digest reads this much at each end of a file


def file_identity(path: str) -> dict[str, Any] | None:
    """Size and a SHA-256 of the first and last `DIGEST_BYTES` (cheap for a large token file;
    an edit in the middle that keeps the size is not seen). None: not a readable file."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            h = hashlib.sha256(f.read(DIGEST_BYTES))
            if size > DIGEST_BYTES:
                f.seek(max(DIGEST_BYTES, size - DIGEST_BYTES))
                h.update(f.read(DIGEST_BYTES))
    except OSError:
        return None
    return {"size": size, "sha256_ends": h.hexdigest()}


def data_file_identities(plan: Plan) -> dict[str, Any]:
    """path -> `file_identity` of each file train.data and train.eval.data read."""
    sources = [plan.train.data] + ([plan.train.eval.data] if plan.train.eval is not None else [])
    paths = [d.options_dict.get("path") for d in sources if d.kind != "synthetic"]
    return {p: file_identity(p) for p in paths if isinstance(p, str)}


def changed_data_files(saved: dict[str, Any], checkpoint: Any) -> list[str]:
    """Warning lines for a resume: the data files the checkpoint's run read that are missing
    now or differ (the resumed steps would read other samples than the saved run's)."""
    out = []
    for path, was in sorted(saved.items()):
        now = file_identity(path)
        if was is None or now == was:
            continue
        if now is None:
            out.append(f"ppdsl: warning: data file {path}, which the run of checkpoint {checkpoint} read, "
                       "is missing now")
        else:
            how = f"{was['size']} -> {now['size']} bytes" if now["size"] != was["size"] else "same size, other contents"
            out.append(f"ppdsl: warning: data file {path} changed since the run of checkpoint {checkpoint} read it "
                       f"({how}); the resumed run reads other samples than that run would")
    return out


# ---------------------------------------------------------------------------------------------
# the plan's source
# ---------------------------------------------------------------------------------------------


def make_data(plan: Plan, pp_rank: int | None = None, data: DataPlan | None = None) -> DataSource:
    """The data source the plan names (`data`: another one, such as ``plan.train.eval.data``, read
    with the same batch shape). `pp_rank`: this rank's pipeline rank, so that only the first
    stage's ranks read inputs and only the last stage's read labels; None reads all.
    ValueError for a kind the runtime does not know or a source that does not fit the model."""
    train = plan.train
    data = train.data if data is None else data
    kind = data.kind
    opts = data.options_dict
    seed = opts.get("seed")
    seed = train.seed if seed is None else int(seed)
    if kind == "synthetic":
        return synthetic(plan, seed, pp_rank)
    task = task_of(plan.model)
    common = dict(
        seed=seed, seq_len=train.seq_len, batch_size=train.microbatch_size * train.microbatches,
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
    raise ValueError(f"data = {kind}(...) is not supported by the runtime; use synthetic, tokens, text, jsonl or csv")


__all__: Sequence[str] = (
    "Batch", "DataSource", "ExampleData", "Needs", "SyntheticData", "TextData", "TokenData", "make_data",
    "needs_of", "synthetic", "task_of",
)
