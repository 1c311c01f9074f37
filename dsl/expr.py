"""Spec expressions -> exact values (ppdsl.dsl.exact). Nothing is ever evaluated as Python."""

from __future__ import annotations

import math
from typing import Callable

from . import ast
from . import exact
from .diagnostics import Diagnostic, error
from .exact import FALSE, TRUE, Cond, Expr, NotReal, Term
from .span import Span

Lookup = Callable[[ast.Name], Term]


def bad_value(span: Span | None, message: str, **kw: str) -> Diagnostic:
    """E0103, a value of the wrong kind or out of range: the one place that rule's diagnostic is
    made, for arithmetic here and for every value resolve reads."""
    return error("E0103", span, message, **kw)


class ExprError(Exception):
    def __init__(self, diagnostic: Diagnostic):
        super().__init__(diagnostic.message)
        self.diagnostic = diagnostic


_COMPARE = {"==": "eq", "!=": "ne", "<": "lt", "<=": "le", ">": "gt", ">=": "ge"}


_MAX_BITS = 4096  # a power larger than this is certainly a typo, and too slow to work with


class Divisions:
    """Collects every `a / b` met while converting, so check can require it to be exact."""

    def __init__(self) -> None:
        self.items: list[tuple[Expr, Expr, Span]] = []


def to_expr(expr: ast.Expr, lookup: Lookup, divisions: Divisions | None = None) -> Term:
    if isinstance(expr, ast.Num):
        return Expr.const(expr.value)
    if isinstance(expr, ast.Bool):
        return TRUE if expr.value else FALSE
    if isinstance(expr, ast.Name):
        return lookup(expr)
    if isinstance(expr, ast.UnaryOp):
        v = to_expr(expr.operand, lookup, divisions)
        if expr.op == "not":
            return exact.negate(_as_bool(v, expr.operand))
        v = _numeric(v, expr.operand)
        return -v if expr.op == "-" else v
    if isinstance(expr, ast.BinOp):
        return _binop(expr, lookup, divisions)
    what = {ast.Str: "a string", ast.NoneLit: "none", ast.Call: "a call", ast.ListExpr: "a list"}.get(type(expr), "this")
    raise ExprError(bad_value(expr.span, f"{what} cannot be used in arithmetic", label="not a number"))


to_sympy = to_expr  # the name before ppdsl.dsl.exact replaced sympy here


def _binop(expr: ast.BinOp, lookup: Lookup, divisions: Divisions | None) -> Term:
    a0 = to_expr(expr.left, lookup, divisions)
    b0 = to_expr(expr.right, lookup, divisions)
    op = expr.op
    if op in ("and", "or"):
        fa, fb = _as_bool(a0, expr.left), _as_bool(b0, expr.right)
        return exact.both(fa, fb) if op == "and" else exact.either(fa, fb)
    a = _numeric(a0, expr.left)
    b = _numeric(b0, expr.right)
    if op in _COMPARE:
        return exact.relation(_COMPARE[op], a, b)
    try:
        value = _arithmetic(op, a, b, expr, divisions)
    except OverflowError:  # a float beyond the double range met a number too large for one
        raise ExprError(out_of_range(expr.span)) from None
    if value.is_Float and not math.isfinite(value.value):  # 1e308 * 10: refused where it is made, not in a rule
        raise ExprError(out_of_range(expr.span))
    return value


def out_of_range(span: Span | None, label: str = "beyond the range of a float") -> Diagnostic:
    """E0103 for a number that is not a finite float: what arithmetic beyond the float range makes."""
    return bad_value(span, "number out of range", label=label)


def _arithmetic(op: str, a: Expr, b: Expr, expr: ast.BinOp, divisions: Divisions | None) -> Expr:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    if op == "**":
        if b.is_number and exact.magnitude(b) > 64:
            raise ExprError(bad_value(expr.right.span, "exponent too large", label="at most 64"))
        if a.is_number and b.is_number and exact.too_large(a, b):
            raise ExprError(bad_value(expr.span, "number too large", label=f"more than {_MAX_BITS} bits"))
        try:
            return a**b
        except (NotReal, ValueError, ZeroDivisionError):
            raise ExprError(bad_value(expr.span, "this power is not a finite real number",
                                  label="a negative base needs a whole exponent; 0 needs a positive one")) from None
    if b.is_zero:
        raise ExprError(bad_value(expr.right.span, "division by zero", label="this is 0"))
    if op == "/":
        if divisions is not None and not (a.is_Float or b.is_Float):
            divisions.items.append((a, b, expr.span))
        return a / b
    if op == "//":
        return a // b
    if op == "%":
        return a % b
    raise AssertionError(op)


def _numeric(v: Term, node: ast.Expr) -> Expr:
    if isinstance(v, Cond):
        raise ExprError(bad_value(node.span, "a condition cannot be used as a number", label="true/false"))
    assert isinstance(v, Expr), v
    return v


def _as_bool(v: Term, node: ast.Expr) -> Cond:
    if isinstance(v, Expr):
        raise ExprError(bad_value(node.span, "expected a condition such as `a % b == 0`", label="a number"))
    assert isinstance(v, Cond), v
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
