"""The token sources of `train.data` for a causal LM: a memory-mapped token file (``tokens``) and a
UTF-8 corpus tokenized once into the token cache (``text``), both cut into windows of ``seq_len``
tokens read in the order of `runtime.data.order`. The sources and the order are described in
`runtime.data.source`; the identity of a data file that checkpoints record is
runtime/data/identity.py.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ppdsl.runtime.data.batch import EVERYTHING, Batch, DataSource, Needs, Task
from ppdsl.runtime.data.file_checks import _regular_file, _WatchedFile
from ppdsl.runtime.data.order import _Order
from ppdsl.runtime.data.tokenizer import _Tokenizer

TEXT_CHUNK = 1 << 20  # characters per tokenizer call when a corpus is tokenized


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


__all__ = ("TextData", "TokenData")
