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

One sample per conversation: its tokens truncated to ``seq_len`` (a longer conversation loses
its tail, the truncation policy; check says how many of its sample are cut), right-padded with
the tokenizer's pad id, labels -100 on the padding, and the attention mask (left out under
context parallelism, as for padded documents: right padding under causal attention changes
nothing for the real tokens).

Loss normalisation: per token over the whole global batch. Each step's global batch holds
``N`` counted targets (labels != -100 after the shift to next-token targets, over every
replica's samples); each microbatch's loss is the sum of its counted tokens' losses divided by
``N / (microbatches * dp)`` (`Batch.token_divisor`), so that after the executor's division by
the microbatches and the data-parallel mean of the gradients the step's loss and gradients are
those of ``sum / N``: what one process computes over the global batch. N is known when the
batch is drawn (every rank renders all conversations and counts the global batch's labels
itself, without communication), before the first backward.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from ppdsl.core.task_loss import IGNORE_INDEX

from .data import Batch, DataSource, EVERYTHING, Needs, Task
from .data_files import _Order

__all__ = ["ChatData", "ChatTokenizer", "read_conversations"]

GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


class ChatTokenizer:
    """A local tokenizer directory with a chat template (`template`: a template's text that
    replaces the tokenizer's own). ValueError when it cannot be loaded or has no template."""

    def __init__(self, directory: str, template: str | None = None) -> None:
        if not os.path.isdir(directory):
            raise ValueError(f"tokenizer directory {directory} does not exist")
        try:
            from transformers import AutoTokenizer

            self.tok: Any = AutoTokenizer.from_pretrained(directory, local_files_only=True)
        except Exception as exc:  # noqa: BLE001 - any failure to load is the user's file: say which
            raise ValueError(f"cannot load the tokenizer in {directory}: {type(exc).__name__}: {exc}") from None
        self.template = template if template is not None else self.tok.chat_template
        if not isinstance(self.template, str) or not self.template:
            raise ValueError(f"the tokenizer in {directory} has no chat template (chat_template in "
                             "tokenizer_config.json, or chat_template.jinja), and the data source names none "
                             "(chat_template = \"template.jinja\")")
        self.directory = directory
        self.marked = bool(GENERATION.search(self.template))

    @property
    def pad_id(self) -> int:
        for t in (self.tok.pad_token_id, self.tok.eos_token_id, self.tok.unk_token_id):
            if t is not None:
                return int(t)
        return 0

    def render(self, messages: list[dict[str, Any]], prompt: bool = False) -> str:
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt,
                                           chat_template=self.template)

    def encode(self, messages: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
        """(token ids, labels): the labels are the ids on the assistant's tokens, -100 elsewhere."""
        if self.marked:
            out = self.tok.apply_chat_template(messages, tokenize=True, return_dict=True,
                                               return_assistant_tokens_mask=True, chat_template=self.template)
            ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
        else:
            ids, mask = self._by_prefixes(messages)
        return ids, [t if m else IGNORE_INDEX for t, m in zip(ids, mask)]

    def _opening(self, before: list[dict[str, Any]], turn: dict[str, Any]) -> str:
        """The conversation before an assistant turn, rendered with the generation prompt; for an
        assistant speaking first, its rendered turn up to its content."""
        if before:
            return self.render(before, prompt=True)
        first = self.render([turn])
        at = first.find(turn["content"])
        return first[:at] if at > 0 else ""

    def _by_prefixes(self, messages: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
        full = self.render(messages)
        spans = []
        for i, m in enumerate(messages):
            if m.get("role") != "assistant":
                continue
            start = self._opening(messages[:i], m)
            end = self.render(messages[: i + 1])
            if not full.startswith(start):
                raise ValueError("the chat template does not render a conversation's beginning as a prefix of the "
                                 "whole; mark the assistant's turns with {% generation %} ... {% endgeneration %}")
            if full.startswith(end):
                stop = len(end)
            else:  # a template that renders the last turn differently: up to the end of the content
                content = m["content"]
                at = full.find(content, len(start))
                if at < 0:
                    raise ValueError("cannot find an assistant turn in the rendered conversation; mark the "
                                     "assistant's turns with {% generation %} ... {% endgeneration %}")
                stop = at + len(content)
            spans.append((len(start), stop))
        enc = self.tok(full, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        mask = [int(any(a <= s < b for a, b in spans) and e > s) for s, e in enc["offset_mapping"]]
        return ids, mask


def _messages(value: Any, where: str) -> list[dict[str, Any]]:
    """A row's conversation; ValueError naming the row for anything else."""
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: the messages field is not a non-empty list of {{role, content}}")
    for m in value:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"{where}: a message is not {{\"role\": string, \"content\": string}}")
    if not any(m["role"] == "assistant" for m in value):
        raise ValueError(f"{where}: the conversation has no assistant turn (nothing to learn)")
    return value


def read_conversations(path: str, split: str | None, messages: str, tokenizer: str,
                       template: str | None) -> tuple[list[tuple[list[int], list[int]]], ChatTokenizer]:
    """Every row's (ids, labels), in reading order, and the tokenizer. ValueError naming the file
    (and row) for anything unreadable."""
    from ppdsl.core.tables import TableError, find_table, iter_rows, row_place

    text = None
    if template is not None:
        try:
            with open(template, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"chat template {template}: {exc}") from None
    tok = ChatTokenizer(tokenizer, text)
    out = []
    try:
        table = find_table(path, split)
        for file, number, (conv,) in iter_rows(table, {"messages": messages}, strings=()):
            where = row_place(table, file, number)
            try:
                out.append(tok.encode(_messages(conv, where)))
            except ValueError:
                raise
            except Exception as exc:  # noqa: BLE001 - a template error (raise_exception) on the user's row
                raise ValueError(f"{where}: the chat template fails: {type(exc).__name__}: {exc}") from None
    except TableError as exc:
        raise ValueError(f"hf_dataset: {exc}") from None
    if not out:
        raise ValueError(f"hf_dataset {path}: no conversation (field '{messages}')")
    return out, tok


@dataclass
class ChatData(DataSource):
    """One padded sample per conversation, the loss on the assistant's tokens, normalised over
    the global batch's counted tokens (see the module docstring)."""

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
    needs: Needs = EVERYTHING
    task: Task = "causal_lm"
    _rows: Any = field(default=None, repr=False)
    _counted: Any = field(default=None, repr=False)
    _order: Any = field(default=None, repr=False)
    _pad: int = field(default=0, repr=False)

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.dp

    def conversations(self) -> list[tuple[list[int], list[int]]]:
        """Each conversation's (ids, labels), truncated to seq_len; read and checked on first use."""
        if self._rows is None:
            rows, tok = read_conversations(self.path, self.split, self.messages, self.tokenizer, self.template)
            if len(rows) < self.global_batch:
                raise ValueError(f"dataset {self.path} holds {len(rows)} conversations, fewer than one global batch "
                                 f"(global_batch = {self.global_batch})")
            self._rows = [(ids[: self.seq_len], labels[: self.seq_len]) for ids, labels in rows]
            # counted next-token targets of each sample: labels != -100 after the shift (position 0 never is one)
            self._counted = [sum(1 for t in labels[1:] if t != IGNORE_INDEX) for _, labels in self._rows]
            self._pad = tok.pad_id
            self._order = _Order(len(self._rows), self.seed)
        return self._rows

    def global_tokens(self, step: int) -> int:
        """N: the counted targets of step `step`'s whole global batch (every replica's samples)."""
        self.conversations()
        start = step * self.global_batch
        return sum(self._counted[i] for i in self._order.items(range(start, start + self.global_batch)))

    def batch(self, step: int, dp_rank: int, device: torch.device | str = "cpu") -> Batch:
        rows = self.conversations()
        start = step * self.global_batch + dp_rank * self.batch_size
        picked = [rows[i] for i in self._order.items(range(start, start + self.batch_size))]
        s = self.seq_len
        ids = torch.full((self.batch_size, s), self._pad, dtype=torch.long)
        labels = torch.full((self.batch_size, s), IGNORE_INDEX, dtype=torch.long)
        mask = torch.zeros((self.batch_size, s), dtype=torch.long)
        for r, (row, lab) in enumerate(picked):
            ids[r, : len(row)] = torch.tensor(row, dtype=torch.long)
            labels[r, : len(row)] = torch.tensor(lab, dtype=torch.long)
            mask[r, : len(row)] = 1
        if self.vocab_size is not None and int(ids.max()) >= self.vocab_size:
            raise ValueError(f"dataset {self.path}: the tokenizer in {self.tokenizer} gives id {int(ids.max())}, "
                             f"outside the model's vocabulary (vocab_size = {self.vocab_size})")
        microbatches = self.batch_size // self.microbatch_size
        # a global batch without any assistant token: loss 0 (sum 0 over divisor 1), no gradient
        divisor = max(self.global_tokens(step), 1) / (microbatches * self.dp)
        batch = self._assemble(ids, labels, mask if self.mask else None, device)
        return Batch(batch.input_ids, batch.labels, batch.attention_mask, batch.token_type_ids, token_divisor=divisor)
