"""Exact values <-> sympy, for what truly needs sympy: printing a value that still holds `world`
(diagnostics print what sympy prints: `world/4`, `8*world`), and sympy expressions handed to
world.py by callers that build their own. The only module of ppdsl.dsl that imports sympy."""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import sympy

from .exact import FALSE, TRUE, WORLD, Cond, Expr, Term, member, relation

SYMPY_WORLD = sympy.Symbol("world", integer=True, positive=True)

_RELATIONS = {"eq": sympy.Eq, "ne": sympy.Ne, "lt": sympy.Lt, "le": sympy.Le, "gt": sympy.Gt, "ge": sympy.Ge}


def to_sympy_object(t: Term) -> Any:
    """The sympy expression the old checker built for the same spec text (sympy evaluates it)."""
    op, args = t.op, t.args
    if op == "const":
        v = args[0]
        if type(v) is float:
            return sympy.Float(v)
        if type(v) is Fraction:
            return sympy.Rational(v.numerator, v.denominator)
        return sympy.Integer(v)
    if op == "poly":
        return sympy.Add(*(sympy.Rational(int(Fraction(c).numerator), int(Fraction(c).denominator)) * SYMPY_WORLD**k
                           for k, c in args))
    if op == "true":
        return sympy.true
    if op == "false":
        return sympy.false
    if op == "in":
        return sympy.Contains(to_sympy_object(args[0]), sympy.FiniteSet(*args[1]))
    a = [to_sympy_object(x) for x in args]
    if op == "add":
        return sympy.Add(*a)
    if op == "mul":
        return sympy.Mul(*a)
    if op == "pow":
        return a[0] ** a[1]
    if op == "mod":
        return sympy.Mod(a[0], a[1])
    if op == "floor":
        return sympy.floor(a[0])
    if op == "ceiling":
        return sympy.ceiling(a[0])
    if op in _RELATIONS:
        return _RELATIONS[op](a[0], a[1])
    if op == "and":
        return sympy.And(*a)
    if op == "or":
        return sympy.Or(*a)
    if op == "not":
        return sympy.Not(a[0])
    raise AssertionError(op)


def from_sympy(e: Any) -> Term:
    """A sympy expression as an unevaluated exact value (world.Unsupported for what it cannot hold)."""
    from .world import Unsupported

    e = sympy.sympify(e)
    if e is sympy.true:
        return TRUE
    if e is sympy.false:
        return FALSE
    if isinstance(e, sympy.Symbol):
        if e == SYMPY_WORLD:
            return WORLD
        raise Unsupported(f"free symbol {e}")
    if e.is_Integer:
        return Expr.const(int(e))
    if e.is_Rational:
        return Expr.const(Fraction(int(e.p), int(e.q)))
    if e.is_Float:
        return Expr.const(float(e))
    if isinstance(e, sympy.Contains) and isinstance(e.args[1], sympy.FiniteSet):
        return member(from_sympy(e.args[0]), tuple(int(x) for x in e.args[1]))  # type: ignore[arg-type]
    ops = ((sympy.Add, "add"), (sympy.Mul, "mul"), (sympy.Pow, "pow"), (sympy.Mod, "mod"),
           (sympy.floor, "floor"), (sympy.ceiling, "ceiling"))
    for cls, op in ops:
        if isinstance(e, cls):
            return Expr.node(op, *(from_sympy(a) for a in e.args))  # type: ignore[arg-type]
    for op, cls in _RELATIONS.items():
        if isinstance(e, cls):
            a, b = (from_sympy(x) for x in e.args)
            return relation(op, a, b, evaluate=False)  # type: ignore[arg-type]
    for cls, op in ((sympy.And, "and"), (sympy.Or, "or"), (sympy.Not, "not")):
        if isinstance(e, cls):
            return Cond(op, tuple(from_sympy(a) for a in e.args))
    raise Unsupported(type(e).__name__)
