"""Documents for a causal language model: ``hf_dataset(path, tokenizer, ...)`` on a model that is
not a classifier. The rows (Parquet, Arrow, a save_to_disk directory or JSON lines, read by
`ppdsl.core.tables`) are read whole on first use; each document's `text` is tokenized without
special tokens; documents without any token are skipped. Then:

- ``packing = true`` (the default): the documents one after another, each followed by the
  tokenizer's end-of-sequence token (`ppdsl.core.special_tokens`: eos_token, else sep_token),
  cut into ``len // seq_len`` windows of ``seq_len`` tokens, exactly as a token file is
  (`runtime.data_files.TokenData`: the same order, replica slices and readers). A window may
  start in the middle of one document and end in another; attention is not cut at the EOS.
- ``packing = false``: one sample per document: its tokens and the EOS, truncated to
  ``seq_len`` (a longer document loses its tail and its EOS), right-padded with the tokenizer's
  pad id; labels are -100 on the padding (no loss there) and the attention mask marks the real
  tokens. Right padding under causal attention changes nothing for the real tokens, so under
  context parallelism (whose attention builds its own causal mask) no mask is given. With the
  mask every rank reads the documents (every block uses it); without it only the first and
  last stages' ranks do.

Sample `g` of the run is item ``perm_e[g % n]`` of epoch ``e = g // n`` (n windows or
documents), as for every file source: a pure function of (seed, step, data-parallel rank), so a
resumed run and the single-process reference of ``verify`` read the same samples.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ppdsl.core.task_loss import IGNORE_INDEX

from .data import Batch, DataSource, EVERYTHING, Needs, Task
from .data_files import TEXT_CHUNK, TokenData, _Order, _Tokenizer

__all__ = ["PackedDocuments", "PaddedDocuments", "read_documents"]


def read_documents(path: str, split: str | None, text: str, tokenizer: str) -> tuple[list[list[int]], _Tokenizer]:
    """The token ids of every document with at least one token, in reading order, and the
    tokenizer. ValueError naming the file for anything unreadable."""
    from ppdsl.core.tables import TableError, find_table, iter_rows

    try:
        table = find_table(path, split)
        texts = [values[0] for _, _, values in iter_rows(table, {"text": text})]
    except TableError as exc:
        raise ValueError(f"hf_dataset: {exc}") from None
    tok = _Tokenizer(tokenizer)
    out: list[list[int]] = []
    chunk: list[str] = []
    size = 0
    for t in texts + [None]:  # type: ignore[list-item]
        if t is not None:
            chunk.append(t)
            size += len(t)
        if chunk and (t is None or size >= TEXT_CHUNK):
            out.extend(ids for ids in tok.encode(chunk, special=False) if ids)
            chunk, size = [], 0
    if not out:
        raise ValueError(f"hf_dataset {path}: no document has any token (field '{text}')")
    return out, tok


@dataclass
class PackedDocuments(TokenData):
    """``packing = true``: the documents, each followed by the EOS, as one token stream."""

    tokenizer: str = ""
    split: str | None = None
    text: str = "text"
    what = "dataset"
    mapped = False

    def _load(self) -> Any:
        import numpy as np

        docs, tok = read_documents(self.path, self.split, self.text, self.tokenizer)
        eos = tok.separator_id()
        flat = np.empty(sum(len(d) + 1 for d in docs), dtype=np.int64)
        at = 0
        for d in docs:
            flat[at : at + len(d)] = d
            flat[at + len(d)] = eos
            at += len(d) + 1
        return flat


@dataclass
class PaddedDocuments(DataSource):
    """``packing = false``: one right-padded sample per document."""

    path: str
    tokenizer: str
    split: str | None
    text: str
    seed: int
    seq_len: int
    batch_size: int
    microbatch_size: int
    dp: int
    vocab_size: int | None
    mask: bool = True  # give the attention mask (False under context parallelism)
    needs: Needs = EVERYTHING
    task: Task = "causal_lm"
    _docs: Any = field(default=None, repr=False)
    _order: Any = field(default=None, repr=False)
    _pad: int = field(default=0, repr=False)

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.dp

    def documents(self) -> list[list[int]]:
        """Each document's ids and the EOS, truncated to seq_len; read and checked on first use."""
        if self._docs is None:
            docs, tok = read_documents(self.path, self.split, self.text, self.tokenizer)
            if len(docs) < self.global_batch:
                raise ValueError(f"dataset {self.path} holds {len(docs)} documents, fewer than one global batch "
                                 f"(global_batch = {self.global_batch}) with packing = false")
            eos = tok.separator_id()
            self._docs = [(d + [eos])[: self.seq_len] for d in docs]
            self._pad = tok.pad_id
            self._order = _Order(len(self._docs), self.seed)
        return self._docs

    def batch(self, step: int, dp_rank: int, device: torch.device | str = "cpu") -> Batch:
        if not (self.mask or self.needs.inputs or self.needs.labels):
            return self._assemble(None, None, None, device)  # a middle stage without a mask: nothing is read
        docs = self.documents()
        start = step * self.global_batch + dp_rank * self.batch_size
        picked = [docs[i] for i in self._order.items(range(start, start + self.batch_size))]
        s = self.seq_len
        ids = torch.full((self.batch_size, s), self._pad, dtype=torch.long)
        labels = torch.full((self.batch_size, s), IGNORE_INDEX, dtype=torch.long)
        mask = torch.zeros((self.batch_size, s), dtype=torch.long)
        for r, row in enumerate(picked):
            t = torch.tensor(row, dtype=torch.long)
            ids[r, : len(row)] = t
            labels[r, : len(row)] = t
            mask[r, : len(row)] = 1
        if self.vocab_size is not None and int(ids.max()) >= self.vocab_size:
            raise ValueError(f"dataset {self.path}: the tokenizer in {self.tokenizer} gives id {int(ids.max())}, "
                             f"outside the model's vocabulary (vocab_size = {self.vocab_size})")
        return self._assemble(ids, labels, mask if self.mask else None, device)
