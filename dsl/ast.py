"""The .ppspec syntax tree: frozen attrs nodes, each with its source span.

The tree is syntax only: no names are resolved and nothing is evaluated here.
"""

from __future__ import annotations

from typing import Union

import attrs

from .span import Span


# ---- expressions -------------------------------------------------------------------------


@attrs.frozen
class Num:
    value: int | float
    text: str
    span: Span


@attrs.frozen
class Str:
    value: str
    span: Span


@attrs.frozen
class Bool:
    value: bool
    span: Span


@attrs.frozen
class NoneLit:
    span: Span


@attrs.frozen
class Name:
    """A bare or dotted name: `tp`, `mesh.tp`, `transformer.h`, `interleaved`."""

    parts: tuple[str, ...]
    span: Span

    @property
    def text(self) -> str:
        return ".".join(self.parts)


@attrs.frozen
class BinOp:
    op: str  # + - * / // % ** == != < <= > >= and or
    left: "Expr"
    right: "Expr"
    span: Span


@attrs.frozen
class UnaryOp:
    op: str  # - + not
    operand: "Expr"
    span: Span


@attrs.frozen
class KwArg:
    name: str
    value: "Expr"
    span: Span


@attrs.frozen
class Call:
    func: str
    args: tuple["Expr", ...]
    kwargs: tuple[KwArg, ...]
    span: Span


@attrs.frozen
class RangeItem:
    """`a:b` inside a list: the half-open block range [a, b)."""

    start: "Expr"
    stop: "Expr"
    span: Span


@attrs.frozen
class ListExpr:
    items: tuple[Union["Expr", RangeItem], ...]
    span: Span


Expr = Union[Num, Str, Bool, NoneLit, Name, BinOp, UnaryOp, Call, ListExpr]


# ---- module path patterns ------------------------------------------------------------------


@attrs.frozen
class Index:
    """`[*]` (all), `[3]` (one) or `[a:b]` (range, either end may be open)."""

    kind: str  # "all" | "one" | "range"
    start: int | None = None
    stop: int | None = None


@attrs.frozen
class Segment:
    name: str
    index: Index | None
    span: Span


@attrs.frozen
class Pattern:
    segments: tuple[Segment, ...]
    span: Span

    @property
    def text(self) -> str:
        out = []
        for seg in self.segments:
            s = seg.name
            if seg.index is not None:
                i = seg.index
                if i.kind == "all":
                    s += "[*]"
                elif i.kind == "one":
                    s += f"[{i.start}]"
                else:
                    a = "" if i.start is None else str(i.start)
                    b = "" if i.stop is None else str(i.stop)
                    s += f"[{a}:{b}]"
            out.append(s)
        return ".".join(out)


# ---- statements -------------------------------------------------------------------------------


@attrs.frozen
class Assign:
    key: str
    key_span: Span
    value: Expr
    span: Span


@attrs.frozen
class TpRule:
    pattern: Pattern
    style: str
    style_span: Span
    args: tuple[Expr, ...]
    kwargs: tuple[KwArg, ...]
    span: Span


@attrs.frozen
class Require:
    expr: Expr
    message: str | None
    span: Span


@attrs.frozen
class Block:
    kind: str  # model | mesh | tensor_parallel | pipeline | train | config | ...
    kind_span: Span
    label: str | None  # `model gpt2 { ... }` -> "gpt2"
    entries: tuple["Entry", ...]
    span: Span


Entry = Union[Assign, TpRule, Require, Block]


@attrs.frozen
class Document:
    file: str
    version: int | None
    version_span: Span | None
    items: tuple[Union[Block, Require], ...]
    span: Span
