"""check of labelled examples (`jsonl(...)` / `csv(...)`): fields, text, labels, and enough of them.

A mixin of `data_check`'s checker: it reads `opts`, `classification`, `labels`, and reports through
`err`, `malformed`, `unreadable`, `too_little`, `global_batch` and `_enough`.
"""

from __future__ import annotations

import csv
import json
from typing import Any

from ppdsl.core.labels import class_id

from .data_quote import HEAD_LINES, MAX_LINE, Head, LongLine, names, show, value


class ExampleChecks:
    # ---- labelled examples
    def _jsonl(self, path: str) -> None:
        seen_field = {"text": False, "label": False}
        count = 0
        gb = self.global_batch() or 0
        try:
            with open(path, "rb") as f:
                lines = Head(f)
                for lineno, raw in lines:
                    if not raw.strip():
                        continue
                    count += 1
                    if count > HEAD_LINES:
                        if count >= gb:
                            break
                        continue
                    try:
                        row = json.loads(raw)
                    except ValueError as exc:
                        self.malformed("path", f"line {lineno} of '{show(path)}' is not JSON: {exc}",
                                 hint="a JSON-lines file holds one JSON object per line")
                        return
                    if not isinstance(row, dict):
                        self.malformed("path", f"line {lineno} of '{show(path)}' is a JSON {type(row).__name__}, "
                                 "not an object", hint='each line is an object such as {"text": "...", "label": 0}')
                        return
                    if not self._example(row, lineno, path, seen_field, list(row)):
                        return
        except LongLine as exc:
            self._long_line(path, exc.lineno)
            return
        except OSError as exc:
            self.unreadable("path", f"cannot read '{show(path)}': {exc.strerror or exc}")
            return
        if not lines.cut:
            self._enough(path, count, gb)

    def _long_line(self, path: str, lineno: int) -> None:
        self.malformed("path", f"line {lineno} of '{show(path)}' is longer than {MAX_LINE:,} bytes",
                 hint="one example per line; check reads a bounded head of each file")

    def _csv(self, path: str) -> None:
        gb = self.global_batch() or 0
        count = 0
        seen_field = {"text": False, "label": False}
        try:
            with open(path, "rb") as f:
                lines = Head(f)
                reader = csv.DictReader(raw.decode("utf-8") for _, raw in lines)
                header = reader.fieldnames
                if not header:
                    self.too_little(f"CSV file '{show(path)}' is empty",
                             hint="its first line names the columns, e.g. text,label")
                    return
                for col in ("text", "label"):
                    name = self.opts[col]
                    if name not in header:
                        self.malformed(col, f"'{show(path)}' has no column '{name}'",
                                 label=f"columns: {names(header)}",
                                 hint=f"name the {col} column with {col} = \"...\"")
                        return
                for row in reader:
                    count += 1
                    if count > HEAD_LINES:
                        if count >= gb:
                            break
                        continue
                    if not self._example(row, reader.line_num, path, seen_field, list(header)):
                        return
        except LongLine as exc:
            self._long_line(path, exc.lineno)
            return
        except UnicodeDecodeError as exc:
            self.malformed("path", f"'{show(path)}' is not UTF-8 text (byte {exc.start} of a line)",
                     hint="convert the file to UTF-8")
            return
        except csv.Error as exc:
            self.malformed("path", f"'{show(path)}' is not a valid CSV file: {exc}")
            return
        except OSError as exc:
            self.unreadable("path", f"cannot read '{show(path)}': {exc.strerror or exc}")
            return
        if not lines.cut:
            self._enough(path, count, gb)

    def _example(self, row: dict[str, Any], lineno: int, path: str, seen: dict[str, bool], fields: list[str]) -> bool:
        """Check one example's text and label; False after the first problem (one is enough)."""
        text_key, label_key = self.opts["text"], self.opts["label"]
        for col, key in (("text", text_key), ("label", label_key)):
            if key not in row or row[key] is None:
                self.malformed(col, f"line {lineno} of '{show(path)}' has no field '{key}'",
                         label=f"fields: {names(fields)}",
                         hint=f"name the {col} field with {col} = \"...\"")
                return False
        if not isinstance(row[text_key], str):
            self.malformed("text", f"field '{text_key}' on line {lineno} of '{show(path)}' is not a string",
                     label=f"is {value(row[text_key])}")
            return False
        return self._class_label(row[label_key], f"line {lineno} of '{show(path)}'")

    def _class_label(self, raw: Any, where: str) -> bool:
        """E0417 unless `raw` is a class id of the model; `where`: "line 3 of 'f.jsonl'"."""
        label = class_id(raw)
        if label is None:
            self.err("E0417", "label", f"label {value(raw)} on {where} is not a class id",
                     hint="labels are whole numbers 0, 1, ..., num_labels - 1")
            return False
        if self.classification and self.labels is not None and not 0 <= label < self.labels:
            self.err("E0417", "label", f"label {label} on {where} is outside the model's "
                     f"classes 0..{self.labels - 1} (num_labels = {self.labels})",
                     hint=f"set num_labels to at least {label + 1} in the model's config, or fix the labels")
            return False
        return True
