"""The file sources of `train.data`: token files, text corpora and classification examples, read
in the order `runtime.data.source` describes (a permutation per epoch). The sources and the order are
described in `runtime.data.source`; the identity of a data file that checkpoints record is
runtime/data/identity.py.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ppdsl.runtime.data.source import EVERYTHING, Batch, DataSource, Needs, Task
from ppdsl.runtime.run.failure import RunFault
from ppdsl.runtime.parallel.rng import mix_seed

PERMUTE_MAX = 1 << 24  # up to this many items an epoch's order is a stored permutation; above, an affine map
TEXT_CHUNK = 1 << 20  # characters per tokenizer call when a corpus is tokenized


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
        self.tokens()
        start = step * self.global_batch + dp_rank * self.batch_size
        return self._assemble(*self.read(self._order.items(range(start, start + self.batch_size))), device)

    def count(self) -> int:
        """How many windows (items) there are."""
        self.tokens()
        return int(self._order.n)

    def read(self, items: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, None]:
        """The windows `items` (numbers below `count()`): input ids, labels, no mask."""
        import numpy as np

        ids = self.tokens()
        s = self.seq_len
        try:
            windows = np.stack([np.asarray(ids[i * s : (i + 1) * s], dtype=np.int64) for i in items])
        except (OSError, ValueError) as exc:
            raise ValueError(f"{self.what} {self.path}: cannot read windows {list(items)[:4]}: {exc}") from None
        if self.vocab_size is not None and windows.size and int(windows.max()) >= self.vocab_size:
            row, col = np.argwhere(windows >= self.vocab_size)[0]
            raise ValueError(
                f"{self.what} {self.path}: token id {int(windows[row, col])} at position "
                f"{int(items[row]) * s + int(col)} is outside the model's vocabulary (vocab_size = {self.vocab_size})"
            )
        input_ids = torch.from_numpy(windows)
        return input_ids, input_ids.clone(), None


@dataclass
class TextData(TokenData):
    """A UTF-8 corpus, tokenized once with a local tokenizer, then windows as a token file."""

    tokenizer: str = ""
    what = "text corpus"
    mapped = False

    def _load(self) -> Any:
        from ppdsl.runtime.data.cache import cached_tokens

        _regular_file(self.path, self.what)
        return cached_tokens(self.path, [self.path], self.tokenizer, {"kind": "text", "chunk": TEXT_CHUNK},
                             self._tokenize).tokens

    def _tokenize(self, out: Any) -> dict[str, Any]:
        """The corpus streamed in chunks of whole lines of at least TEXT_CHUNK characters, one
        tokenizer call each (the line ends and splits of reading it whole: universal newlines,
        then str.splitlines)."""
        tok = _Tokenizer(self.tokenizer)
        out.begin(tok.vocab_size)
        pieces: list[str] = []
        size = at = 0
        try:
            with open(self.path, "rb") as f:
                for raw in f:
                    try:
                        line = raw.decode("utf-8")
                    except UnicodeDecodeError as exc:
                        raise ValueError(f"{self.what} {self.path} is not UTF-8 text (byte {at + exc.start})") from None
                    at += len(raw)
                    for piece in line.replace("\r\n", "\n").replace("\r", "\n").splitlines(keepends=True):
                        pieces.append(piece)
                        size += len(piece)
                        if size >= TEXT_CHUNK:
                            out.add(tok.encode(["".join(pieces)], special=False))
                            pieces, size = [], 0
        except OSError as exc:
            raise ValueError(f"{self.what} {self.path}: {exc.strerror or exc}") from None
        if pieces:
            out.add(tok.encode(["".join(pieces)], special=False))
        return {}


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
    def vocab_size(self) -> int:
        return int(self._fast.get_vocab_size(with_added_tokens=True)) if self._fast is not None else len(self._auto)

    def separator_id(self) -> int:
        """The id put between documents: `ppdsl.core.special_tokens.document_separator`'s token.
        ValueError when the tokenizer has none."""
        from ppdsl.core.special_tokens import COMMON_EOS, document_separator

        if self._fast is not None:
            lookup = self._fast.token_to_id
        else:
            vocab = self._auto.get_vocab()
            lookup = vocab.get
        token = document_separator(self.directory, lambda t: lookup(t) is not None)
        if token is None:
            raise ValueError(f"the tokenizer in {self.directory} has no end-of-sequence or separator token to put "
                             f"between documents (eos_token, sep_token, or one of {', '.join(COMMON_EOS)})")
        return int(lookup(token))

    @property
    def pad_id(self) -> int:
        if self._fast is not None:
            from ppdsl.core.special_tokens import COMMON_PAD

            for name in COMMON_PAD:
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

    def encode_targets(self, texts: list[str]) -> list[list[int]]:
        """Targets of an encoder-decoder model, with special tokens: transformers' ``text_target=``
        (a tokenizer's target mode, such as Marian's or mBART's) where AutoTokenizer loaded it; a
        tokenizer.json has no target mode, and encodes them as texts."""
        if self._fast is not None or not texts:
            return self.encode(texts, special=True)
        kw: dict[str, Any] = {"add_special_tokens": True}
        if self.max_length is not None:
            kw.update(truncation=True, max_length=self.max_length)
        return [list(r) for r in self._auto(text_target=texts, **kw)["input_ids"]]


@dataclass
class ExampleData(DataSource):
    """Classification examples from a JSON-lines or CSV file: text -> padded ids + mask, label."""

    kind: str  # jsonl | csv | hf_dataset
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
    split: str | None = None  # hf_dataset: the split of a DatasetDict directory
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
                what = "dataset" if self.kind == "hf_dataset" else f"{self.kind} file"
                raise ValueError(f"{what} {self.path} holds {len(rows)} examples, fewer than one global "
                                 f"batch (global_batch = {self.global_batch})")
            self._examples = rows
            self._order = _Order(len(rows), self.seed)
            self._tok = _Tokenizer(self.tokenizer, max_length=self.seq_len)
        return self._examples

    def _read(self) -> list[tuple[str, int]]:
        import csv

        from ppdsl.core.labels import class_id
        from ppdsl.core.tables import TableError, find_table, iter_rows, jsonl_lines, row_place

        if self.kind != "hf_dataset":
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
            if self.kind == "hf_dataset":  # Parquet, Arrow, save_to_disk or JSON lines (ppdsl.core.tables)
                table = find_table(self.path, self.split)
                fields = {"text": self.text, "label": self.label}
                for file, number, (text, label) in iter_rows(table, fields, strings=()):
                    add({self.text: text, self.label: label}, row_place(table, file, number))
                return out
            if self.kind == "jsonl":
                for lineno, row in jsonl_lines(self.path):
                    add(row, f"{self.path}:{lineno}")
                return out
            with open(self.path, encoding="utf-8", newline="") as f:
                reader = csv.DictReader(f)
                for row in reader:
                    add(row, f"{self.path}:{reader.line_num}")
        except TableError as exc:
            raise ValueError(f"{self.kind}: {exc}") from None
        except UnicodeDecodeError as exc:
            raise ValueError(f"{self.kind} file {self.path} is not UTF-8 text (byte {exc.start})") from None
        except csv.Error as exc:
            raise ValueError(f"{self.kind} file {self.path}: {exc}") from None
        except OSError as exc:
            raise ValueError(f"{self.kind} file {self.path}: {exc.strerror or exc}") from None
        return out

    def batch(self, step: int, dp_rank: int, device: torch.device | str = "cpu") -> Batch:
        self.examples()
        start = step * self.global_batch + dp_rank * self.batch_size
        return self._assemble(*self.read(self._order.items(range(start, start + self.batch_size))), device)

    def count(self) -> int:
        return len(self.examples())

    def read(self, items: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The examples `items`: padded ids, labels, attention mask."""
        rows = self.examples()
        picked = [rows[i] for i in items]
        encoded = self._tok.encode([t for t, _ in picked], special=True)
        s = self.seq_len
        ids = torch.full((len(picked), s), self._tok.pad_id, dtype=torch.long)
        mask = torch.zeros((len(picked), s), dtype=torch.long)
        for r, row in enumerate(encoded):
            row = row[:s]
            if row:
                ids[r, : len(row)] = torch.tensor(row, dtype=torch.long)
            mask[r, : max(1, len(row))] = 1  # at least one position attends (an empty text)
        if self.vocab_size is not None and int(ids.max()) >= self.vocab_size:
            raise ValueError(f"{self.kind} file {self.path}: the tokenizer in {self.tokenizer} gives id "
                             f"{int(ids.max())}, outside the model's vocabulary (vocab_size = {self.vocab_size})")
        labels = torch.tensor([lab for _, lab in picked], dtype=torch.long)
        return ids, labels, mask


__all__ = ("ExampleData", "TextData", "TokenData")
