"""Where the cursor is, read from the text alone: it works on a spec that does not parse yet.

A small scanner over the text before the cursor tracks the enclosing blocks (`train { checkpoint {`),
the entry being written (`key = ...` or `pattern : style`) and the call whose parentheses are open.
Positions are 0-based lines and columns in code points (Python string indices); the server turns
them into the client's units.
"""

from __future__ import annotations

import re

import attrs

_TOKEN = re.compile(r"""
    (?P<comment>\#[^\n]*)
  | (?P<string>"(?:[^"\\\n]|\\.)*"?|'(?:[^'\\\n]|\\.)*'?)
  | (?P<cont>\\[ \t\f]*\r?\n)
  | (?P<newline>\n)
  | (?P<name>[A-Za-z0-9_]+)
  | (?P<space>[ \t\f\r]+)
  | (?P<op>\*\*|==|!=|<=|>=|//|.)
""", re.X)
# the rest of a module path after the cursor: names and closed [*], [3], [a:b]
_PATH_AFTER = re.compile(r"^(?:[A-Za-z0-9_]|\[[0-9*: ]*\])*")
_PATH_KEYS = ("blocks", "first", "last")  # pipeline keys whose values are module paths


@attrs.frozen
class Context:
    blocks: tuple[str, ...]  # enclosing blocks, outermost first: ("train", "checkpoint")
    entry: tuple[str, ...]  # the tokens of the current entry before the cursor, brackets included
    key: str | None  # `key = ...`: the key, once its `=` is written
    call: str | None  # the innermost call whose `(` is open: "adamw"
    at_argument: bool  # right after that call's `(` or a `,`: an option name may come
    in_list: bool  # inside `[ ... ]`
    after_colon: bool  # a `:` outside brackets: the style part of a split rule

    @property
    def at_entry_start(self) -> bool:
        return not self.entry

    @property
    def block(self) -> str | None:
        return self.blocks[-1] if self.blocks else None

    @property
    def tp_style(self) -> bool:
        """After the `:` of a split rule: a style comes."""
        return self.block == "tensor_parallel" and self.key is None and self.after_colon and self.call is None

    @property
    def module_path(self) -> bool:
        """A module path is being written: a split rule's pattern, or pipeline blocks/first/last."""
        if self.block == "tensor_parallel":
            return self.key is None and not self.after_colon and "=" not in self.entry
        return self.block == "pipeline" and self.key in _PATH_KEYS and self.call is None


def context_at(text: str, line: int, column: int) -> Context:
    """The context at (line, column), 0-based, in code points."""
    return _scan(text[: offset_of(text, line, column)])


def offset_of(text: str, line: int, column: int) -> int:
    start = 0
    for _ in range(line):
        nl = text.find("\n", start)
        if nl < 0:
            return len(text)
        start = nl + 1
    end = text.find("\n", start)
    end = len(text) if end < 0 else end
    return min(start + column, end)


def _scan(before: str) -> Context:
    blocks: list[str] = []
    entry: list[str] = []
    brackets: list[tuple[str, str | None]] = []  # ("(" or "[", call name)
    after_colon = False
    for m in _TOKEN.finditer(before):
        kind, tok = m.lastgroup, m.group()
        if kind in ("comment", "space", "cont"):
            continue
        if kind == "newline":
            if not brackets:
                entry, after_colon = [], False
            continue
        if tok == "{":
            blocks.append(next((t for t in entry if _is_name(t)), "?"))
            entry, brackets, after_colon = [], [], False
        elif tok == "}":
            if blocks:
                blocks.pop()
            entry, brackets, after_colon = [], [], False
        elif tok in ",;" and not brackets:
            entry, after_colon = [], False
        else:
            after_colon = after_colon or (tok == ":" and not brackets)
            if tok in "([":
                brackets.append((tok, entry[-1] if tok == "(" and entry and _is_name(entry[-1]) else None))
            elif tok in ")]" and brackets:
                brackets.pop()
            entry.append(tok)
    key = entry[0] if len(entry) >= 2 and entry[1] == "=" and _is_name(entry[0]) else None
    calls = [name for b, name in brackets if b == "("]
    call = calls[-1] if calls else None
    at_argument = bool(brackets) and brackets[-1][0] == "(" and bool(entry) and entry[-1] in ("(", ",")
    return Context(tuple(blocks), tuple(entry), key, call, at_argument, any(b == "[" for b, _ in brackets),
                   after_colon)


def _is_name(tok: str) -> bool:
    return bool(tok) and (tok[0].isalpha() or tok[0] == "_")


def word_at(line_text: str, column: int) -> tuple[int, int] | None:
    """[start, end) of the name (letters, digits, `_`) under or just before the cursor."""
    column = min(column, len(line_text))
    start = column
    while start > 0 and (line_text[start - 1].isalnum() or line_text[start - 1] == "_"):
        start -= 1
    end = column
    while end < len(line_text) and (line_text[end].isalnum() or line_text[end] == "_"):
        end += 1
    return (start, end) if end > start else None


def path_before(line_text: str, column: int) -> tuple[int, str]:
    """(start column, text) of the module path that ends at the cursor (possibly empty): names,
    dots, and an index `[*]`, `[3]`, `[a:b]` (or one being typed, `h[0:`) after a name."""
    column = min(column, len(line_text))
    i = column
    j = i
    while j > 0 and line_text[j - 1] in _INDEX_CHARS:
        j -= 1
    if j > 1 and line_text[j - 1] == "[" and _is_path_char(line_text[j - 2]):
        i = j - 1
    while i > 0:
        ch = line_text[i - 1]
        if _is_path_char(ch) or ch == ".":
            i -= 1
            continue
        if ch == "]":
            k = line_text.rfind("[", 0, i - 1)
            if k > 0 and _is_path_char(line_text[k - 1]) and all(c in _INDEX_CHARS for c in line_text[k + 1: i - 1]):
                i = k
                continue
        break
    return i, line_text[i:column]


_INDEX_CHARS = frozenset("0123456789*: ")


def _is_path_char(ch: str) -> bool:
    return ch.isascii() and (ch.isalnum() or ch == "_")


def path_at(line_text: str, column: int) -> tuple[int, int, str] | None:
    """The module path under the cursor, cut after the segment the cursor is on:
    on `attn` of `transformer.h[*].attn.c_attn` -> `transformer.h[*].attn`. (start, end, text)."""
    column = min(column, len(line_text))
    start, head = path_before(line_text, column)
    tail = _PATH_AFTER.match(line_text[column:]).group()
    text = (head + tail).rstrip(".")
    return (start, start + len(text), text) if text else None


def next_char(line_text: str, column: int) -> str:
    """The first character after the cursor's word that is not a blank."""
    rest = line_text[column:].lstrip(" \t")
    return rest[:1]
