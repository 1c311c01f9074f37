"""Reading a data file for check, and quoting it: a bounded head of its lines, and what a
diagnostic may show of what it holds.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

HEAD_LINES = 1000  # jsonl / csv examples whose fields and labels are checked
MAX_LINE = 1 << 20  # a jsonl / csv line longer than this is refused (E0416)
HEAD_TOTAL = 64 << 20  # jsonl / csv bytes read at most (counting examples up to global_batch)


# Diagnostics quote a file's content only as short identifier-like tokens (a column name, a
# label): whatever else a file holds is described, never shown (docs/cli.md, trust model).
_TOKEN = re.compile(r"[A-Za-z_][A-Za-z0-9_ .-]{0,31}")


def token(text: str) -> str | None:
    """`text` quoted, when it is a short identifier-like token; else None."""
    return repr(text) if _TOKEN.fullmatch(text) else None


def names(found: Any) -> str:
    """Column or field names for a label: the identifier-like ones, the others counted."""
    items = list(found or ())
    shown = [t for t in (token(str(n)) for n in items[:8]) if t is not None]
    others = len(items) - len(shown)
    return ", ".join(shown + ([f"{others} other{'s' if others != 1 else ''} not shown"] if others else [])) or "none"


def value(v: Any) -> str:
    """A JSON or CSV value for a message: a number, or a short token; else its kind."""
    if v is None or isinstance(v, bool):
        return json.dumps(v)
    if isinstance(v, (int, float)):
        return json.dumps(v)[:24]
    if isinstance(v, str):
        return token(v) or f"a string of {len(v)} characters"
    return "a list" if isinstance(v, list) else "an object"


class LongLine(Exception):
    def __init__(self, lineno: int) -> None:
        self.lineno = lineno


class Head:
    """(line number, bytes) of a file's lines, each at most MAX_LINE bytes (a longer one raises
    `LongLine`), up to HEAD_TOTAL bytes in all; `cut` tells whether the file goes on."""

    def __init__(self, f: Any) -> None:
        self.f = f
        self.cut = False

    def __iter__(self) -> Any:
        total = 0
        lineno = 0
        while True:
            raw = self.f.readline(MAX_LINE + 1)
            if not raw:
                return
            lineno += 1
            if len(raw) > MAX_LINE and not raw.endswith(b"\n"):
                raise LongLine(lineno)
            total += len(raw)
            if total > HEAD_TOTAL:
                self.cut = True
                return
            yield lineno, raw


def show(path: str) -> str:
    """A path for messages: relative to the working directory when it lies below it."""
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel
