"""Source/target pairs for an encoder-decoder model (T5, BART: the plan's task `seq2seq_lm`):
``hf_dataset(path, tokenizer, text = "source", target = "target")``. The rows (JSON lines, CSV,
Parquet, Arrow or a ``datasets`` save_to_disk directory, read by `ppdsl.core.tables`) are read
and tokenized whole on first use, as HF's seq2seq examples tokenize them: the source with the
tokenizer's special tokens (``tokenizer(text=...)``), the target likewise, through
``text_target=`` where transformers' AutoTokenizer loaded the tokenizer (a tokenizer.json read by
the `tokenizers` library has no target mode: its targets are encoded as texts). Then per sample:

- ``input_ids``: the source truncated to ``seq_len``, right-padded with the tokenizer's pad id;
  the ``attention_mask`` marks its real tokens (the encoder's padding mask, which the decoder's
  cross-attention also reads);
- ``labels``: the target truncated to ``seq_len``, right-padded with -100 (HF's ignore index:
  no loss there). The stages make the decoder's input from them by the model's own rule
  (``prepare_decoder_input_ids_from_labels``: shifted right, ``decoder_start_token_id`` first,
  -100 made the pad id), and its causal attention keeps the padded tail from the real positions.

A row whose target gives no token is refused when the data is read (a microbatch of such rows
would have no target to average over).

Loss normalisation: each microbatch's mean over its counted target tokens (HF's convention, what
the stages' task loss computes). Verify's single-process reference computes the same means over
the same microbatches (runtime/verify/reference.py), so parallel and one process agree with padding too.

Order: sample ``g`` of the run is row ``perm_e[g % n]`` of epoch ``e = g // n``
(`runtime.data.order._Order`), a pure function of (seed, step, data-parallel rank) as for every
file source.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


from ppdsl.runtime.data.batch import EVERYTHING, Batch, DataSource, Needs, Task
from ppdsl.runtime.data.order import _Order
from ppdsl.runtime.data.rows import dataset_errors, padded_samples
from ppdsl.runtime.data.tokenizer import _Tokenizer

__all__ = ["PairData", "read_pairs"]


def read_pairs(path: str, split: str | None, text: str, target: str) -> list[tuple[str, str, str]]:
    """Every row's (source, target, where), in reading order. ValueError naming the file (and
    row) for anything unreadable."""
    from ppdsl.core.tables import find_table, iter_rows, row_place

    with dataset_errors():
        table = find_table(path, split)
        rows = [(s, t, row_place(table, f, n))
                for f, n, (s, t) in iter_rows(table, {"text": text, "target": target}, strings=("text", "target"))]
    return rows


@dataclass
class PairData(DataSource):
    """One sample per row: padded source ids and mask, target labels with a -100 tail."""

    path: str
    tokenizer: str
    split: str | None
    text: str
    target: str
    seed: int
    seq_len: int
    batch_size: int
    microbatch_size: int
    dp: int
    vocab_size: int | None
    needs: Needs = EVERYTHING
    task: Task = "seq2seq"
    mask = True  # the samples carry the encoder's padding mask, which every rank reads (runtime.data.mix)
    _rows: Any = field(default=None, repr=False)
    _order: Any = field(default=None, repr=False)
    _pad: int = field(default=0, repr=False)

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.dp

    def pairs(self) -> list[tuple[list[int], list[int]]]:
        """Each row's (source ids, target ids), truncated to seq_len; read and checked on first use."""
        if self._rows is None:
            rows = read_pairs(self.path, self.split, self.text, self.target)
            if len(rows) < self.global_batch:
                raise ValueError(f"dataset {self.path} holds {len(rows)} pairs, fewer than one global batch "
                                 f"(global_batch = {self.global_batch})")
            tok = _Tokenizer(self.tokenizer, max_length=self.seq_len)
            sources = tok.encode([s for s, _, _ in rows], special=True)
            targets = tok.encode_targets([t for _, t, _ in rows])
            for (_, _, where), ids in zip(rows, targets):
                if not ids:
                    raise ValueError(f"{where}: the target field '{self.target}' gives no token")
            top = max(max(ids, default=0) for ids in (*sources, *targets))
            if self.vocab_size is not None and top >= self.vocab_size:
                raise ValueError(f"dataset {self.path}: the tokenizer in {self.tokenizer} gives id {top}, outside "
                                 f"the model's vocabulary (vocab_size = {self.vocab_size})")
            s = self.seq_len
            self._rows = [(a[:s], b[:s]) for a, b in zip(sources, targets)]
            self._pad = tok.pad_id
            self._order = _Order(len(self._rows), self.seed)
        return self._rows

    def count(self) -> int:
        return len(self.pairs())

    def batch(self, step: int, dp_rank: int, device: torch.device | str = "cpu") -> Batch:
        self.pairs()
        start = step * self.global_batch + dp_rank * self.batch_size
        return self._assemble(*self.read(self._order.items(range(start, start + self.batch_size))), device)

    def read(self, items: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows `items`: padded source ids, target labels with a -100 tail, the source's mask."""
        rows = self.pairs()
        s = self.seq_len
        ids, labels, mask = padded_samples(len(items), s, self._pad)
        for r, (source, target) in enumerate(rows[i] for i in items):
            ids[r, : len(source)] = torch.tensor(source, dtype=torch.long)
            mask[r, : max(1, len(source))] = 1  # at least one position attends (an empty source)
            labels[r, : len(target)] = torch.tensor(target, dtype=torch.long)
        return ids, labels, mask
