"""Spec expressions -> sympy. Nothing is ever evaluated as Python."""

from __future__ import annotations

import math
from typing import Callable

import sympy

from ppdsl.dsl import ast
from ppdsl.dsl.diagnostics import Diagnostic, error
from ppdsl.dsl.span import Span

Lookup = Callable[[ast.Name], sympy.Basic]


class ExprError(Exception):
    def __init__(self, diagnostic: Diagnostic):
        super().__init__(diagnostic.message)
        self.diagnostic = diagnostic


_COMPARE = {
    "==": sympy.Eq,
    "!=": sympy.Ne,
    "<": sympy.Lt,
    "<=": sympy.Le,
    ">": sympy.Gt,
    ">=": sympy.Ge,
}


_MAX_BITS = 4096  # a power larger than this is certainly a typo, and too slow to work with


class Divisions:
    """Collects every `a / b` met while converting, so check can require it to be exact."""

    def __init__(self) -> None:
        self.items: list[tuple[sympy.Expr, sympy.Expr, Span]] = []


def to_sympy(expr: ast.Expr, lookup: Lookup, divisions: Divisions | None = None) -> sympy.Basic:
    if isinstance(expr, ast.Num):
        if isinstance(expr.value, int):
            return sympy.Integer(expr.value)
        return sympy.Float(expr.value)
    if isinstance(expr, ast.Bool):
        return sympy.true if expr.value else sympy.false
    if isinstance(expr, ast.Name):
        return lookup(expr)
    if isinstance(expr, ast.UnaryOp):
        v = to_sympy(expr.operand, lookup, divisions)
        if expr.op == "not":
            return sympy.Not(_as_bool(v, expr.operand))
        _numeric(v, expr.operand)
        return -v if expr.op == "-" else v
    if isinstance(expr, ast.BinOp):
        return _binop(expr, lookup, divisions)
    what = {ast.Str: "a string", ast.NoneLit: "none", ast.Call: "a call", ast.ListExpr: "a list"}.get(type(expr), "this")
    raise ExprError(error("E0103", expr.span, f"{what} cannot be used in arithmetic", label="not a number"))


def _binop(expr: ast.BinOp, lookup: Lookup, divisions: Divisions | None) -> sympy.Basic:
    a = to_sympy(expr.left, lookup, divisions)
    b = to_sympy(expr.right, lookup, divisions)
    op = expr.op
    if op in ("and", "or"):
        fa, fb = _as_bool(a, expr.left), _as_bool(b, expr.right)
        return sympy.And(fa, fb) if op == "and" else sympy.Or(fa, fb)
    _numeric(a, expr.left)
    _numeric(b, expr.right)
    if op in _COMPARE:
        try:
            return _COMPARE[op](a, b)
        except TypeError:  # sympy refuses to order a complex number
            raise ExprError(error("E0103", expr.span, "cannot compare a value that is not a real number")) from None
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    if op == "**":
        if b.is_number and abs(b) > 64:
            raise ExprError(error("E0103", expr.right.span, "exponent too large", label="at most 64"))
        if a.is_number and b.is_number and abs(float(b)) * _log2_abs(a) > _MAX_BITS:
            raise ExprError(error("E0103", expr.span, "number too large", label=f"more than {_MAX_BITS} bits"))
        value = a**b
        if value.has(sympy.zoo, sympy.nan, sympy.oo, -sympy.oo) or value.is_extended_real is False:
            raise ExprError(error("E0103", expr.span, "this power is not a finite real number",
                                  label="a negative base needs a whole exponent; 0 needs a positive one"))
        return value
    if b.is_zero:
        raise ExprError(error("E0103", expr.right.span, "division by zero", label="this is 0"))
    if op == "/":
        if divisions is not None and not (a.is_Float or b.is_Float):
            divisions.items.append((a, b, expr.span))
        return a / b
    if op == "//":
        return sympy.floor(a / b)
    if op == "%":
        return sympy.Mod(a, b)
    raise AssertionError(op)


def _log2_abs(x: sympy.Expr) -> float:
    try:
        v = abs(int(x)) if x.is_Integer else abs(float(x))
        return math.log2(v) if v > 1 else 0.0
    except (OverflowError, ValueError, TypeError):
        return math.inf


def _numeric(v: sympy.Basic, node: ast.Expr) -> None:
    if isinstance(v, sympy.logic.boolalg.Boolean) and not isinstance(v, sympy.Expr):
        raise ExprError(error("E0103", node.span, "a condition cannot be used as a number", label="true/false"))


def _as_bool(v: sympy.Basic, node: ast.Expr) -> sympy.Basic:
    if isinstance(v, sympy.Expr):
        raise ExprError(error("E0103", node.span, "expected a condition such as `a % b == 0`", label="a number"))
    return v


def source_text(span: Span, text: str) -> str:
    """The spec text a span covers (for messages)."""
    lines = text.splitlines()
    if span.line < 1 or span.line > len(lines):
        return ""
    if span.line == span.end_line:
        return lines[span.line - 1][span.column - 1 : span.end_column - 1]
    first = lines[span.line - 1][span.column - 1 :]
    middle = lines[span.line : span.end_line - 1]
    last = lines[span.end_line - 1][: span.end_column - 1] if span.end_line <= len(lines) else ""
    return " ".join([first, *middle, last]).strip()
