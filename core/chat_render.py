"""Conversations rendered for chat fine-tuning, written once for check (which renders its sample
to count what seq_len cuts and the windows packing makes) and the ranks (runtime/data/chat.py).

- `ChatTokenizer`: a local tokenizer directory and a chat template; ``encode`` gives a
  conversation's token ids and its labels, the ids on the assistant's tokens and -100 elsewhere.
- `conversation_problem`: why a row's field is not a conversation (None when it is).
- `pack_whole`: conversations packed whole into windows of ``seq_len`` tokens.

transformers is imported only when a tokenizer is loaded.
"""

from __future__ import annotations

import os
import re
from typing import Any

from .task_loss import IGNORE_INDEX

__all__ = ["ChatTokenizer", "conversation_problem", "messages_of", "pack_whole"]

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


def conversation_problem(value: Any) -> str | None:
    """Why a row's messages field is not a conversation ("is not ...", "holds ...", "has ..."), or
    None: a non-empty list of {role, content} strings with an assistant turn."""
    if not isinstance(value, list) or not value:
        return "is not a non-empty list of {role, content}"
    if not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
               for m in value):
        return "holds a message that is not {\"role\": string, \"content\": string}"
    if not any(m["role"] == "assistant" for m in value):
        return "has no assistant turn (nothing to learn)"
    return None


def messages_of(value: Any, where: str) -> list[dict[str, Any]]:
    """A row's conversation; ValueError naming the row (`where`) for anything else."""
    why = conversation_problem(value)
    if why is not None:
        raise ValueError(f"{where}: the messages field {why}")
    return value


def pack_whole(lengths: list[int], seq_len: int) -> list[list[int]]:
    """Conversations (their token counts, each at most seq_len: truncated first) packed whole into
    windows, in reading order: a window takes the next conversation while it fits, else the next
    window begins with it. Each window is the indices of its conversations; a conversation never
    spans two windows (the rest of a window is padding)."""
    windows: list[list[int]] = []
    used = 0
    for i, n in enumerate(lengths):
        if not windows or used + n > seq_len:
            windows.append([])
            used = 0
        windows[-1].append(i)
        used += n
    return windows


