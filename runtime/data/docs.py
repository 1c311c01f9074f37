"""Documents for a causal language model: ``hf_dataset(path, tokenizer, ...)`` on a model that is
not a classifier. The rows (Parquet, Arrow, a save_to_disk directory or JSON lines, read by
`ppdsl.core.tables`) are streamed once into the token cache (`runtime.data.cache`: each
document's `text` tokenized without special tokens and followed by the separator, documents
without any token skipped), which every rank then memory-maps; a later start maps it without
tokenizing. Each replica touches only the windows or documents of its own samples. Then:

- ``packing = true`` (the default): the documents one after another, each followed by the
  tokenizer's end-of-sequence token (`ppdsl.core.special_tokens`: eos_token, else sep_token),
  cut into ``len // seq_len`` windows of ``seq_len`` tokens, exactly as a token file is
  (`runtime.data.files.TokenData`: the same order, replica slices and readers). A window may
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

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


from ppdsl.runtime.data.batch import Batch, DataSource, EVERYTHING, Needs, Task
from ppdsl.runtime.data.cache import Tokenized, Writer, cached_tokens
from ppdsl.runtime.data.files import TEXT_CHUNK, TokenData
from ppdsl.runtime.data.order import _Order
from ppdsl.runtime.data.rows import check_vocabulary, dataset_errors, padded_samples
from ppdsl.runtime.data.tokenizer import _Tokenizer

__all__ = ["PackedDocuments", "PaddedDocuments", "document_positions", "read_documents"]


def read_documents(path: str, split: str | None, text: str, tokenizer: str) -> Tokenized:
    """The token ids of every document with at least one token, in reading order, each followed
    by the separator: from the token cache (`runtime.data.cache`), tokenized into it first if
    needed. ValueError naming the file for anything unreadable."""
    from ppdsl.core.tables import find_table

    with dataset_errors():
        table = find_table(path, split)
    fields = {"kind": "documents", "split": split, "text": text}
    return cached_tokens(path, table.files, tokenizer, fields, lambda out: _tokenize(table, path, text, tokenizer, out))


def _tokenize(table: Any, path: str, text: str, tokenizer: str, out: Writer) -> dict[str, Any]:
    """The documents streamed in chunks of at least TEXT_CHUNK characters, one tokenizer call
    each; the corpus is never held whole."""
    from ppdsl.core.tables import iter_rows

    tok = _Tokenizer(tokenizer)
    out.begin(tok.vocab_size)
    sep: list[int] = []
    chunk: list[str] = []
    size = 0

    def flush() -> None:
        docs = [ids for ids in tok.encode(chunk, special=False) if ids]
        if docs and not sep:
            sep.append(tok.separator_id())
        out.add([ids + sep for ids in docs])

    with dataset_errors():
        for _, _, (t,) in iter_rows(table, {"text": text}):
            chunk.append(t)
            size += len(t)
            if size >= TEXT_CHUNK:
                flush()
                chunk, size = [], 0
    flush()
    if not out.documents:
        raise ValueError(f"hf_dataset {path}: no document has any token (field '{text}')")
    return {"separator": sep[0], "pad_id": tok.pad_id}


@dataclass
class PackedDocuments(TokenData):
    """``packing = true`` / ``"windows"``: the documents, each followed by the EOS, as one token
    stream; ``"documents"``: the same windows with each token's position in its document."""

    tokenizer: str = ""
    split: str | None = None
    text: str = "text"
    documents: bool = False  # packing = "documents": position ids restarting at each document
    what = "dataset"
    mapped = False
    _starts: Any = field(default=None, repr=False)

    @property
    def mask(self) -> bool:
        """Whether every rank reads the samples (`runtime.data.mix`): the position ids are."""
        return self.documents

    def _load(self) -> Any:
        docs = read_documents(self.path, self.split, self.text, self.tokenizer)
        self._starts = docs.starts
        return docs.tokens

    def batch(self, step: int, dp_rank: int, device: torch.device | str = "cpu") -> Batch:
        if not self.documents:
            return super().batch(step, dp_rank, device)
        self.tokens()  # every rank: each stage's blocks build their masks from the positions
        start = step * self.global_batch + dp_rank * self.batch_size
        ids, labels, _, positions = self.read(self._order.items(range(start, start + self.batch_size)))
        return self._assemble(ids, labels, None, device, position_ids=positions)

    def read(self, items: Sequence[int]) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        """The windows `items`: ids, labels, no mask, and with ``documents`` the position ids."""
        ids, labels, mask = super().read(items)
        if not self.documents:
            return ids, labels, mask
        return ids, labels, mask, document_positions(self._starts, [int(i) * self.seq_len for i in items], self.seq_len)


def document_positions(starts: Any, window_starts: Sequence[int], seq_len: int) -> torch.Tensor:
    """[windows, seq_len] int64: each token's offset from the start of its document, or from the
    window's start for the document the window cuts into (`starts`: the cache's document starts,
    each document's tokens ending with its EOS). The EOS keeps its document's position; the token
    after it is 0."""
    import numpy as np

    t = np.asarray(window_starts, dtype=np.int64)[:, None] + np.arange(seq_len, dtype=np.int64)[None, :]
    doc = np.searchsorted(np.asarray(starts), t, side="right") - 1
    begin = np.maximum(np.asarray(starts)[doc], t[:, :1])
    return torch.from_numpy(t - begin)


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

    def documents(self) -> Tokenized:
        """Each document's ids and the EOS (truncated to seq_len when read); mapped and checked
        on first use."""
        if self._docs is None:
            docs = read_documents(self.path, self.split, self.text, self.tokenizer)
            if docs.documents < self.global_batch:
                raise ValueError(f"dataset {self.path} holds {docs.documents} documents, fewer than one global batch "
                                 f"(global_batch = {self.global_batch}) with packing = false")
            self._docs = docs
            self._pad = int(docs.meta["pad_id"])
            self._order = _Order(docs.documents, self.seed)
        return self._docs

    def batch(self, step: int, dp_rank: int, device: torch.device | str = "cpu") -> Batch:
        if not (self.mask or self.needs.inputs or self.needs.labels):
            return self._assemble(None, None, None, device)  # a middle stage without a mask: nothing is read
        self.documents()
        start = step * self.global_batch + dp_rank * self.batch_size
        return self._assemble(*self.read(self._order.items(range(start, start + self.batch_size))), device)

    def count(self) -> int:
        return int(self.documents().documents)

    def read(self, items: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The documents `items`, padded: ids, labels (-100 on the padding), the mask (or None)."""
        docs = self.documents()
        picked = [docs.document(i)[: self.seq_len].astype("int64") for i in items]  # only this replica's documents
        s = self.seq_len
        ids, labels, mask = padded_samples(len(picked), s, self._pad)
        for r, row in enumerate(picked):
            t = torch.from_numpy(row)
            ids[r, : len(row)] = t
            labels[r, : len(row)] = t
            mask[r, : len(row)] = 1
        check_vocabulary(ids, self.vocab_size, self.path, self.tokenizer)
        return ids, labels, mask if self.mask else None
