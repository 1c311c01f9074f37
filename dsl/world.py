"""Deciding constraints for one world size, and describing the set of world sizes that work.

Conditions are compiled once to Python closures over exact Fractions, so sweeping thousands of
world sizes stays fast and never rounds.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Callable, Iterable, Sequence

import sympy

from ppdsl.dsl.spec import WORLD

MAX_WORLD = 4096
Value = Fraction | bool


class Unsupported(Exception):
    pass


def compile_condition(expr: sympy.Basic) -> Callable[[int], bool]:
    fn = _compile(expr)
    return lambda w: bool(fn(Fraction(w)))


def _compile(e: sympy.Basic) -> Callable[[Fraction], Value]:
    if e is sympy.true:
        return lambda w: True
    if e is sympy.false:
        return lambda w: False
    if e == WORLD:
        return lambda w: w
    if isinstance(e, sympy.Symbol):
        raise Unsupported(f"free symbol {e}")
    if e.is_Integer or e.is_Rational:
        v = Fraction(int(e.p), int(e.q))
        return lambda w: v
    if e.is_Float:
        f = Fraction(float(e))
        return lambda w: f
    args = [_compile(a) for a in e.args]
    if isinstance(e, sympy.Add):
        return lambda w: sum((a(w) for a in args), Fraction(0))
    if isinstance(e, sympy.Mul):
        def mul(w: Fraction) -> Value:
            out = Fraction(1)
            for a in args:
                out *= a(w)
            return out
        return mul
    if isinstance(e, sympy.Pow):
        base, exp = args
        def pw(w: Fraction) -> Value:
            b, x = base(w), exp(w)
            if x.denominator != 1:
                raise Unsupported("fractional power")
            if b == 0 and x < 0:
                return Fraction(0)
            return b ** int(x)
        return pw
    if isinstance(e, sympy.Mod):
        a, b = args
        return lambda w: a(w) % b(w) if b(w) != 0 else Fraction(1)
    if isinstance(e, sympy.floor):
        (a,) = args
        return lambda w: Fraction(math.floor(a(w)))
    if isinstance(e, sympy.ceiling):
        (a,) = args
        return lambda w: Fraction(math.ceil(a(w)))
    ops = {
        sympy.Eq: lambda x, y: x == y, sympy.Ne: lambda x, y: x != y,
        sympy.Lt: lambda x, y: x < y, sympy.Le: lambda x, y: x <= y,
        sympy.Gt: lambda x, y: x > y, sympy.Ge: lambda x, y: x >= y,
    }
    for cls, op in ops.items():
        if isinstance(e, cls):
            a, b = args
            return lambda w, op=op: op(a(w), b(w))
    if isinstance(e, sympy.And):
        return lambda w: all(a(w) for a in args)
    if isinstance(e, sympy.Or):
        return lambda w: any(a(w) for a in args)
    if isinstance(e, sympy.Not):
        (a,) = args
        return lambda w: not a(w)
    raise Unsupported(type(e).__name__)


def holds(expr: sympy.Basic, world: int | None) -> bool:
    """Decide a condition; with world None it must not depend on the world."""
    if world is None:
        assert WORLD not in expr.free_symbols
        return compile_condition(expr)(1)
    return compile_condition(expr)(world)


def value_at(expr: sympy.Basic, world: int | None) -> str:
    """A value for a message: an integer, a fraction, or the symbolic form when world is free."""
    if world is None and WORLD in expr.free_symbols:
        return str(expr)
    try:
        v = _compile(expr)(Fraction(world or 1))
    except (Unsupported, ZeroDivisionError):
        return str(expr)
    if isinstance(v, bool):
        return str(v).lower()
    if v.denominator == 1:
        return str(v.numerator)
    return f"{float(v):g}"


def valid_worlds(conditions: Sequence[Callable[[int], bool]], bound: int = MAX_WORLD) -> list[int]:
    return [w for w in range(1, bound + 1) if all(c(w) for c in conditions)]


def describe(worlds: Iterable[int], bound: int = MAX_WORLD) -> str:
    ws = sorted(worlds)
    if not ws:
        return f"no world size up to {bound}"
    if len(ws) == 1:
        return f"world = {ws[0]}"
    g = math.gcd(*ws)
    lo, hi = ws[0], ws[-1]
    multiples = [w for w in range(g, bound + 1, g)]
    what = "any world size" if g == 1 else f"multiples of {g}"
    if ws == multiples:
        return f"{what} (checked up to {bound})"
    if ws == [w for w in multiples if hi % w == 0]:
        return f"{what} that divide {hi}: {_list(ws)}"
    if ws == [w for w in multiples if lo <= w <= hi]:
        return f"{what} from {lo} to {hi}"
    if ws == [w for w in multiples if w >= lo]:
        return f"{what} from {lo} on (checked up to {bound})"
    return _list(ws)


def _list(ws: list[int], most: int = 12) -> str:
    shown = ", ".join(map(str, ws[:most]))
    return shown + (f", ... ({len(ws)} sizes)" if len(ws) > most else "")
