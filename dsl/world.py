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
    return lambda w: bool(fn(w))


# Values are Python ints while they are whole (the common case: sizes, world / (tp * pp) for a
# world that fits) and exact Fractions otherwise; never floats.
_MAX_POW_BITS = 1 << 16  # a power with a bigger result is refused rather than computed


def _whole(v: Value) -> Value:
    return v.numerator if type(v) is Fraction and v.denominator == 1 else v


def _is_scaled(e: sympy.Basic) -> bool:
    return isinstance(e, sympy.Mul) and bool(e.args) and e.args[0].is_Rational and not e.args[0].is_Integer


def _scaled_parts(e: sympy.Basic) -> tuple[int, int, list[Callable[[int], Value]]]:
    return int(e.args[0].p), int(e.args[0].q), [_compile(a) for a in e.args[1:]]


def _compile(e: sympy.Basic) -> Callable[[int], Value]:
    if e is sympy.true:
        return lambda w: True
    if e is sympy.false:
        return lambda w: False
    if e == WORLD:
        return lambda w: w
    if isinstance(e, sympy.Symbol):
        raise Unsupported(f"free symbol {e}")
    if e.is_Integer or e.is_Rational:
        v = _whole(Fraction(int(e.p), int(e.q)))
        return lambda w: v
    if e.is_Float:
        try:
            f = _whole(Fraction(float(e)))
        except (OverflowError, ValueError):
            raise Unsupported(f"number {e} out of range") from None
        return lambda w: f
    if isinstance(e, sympy.Eq) and isinstance(e.args[0], sympy.Mod) and e.args[0].args[1] == 1 and e.args[1] == 0:
        # is_whole(x): values are ints exactly when whole, so no remainder needs computing
        inner = e.args[0].args[0]
        if _is_scaled(inner):  # whole(world / 4): a divisibility test, no Fraction built
            p, q, rest = _scaled_parts(inner)

            def divisible(w: int) -> bool:
                out: Value = p
                for a in rest:
                    out = out * a(w)
                return out % q == 0 if type(out) is int else (out / q).denominator == 1
            return divisible
        x = _compile(inner)

        def whole(w: int) -> bool:
            v = x(w)
            return type(v) is int or v.denominator == 1
        return whole
    if _is_scaled(e):
        # c * x * y with a fraction c = p / q (world / 4 is Mul(1/4, world)): stay in ints when exact
        p, q, rest = _scaled_parts(e)

        def scaled(w: int) -> Value:
            out: Value = p
            for a in rest:
                out = out * a(w)
            if type(out) is int:
                return out // q if out % q == 0 else Fraction(out, q)
            return _whole(out / q)
        return scaled
    args = [_compile(a) for a in e.args]
    if isinstance(e, sympy.Add):
        return lambda w: _whole(sum(a(w) for a in args))
    if isinstance(e, sympy.Mul):
        def mul(w: int) -> Value:
            out: Value = 1
            for a in args:
                out = out * a(w)
            return _whole(out)
        return mul
    if isinstance(e, sympy.Pow):
        base, exp = args
        def pw(w: int) -> Value:
            b, x = base(w), exp(w)
            if type(x) is not int:
                raise Unsupported("fractional power")
            if b == 0 and x < 0:
                raise ZeroDivisionError("0 ** negative")  # undefined: the rule does not hold there
            if b not in (0, 1, -1) and abs(x) * max(1, abs(b.numerator).bit_length(), b.denominator.bit_length()) > _MAX_POW_BITS:
                raise Unsupported("number too large")
            return _whole(Fraction(b) ** x) if x < 0 else b ** x
        return pw
    if isinstance(e, sympy.Mod):
        a, b = args
        def mod(w: int) -> Value:
            d = b(w)
            return _whole(a(w) % d) if d != 0 else 1
        return mod
    if isinstance(e, sympy.floor):
        (a,) = args
        return lambda w: math.floor(a(w))
    if isinstance(e, sympy.ceiling):
        (a,) = args
        return lambda w: math.ceil(a(w))
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
        v = _compile(expr)(world or 1)
    except (Unsupported, ZeroDivisionError, OverflowError, ValueError):
        return str(expr)
    if isinstance(v, bool):
        return str(v).lower()
    if v.denominator == 1:
        return str(v.numerator)
    try:
        return f"{float(v):g}"
    except OverflowError:
        return str(v)


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
    what = "world sizes" if g == 1 else f"multiples of {g}"
    if ws == multiples:
        return f"{'any world size' if g == 1 else what} (checked up to {bound})"
    if ws == [w for w in multiples if hi % w == 0]:
        return f"{'divisors of ' + str(hi) if g == 1 else what + ' that divide ' + str(hi)}: {_list(ws)}"
    if ws == [w for w in multiples if w >= lo]:
        return f"{what} from {lo} on (checked up to {bound})"
    if ws == [w for w in multiples if lo <= w <= hi]:
        return f"{what} from {lo} to {hi}"
    return _list(ws)


def _list(ws: list[int], most: int = 12) -> str:
    shown = ", ".join(map(str, ws[:most]))
    return shown + (f", ... ({len(ws)} sizes)" if len(ws) > most else "")
