"""Classification examples from a JSON-lines or CSV file, or a table (``jsonl`` / ``csv`` /
``hf_dataset`` for a classifier): each text tokenized, truncated and right-padded to ``seq_len``,
with an attention mask and its integer label, read in the order of `runtime.data.order`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ppdsl.runtime.data.batch import EVERYTHING, Batch, DataSource, Needs, Task
from ppdsl.runtime.data.file_checks import _regular_file
from ppdsl.runtime.data.order import _Order
from ppdsl.runtime.data.tokenizer import _Tokenizer


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



__all__ = ("ExampleData",)
