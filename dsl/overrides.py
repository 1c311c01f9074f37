"""`--set block.key=value`: replace or add one entry of the AST, before resolution."""

from __future__ import annotations

import attrs

from . import ast
from .command_line import bad_input
from .diagnostics import SpecError
from .parse import parse
from .span import Span


def apply_overrides(doc: ast.Document, overrides: list[str] | tuple[str, ...]) -> ast.Document:
    for text in overrides:
        doc = _apply(doc, text)
    return doc


_SET_HINT = "write --set block.key=value, e.g. --set mesh.tp=4 or --set model.config.n_layer=4"


def _apply(doc: ast.Document, text: str) -> ast.Document:
    origin = f"--set {text}"
    key, eq, value = text.partition("=")
    parts = key.strip().split(".")
    if not eq or len(parts) < 2 or not all(p.isidentifier() for p in parts) or not value.strip() \
            or "\n" in text or "\r" in text:
        raise SpecError([bad_input(f"cannot read --set '{text}'", hint=_SET_HINT)])
    # Parse the value in a one-line document of its own whose columns match the option as typed
    # (`--set mesh.tp=4`), so that diagnostics about the value point into the option itself.
    prefix = "x{"
    pad = len("--set ") + len(key) + 1 - len(prefix) - len(parts[-1]) - 1
    fragment = f"{prefix}{' ' * pad}{parts[-1]}={value}\n}}"
    try:
        parsed = parse(fragment, origin)
    except SpecError as exc:
        found = exc.diagnostics[0]
        raise SpecError([bad_input(f"cannot read the value of --set '{text}'",
                                   label="the value is incomplete" if "'}'" in found.message else found.message,
                                   hint="the value is one expression, e.g. 4, interleaved, [0:2, 2:4] or adamw(lr = 1e-3)")]) from None
    entries = parsed.items[0].entries if len(parsed.items) == 1 else ()  # type: ignore[union-attr]
    if len(entries) != 1 or not isinstance(entries[0], ast.Assign):
        raise SpecError([bad_input(f"--set '{text}' sets more than one value",
                                   hint="give one --set per key: --set mesh.tp=4 --set mesh.pp=2")])
    assign = entries[0]
    items = list(doc.items)
    items = _put(items, parts[:-1], assign, origin)
    return attrs.evolve(doc, items=tuple(items))


def _put(entries: list, path: list[str], assign: ast.Assign, origin: str) -> list:
    head, rest = path[0], path[1:]
    out = list(entries)
    for i, e in enumerate(out):
        if isinstance(e, ast.Block) and e.kind == head:
            inner = list(e.entries)
            if rest:
                inner = _put(inner, rest, assign, origin)
            else:
                inner = [x for x in inner if not (isinstance(x, ast.Assign) and x.key == assign.key)] + [assign]
            out[i] = attrs.evolve(e, entries=tuple(inner))
            return out
    span = Span.point(origin)
    new = ast.Block(head, span, None, (), span)
    new = attrs.evolve(new, entries=tuple(_put([], rest, assign, origin)) if rest else (assign,))
    out.append(new)
    return out
