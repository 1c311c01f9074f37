"""`--set block.key=value`: replace or add one entry of the AST, before resolution."""

from __future__ import annotations

import attrs

from ppdsl.dsl import ast
from ppdsl.dsl.diagnostics import SpecError, error
from ppdsl.dsl.parse import parse
from ppdsl.dsl.span import Span


def apply_overrides(doc: ast.Document, overrides: list[str] | tuple[str, ...]) -> ast.Document:
    for text in overrides:
        doc = _apply(doc, text)
    return doc


def _apply(doc: ast.Document, text: str) -> ast.Document:
    origin = f"--set {text}"
    key, eq, value = text.partition("=")
    parts = key.strip().split(".")
    if not eq or len(parts) < 2 or not all(p.isidentifier() for p in parts) or not value.strip():
        raise SpecError([error("E0005", Span.point(origin), f"cannot read --set '{text}'",
                               hint="write --set block.key=value, e.g. --set mesh.tp=4 or --set model.config.n_layer=4")])
    # Parse the value in a one-line document of its own so its spans name the --set argument.
    fragment = f"{parts[-1]} = {value.strip()}"
    try:
        parsed = parse(f"x {{ {fragment} }}", origin)
    except SpecError as exc:
        raise SpecError(exc.diagnostics) from None
    assign = parsed.items[0].entries[0]  # type: ignore[union-attr]
    assert isinstance(assign, ast.Assign)
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
