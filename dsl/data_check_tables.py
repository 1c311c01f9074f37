"""check of `hf_dataset(...)`: the table its path names, read as the ranks will read it
(`ppdsl.core.tables`), but bounded.

A mixin of `data_check`'s checker: it reads `spec`, `opts`, `roots`, `classification`,
`tokenizer_doc`, `span`, and reports through `err`, `unreadable`, `too_little`, `malformed`,
`bad_tokenizer`, `_class_label` (data_check_examples), `global_batch` and `needed`.

What it reads: which files the path names (a glob's matches, a directory's listing, a
save_to_disk directory's dataset_dict.json and state.json); of every file the schema and the
row count (a Parquet footer; an Arrow file's record batch headers, memory-mapped; a JSON-lines
or CSV file's rows, up to one global batch of them); the values of the first `SAMPLE_ROWS` rows in
reading order (the text field a string, a classifier's label a class id, an encoder-decoder's
`target` a string); for a causal LM, that
the tokenizer has a token to put between documents. pyarrow is imported only for a Parquet or
Arrow file, never for the rest of check.
"""

from __future__ import annotations

import json
import os
from typing import Any

from ppdsl.core.locate import outside
from ppdsl.core.special_tokens import COMMON_EOS, document_separator
from ppdsl.core.task_loss import IGNORE_INDEX

from .data_quote import HEAD_LINES, MAX_LINE, names, show
from .diagnostics import error, note
from .resolve.located import missing_error, outside_error

SAMPLE_ROWS = HEAD_LINES  # rows whose values check reads: the first 1,000, in reading order


class TableChecks:
    def _hf_dataset(self, path: str) -> None:
        from ppdsl.core.tables import TableError, count_rows, find_table, iter_rows, require_columns, row_place

        base = os.path.dirname(os.path.abspath(self.spec.file))
        written = os.path.relpath(path, base)
        text, label = self.opts.get("text") or "text", self.opts.get("label") or "label"
        fields = {"text": text, "label": label} if self.classification else {"text": text}
        pairs = self.opts.get("target") is not None and not self.classification  # E0442 (input_check) on a classifier
        if pairs:
            fields = {"text": text, "target": self.opts["target"]}
        chat = self.opts.get("messages")
        if chat is not None:
            if not self._chat_template():
                return
            fields = {"messages": chat}
        gb = self.global_batch() or 0
        try:
            table = find_table(path, self.opts.get("split"), show, None if written.startswith("..") else written)
            if self.roots is not None:
                for f in table.files:
                    if outside(f, self.roots):
                        self.out.append(outside_error(self.span("path"), f"'{show(f)}'", "the dataset's directory"))
                        return
            total, need = 0, max(gb, 1)
            strings = () if chat else ("text", "target") if pairs else ("text",)
            for f in table.files:  # every file's schema and row count
                if require_columns(table, f, fields, strings, show) is not None:
                    total += count_rows(table, f, show)
                elif total < need:  # JSON lines, CSV: counted up to one global batch
                    total += count_rows(table, f, show, limit=need - total, max_line=MAX_LINE)
            conversations: list[tuple[Any, str]] = []
            for f, number, values in iter_rows(table, fields, show, limit=SAMPLE_ROWS, max_line=MAX_LINE,
                                               strings=strings):
                if chat is not None:
                    conversations.append((values[0], row_place(table, f, number, show)))
                    if not self._conversation(*conversations[-1]):
                        return
                    continue
                if self.classification and not self._class_label(values[1], row_place(table, f, number, show)):
                    return
        except TableError as exc:
            self._table_error(exc)
            return
        if total == 0:
            self.too_little(f"{table.what} holds no rows", hint="it must hold at least one global batch")
        elif (self.classification or chat or pairs or self.opts.get("packing") is False) and gb and total < gb:
            what = ("examples" if self.classification else "conversations (one sample each, or fewer packed)" if chat
                    else "source/target pairs" if pairs else "documents (one sample each with packing = false)")
            self.too_little(f"{table.what} holds {total} {what}, fewer than {self.needed()} (global_batch = {gb})",
                            hint="use more data or a smaller global_batch"
                                 + ("" if self.classification or pairs or chat else ", or packing = true"))
            gb = 0  # said once: no second E0414 for the packed windows
        if not self.classification and chat is None and not pairs:
            self._separator()
        if chat is not None and conversations and total > 0 and self.render:
            self._chat_sample(conversations, gb, table.what)

    # ---- conversations (messages = "field"): runtime/data/chat.py renders and masks them
    def _chat_template(self) -> bool:
        """A chat template: the file the spec names (chat_template = "x.jinja"), else the
        tokenizer's own. E0433 at the data call when there is none."""
        if self.classification:
            return False  # E0418 (data_check._task)
        named = self.opts.get("chat_template")
        if named is not None:
            if not self._exists(named, "chat_template", f"chat template '{show(named)}'",
                                "a Jinja file of the template; relative paths are relative to the spec's directory"):
                return False
            if not os.path.isfile(named):
                self.unreadable("chat_template", f"chat template '{show(named)}' is not a regular file",
                                hint="name the .jinja file that holds the template")
                return False
            return True
        directory = self.opts.get("tokenizer")
        if not isinstance(directory, str) or self.tokenizer_doc is None and not os.path.isfile(
                os.path.join(directory, "tokenizer_config.json")) or has_chat_template(directory):
            return True  # no usable tokenizer: E0410 or E0415 already
        self.out.append(error(
            "E0433", self.call, f"the tokenizer in '{show(directory)}' has no chat template to render the "
            "conversations with", label="conversations need a chat template",
            hint="name one with chat_template = \"template.jinja\", or use a tokenizer whose tokenizer_config.json "
                 "holds a chat_template (or that has a chat_template.jinja)"))
        return False

    def _conversation(self, value: Any, where: str) -> bool:
        """E0416 unless a row's messages are a conversation (`ppdsl.core.chat_render`'s rule, the
        ranks')."""
        from ppdsl.core.chat_render import conversation_problem

        why = conversation_problem(value)
        if why is not None:
            self.malformed("messages", f"field '{self.opts['messages']}' on {where} {why}",
                           hint='each row holds messages = [{"role": "user", "content": "..."}, '
                                '{"role": "assistant", "content": "..."}, ...]')
        return why is None

    def _chat_sample(self, conversations: list[tuple[Any, str]], gb: int, what: str) -> None:
        """The sampled conversations rendered and tokenized as the ranks do (transformers' chat
        templates: with the model only, never under --no-model): E0416 for a row the template
        fails on; N0481 for those longer than seq_len (their tails are cut); with
        ``packing = documents``, E0414 when the whole table (all in the sample) packs into fewer
        windows than one global batch."""
        from ppdsl.core.chat_render import ChatTokenizer, pack_whole

        seq = self.spec.train.seq_len
        if not isinstance(seq, int) or seq <= 0:
            return
        named = self.opts.get("chat_template")
        try:
            template = None
            if named is not None:
                with open(named, encoding="utf-8") as f:
                    template = f.read()
            tok = ChatTokenizer(self.opts["tokenizer"], template)
        except (OSError, UnicodeDecodeError, ValueError):
            return  # an unreadable template or tokenizer: E0411, E0415 or E0433 say so
        labels = []
        for messages, where in conversations:
            try:
                labels.append(tok.encode(messages)[1])
            except Exception as exc:  # noqa: BLE001 - a template error (raise_exception) on the user's row
                self.malformed("messages", f"the chat template fails on {where}: {type(exc).__name__}: {exc}",
                               hint="fix the row, or the template (chat_template = \"template.jinja\")")
                return
        whole = len(labels) < SAMPLE_ROWS  # the sample is the table
        cut = [lab for lab in labels if len(lab) > seq]
        if cut:
            lost = sum(1 for lab in cut if all(t == IGNORE_INDEX for t in lab[1:seq]))
            self.out.append(note(
                "N0481", self.spec.span("train.seq_len") or self.call,
                f"{len(cut)} of the {'' if whole else 'first '}{len(labels)} conversations are longer "
                f"than seq_len = {seq} tokens: their tails are cut"
                + (f", and {lost} of them keep no assistant token" if lost else ""),
                label="a longer conversation loses its tail", hint=f"seq_len = {max(map(len, labels))} keeps every one "
                "whole (the truncation policy: a conversation's tokens after seq_len are dropped, labels too)"))
        if self.opts.get("packing") == "documents" and gb and whole:
            windows = len(pack_whole([min(len(lab), seq) for lab in labels], seq))
            if windows < gb:
                self.too_little(f"{what} holds {len(labels)} conversations, packed whole into {windows} windows of "
                                f"seq_len = {seq} tokens: fewer than {self.needed()} (global_batch = {gb})",
                                hint="use more data or a smaller global_batch, or packing = none (one sample each)")

    def _table_error(self, exc: Any) -> None:
        """The diagnostic of a `TableError`: E0410 (missing, or a Hub name), E0411, E0414, E0416, E0431."""
        kw = {"hint": exc.hint} if exc.hint else {}
        if exc.columns:
            kw["label"] = f"columns: {names(exc.columns)}"
        if exc.why in ("missing", "hub"):
            self.out.append(missing_error(self.span(exc.option), exc.message, hint=exc.hint))
        elif exc.why == "unreadable":
            self.unreadable(exc.option, exc.message, **kw)
        elif exc.why == "empty":
            self.too_little(exc.message, **kw)
        elif exc.why == "pyarrow":
            self.err("E0431", exc.option, exc.message, label="Parquet and Arrow files need pyarrow", **kw)
        else:
            self.malformed(exc.option, exc.message, **kw)

    def _separator(self) -> None:
        """A causal LM's documents are joined with the tokenizer's EOS (or separator) token. Only
        for a tokenizer.json data_check has read (one of AutoTokenizer's other files: the ranks
        find the token, or say so)."""
        doc, directory = self.tokenizer_doc, self.opts.get("tokenizer")
        if doc is None or not isinstance(directory, str):
            return
        tokens: set[str] = set()
        vocab = doc["model"].get("vocab")
        if isinstance(vocab, dict):
            tokens.update(vocab)
        elif isinstance(vocab, list):  # Unigram: [[piece, score], ...]
            tokens.update(p[0] for p in vocab if isinstance(p, list) and p and isinstance(p[0], str))
        for t in doc.get("added_tokens") or ():
            if isinstance(t, dict) and isinstance(t.get("content"), str):
                tokens.add(t["content"])
        if document_separator(directory, tokens.__contains__) is None:
            self.bad_tokenizer(f"the tokenizer in '{show(directory)}' has no end-of-sequence or separator token to "
                               "put between documents",
                               hint=f"a tokenizer whose tokenizer_config.json names an eos_token or sep_token, or "
                                    f"whose vocabulary holds one of {', '.join(COMMON_EOS)}")


def has_chat_template(directory: str) -> bool:
    """Whether a tokenizer directory holds a chat template, where transformers looks for one:
    chat_template.jinja, chat_template.json, or chat_template in tokenizer_config.json (a string,
    or a list of named templates)."""
    if os.path.isfile(os.path.join(directory, "chat_template.jinja")):
        return True
    for name in ("chat_template.json", "tokenizer_config.json"):
        try:
            with open(os.path.join(directory, name), "rb") as f:
                doc = json.loads(f.read(16 << 20))
        except (OSError, ValueError):
            continue
        value = doc.get("chat_template") if isinstance(doc, dict) else None
        if (isinstance(value, str) and value) or (isinstance(value, list) and value):
            return True
    return False
