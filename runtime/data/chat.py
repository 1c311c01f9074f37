"""Conversations for supervised fine-tuning: ``hf_dataset(path, tokenizer, messages = "messages")``
on a causal LM. Each row's `messages` field is a list of ``{"role": ..., "content": ...}``; it is
rendered by a chat template (the one the spec names with ``chat_template = "file.jinja"``, else
the tokenizer's own, from its local directory: nothing is downloaded) through transformers'
``apply_chat_template``, and tokenized as transformers does (no special tokens added: the template
writes them).

Loss only on the assistant's tokens: every label is -100 (HF's ignore index) except those of the
assistant's turns, found

- where the template marks them with ``{% generation %} ... {% endgeneration %}``, by that mask
  (``return_assistant_tokens_mask``);
- otherwise by rendering prefixes of the conversation: turn ``i`` of the assistant runs from the
  end of ``messages[:i]`` rendered with the generation prompt to the end of ``messages[:i + 1]``
  (so the template's end-of-turn text after the content counts: the model learns to stop; an
  assistant speaking first: from its content); a
  token is the assistant's when its first character lies in such a span (character offsets of
  the rendered text, so a token merged across a boundary is not miscounted).

Each conversation's tokens are truncated to ``seq_len`` (a longer conversation loses its tail:
the truncation policy; check says how many of its sample are cut). Then:

- by default (``train.packing`` not written, or ``none``): one sample per conversation,
  right-padded with the tokenizer's pad id, labels -100 on the padding, and the attention mask
  (left out under context parallelism, as for padded documents: right padding under causal
  attention changes nothing for the real tokens);
- ``train.packing = documents``: conversations packed whole into windows of ``seq_len`` tokens in
  reading order (`ppdsl.core.chat_render.pack_whole`: none is split over two windows; the rest of
  a window is padding), each conversation's position ids restarting at 0 (the padding's too), from
  which the model's mask builders keep attention inside each conversation, as for packed
  documents; no attention mask. The first token of each conversation is no target (label -100):
  nothing predicts a conversation from the one before it. The windows are the samples.

Loss normalisation: per token over the whole global batch. Each step's global batch holds
``N`` counted targets (labels != -100 after the shift to next-token targets, over every
replica's samples); each microbatch's loss is the sum of its counted tokens' losses divided by
``N / (microbatches * dp)`` (`Batch.token_divisor`), so that after the executor's division by
the microbatches and the data-parallel mean of the gradients the step's loss and gradients are
those of ``sum / N``: what one process computes over the global batch. N is known when the
batch is drawn (every rank renders all conversations and counts the global batch's labels
itself, without communication), before the first backward. Packing changes the samples, not the
normalisation.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ppdsl.core.chat_render import ChatTokenizer, messages_of, pack_whole
from ppdsl.core.task_loss import IGNORE_INDEX

from ppdsl.runtime.data.batch import Batch, DataSource, EVERYTHING, Needs, Task
from ppdsl.runtime.data.order import _Order
from ppdsl.runtime.data.rows import check_vocabulary, dataset_errors, padded_samples

__all__ = ["ChatData", "read_conversations"]


def read_conversations(path: str, split: str | None, messages: str, tokenizer: str,
                       template: str | None) -> tuple[list[tuple[list[int], list[int]]], ChatTokenizer]:
    """Every row's (ids, labels), in reading order, and the tokenizer. ValueError naming the file
    (and row) for anything unreadable."""
    from ppdsl.core.tables import find_table, iter_rows, row_place

    text = None
    if template is not None:
        try:
            with open(template, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"chat template {template}: {exc}") from None
    tok = ChatTokenizer(tokenizer, text)
    out = []
    with dataset_errors():
        table = find_table(path, split)
        for file, number, (conv,) in iter_rows(table, {"messages": messages}, strings=()):
            where = row_place(table, file, number)
            try:
                out.append(tok.encode(messages_of(conv, where)))
            except ValueError:
                raise
            except Exception as exc:  # noqa: BLE001 - a template error (raise_exception) on the user's row
                raise ValueError(f"{where}: the chat template fails: {type(exc).__name__}: {exc}") from None
    if not out:
        raise ValueError(f"hf_dataset {path}: no conversation (field '{messages}')")
    return out, tok


@dataclass
class ChatData(DataSource):
    """Conversations, one padded sample each or packed whole into windows, the loss on the
    assistant's tokens, normalised over the global batch's counted tokens (see the module
    docstring)."""

    path: str
    tokenizer: str
    split: str | None
    messages: str
    template: str | None
    seed: int
    seq_len: int
    batch_size: int
    microbatch_size: int
    dp: int
    vocab_size: int | None
    mask: bool = True  # give the attention mask (False under context parallelism)
    packed: bool = False  # train.packing = documents: whole conversations per window, positions restarting
    needs: Needs = EVERYTHING
    task: Task = "causal_lm"
    _rows: Any = field(default=None, repr=False)
    _samples: Any = field(default=None, repr=False)
    _counted: Any = field(default=None, repr=False)
    _order: Any = field(default=None, repr=False)
    _pad: int = field(default=0, repr=False)

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.dp

    def conversations(self) -> list[tuple[list[int], list[int]]]:
        """Each conversation's (ids, labels), truncated to seq_len; read and checked on first use,
        with the samples they make."""
        if self._rows is None:
            rows, tok = read_conversations(self.path, self.split, self.messages, self.tokenizer, self.template)
            rows = [(ids[: self.seq_len], labels[: self.seq_len]) for ids, labels in rows]
            self._samples = (pack_whole([len(ids) for ids, _ in rows], self.seq_len) if self.packed
                             else [[i] for i in range(len(rows))])
            if len(self._samples) < self.global_batch:
                what = (f"{len(rows)} conversations, packed whole into {len(self._samples)} windows of seq_len = "
                        f"{self.seq_len} tokens" if self.packed else f"{len(rows)} conversations")
                raise ValueError(f"dataset {self.path} holds {what}, fewer than one global batch "
                                 f"(global_batch = {self.global_batch})")
            self._rows = rows
            self._pad = tok.pad_id
            # counted next-token targets of each sample: labels != -100 after the shift; a
            # conversation's first token is never one (`_labels`)
            self._counted = [sum(len(lab[1:]) - lab[1:].count(IGNORE_INDEX) for lab in (rows[i][1] for i in sample))
                             for sample in self._samples]
            self._order = _Order(len(self._samples), self.seed)
        return self._rows

    def count(self) -> int:
        """The samples: conversations, or windows when packed."""
        self.conversations()
        return len(self._samples)

    def counted(self, items: list[int]) -> int:
        """The counted next-token targets of samples `items`."""
        self.conversations()
        return sum(self._counted[i] for i in items)

    def global_tokens(self, step: int) -> int:
        """N: the counted targets of step `step`'s whole global batch (every replica's samples)."""
        self.conversations()
        start = step * self.global_batch
        return self.counted(self._order.items(range(start, start + self.global_batch)))

    def divisor(self, global_tokens: int) -> float:
        """What each microbatch's summed token losses are divided by (see the module docstring);
        a global batch without any assistant token: loss 0 (sum 0 over divisor 1), no gradient."""
        return max(global_tokens, 1) / (self.batch_size // self.microbatch_size * self.dp)

    def batch(self, step: int, dp_rank: int, device: torch.device | str = "cpu") -> Batch:
        self.conversations()
        start = step * self.global_batch + dp_rank * self.batch_size
        ids, labels, mask, positions = self.read(self._order.items(range(start, start + self.batch_size)))
        batch = self._assemble(ids, labels, mask, device, position_ids=positions)
        return replace(batch, token_divisor=self.divisor(self.global_tokens(step)))

    def read(self, items: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Samples `items`: ids, labels, and the attention mask (one conversation each, unless
        under cp) or the position ids (packed)."""
        rows = self.conversations()
        s = self.seq_len
        ids, labels, mask = padded_samples(len(items), s, self._pad)
        positions = torch.zeros((len(items), s), dtype=torch.long)
        for r, sample in enumerate(self._samples[i] for i in items):
            at = 0
            for i in sample:
                row, lab = rows[i]
                n = len(row)
                ids[r, at : at + n] = torch.tensor(row, dtype=torch.long)
                labels[r, at + 1 : at + n] = torch.tensor(lab[1:], dtype=torch.long)
                positions[r, at : at + n] = torch.arange(n)
                at += n
            mask[r, :at] = 1
            positions[r, at:] = torch.arange(s - at)
        check_vocabulary(ids, self.vocab_size, self.path, self.tokenizer)
        if self.packed:
            return ids, labels, None, positions
        return ids, labels, mask if self.mask else None, None
