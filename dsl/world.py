"""Deciding constraints for one world size, and describing the set of world sizes that work.

Conditions are compiled once to Python closures over exact Fractions, so sweeping thousands of
world sizes stays fast and never rounds.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Callable, Iterable, Sequence

from .exact import WORLD, Cond, Expr, Term

MAX_WORLD = 4096
Value = Fraction | int | bool


class Unsupported(Exception):
    pass


def compile_condition(expr: object) -> Callable[[int], bool]:
    fn = _compile(_exact(expr))
    return lambda w: bool(fn(w))


def _exact(expr: object) -> Term:
    """An exact value as is; a sympy expression (tests, callers that build their own) converted."""
    if isinstance(expr, Term):
        return expr
    if isinstance(expr, (int, Fraction, float)):
        return Expr.const(expr)
    from .sympy_bridge import from_sympy

    return from_sympy(expr)


# Values are Python ints while they are whole (the common case: sizes, world / (tp * pp) for a
# world that fits) and exact Fractions otherwise; never floats.
_MAX_POW_BITS = 1 << 16  # a power with a bigger result is refused rather than computed


def _ratio(n: int, d: int) -> Value:
    return n // d if n % d == 0 else Fraction(n, d)


def _whole(v: Value) -> Value:
    return v.numerator if type(v) is Fraction and v.denominator == 1 else v


def _number(v: object) -> Value:
    if type(v) is float:
        try:
            return _whole(Fraction(v))
        except (OverflowError, ValueError):
            raise Unsupported(f"number {v} out of range") from None
    return v  # type: ignore[return-value]


def _monomial(e: Term) -> tuple[int, int, int] | None:
    """c * world**k with c = p / q: (k, p, q)."""
    if e.op == "poly" and len(e.args) == 1:
        k, c = e.args[0]
        c = Fraction(c)
        return k, c.numerator, c.denominator
    return None


def _compile(e: Term) -> Callable[[int], Value]:
    fn = _compile_node(e)
    if e.op not in ("const", "true", "false") and not e.has_world:
        try:  # the same for every world size: decided once
            v = fn(1)
        except (Unsupported, ArithmeticError, ValueError, TypeError):
            return fn  # undefined: raises again for each world size, as the caller expects
        return lambda w: v
    return fn


def _compile_node(e: Term) -> Callable[[int], Value]:
    op = e.op
    if op == "true":
        return lambda w: True
    if op == "false":
        return lambda w: False
    if op == "const":
        v = _number(e.args[0])
        return lambda w: v
    if op == "poly":
        mono = _monomial(e)
        if mono is not None:  # world / 4, 3 * world, 16 / world: stay in ints while whole
            k, p, q = mono
            if k == 1 and q == 1:
                return lambda w: p * w
            if k >= 0:
                return lambda w: _ratio(p * w**k, q)
            return lambda w: _ratio(p, q * w**-k)
        terms = [(k, c) for k, c in e.args]

        def poly(w: int) -> Value:
            out: Value = 0
            for k, c in terms:
                out += c * (w**k if k >= 0 else Fraction(1, w**-k))
            return _whole(out)
        return poly
    if op == "eq" and e.args[0].op == "mod" and e.args[0].args[1] == 1 and e.args[1] == 0:
        # is_whole(x): values are ints exactly when whole, so no remainder needs computing
        inner = e.args[0].args[0]
        mono = _monomial(inner)
        if mono is not None:  # whole(world / 4): a divisibility test, no Fraction built
            k, p, q = mono
            if k >= 0:
                return lambda w: p * w**k % q == 0
            return lambda w: p % (q * w**-k) == 0
        x = _compile(inner)

        def whole(w: int) -> bool:
            v = x(w)
            return type(v) is int or v.denominator == 1
        return whole
    if op == "in":
        x = _compile(e.args[0])
        allowed = frozenset(e.args[1])
        return lambda w: x(w) in allowed
    args = [_compile(a) for a in e.args]
    if op == "add":
        return lambda w: _whole(sum(a(w) for a in args))
    if op == "mul":
        def mul(w: int) -> Value:
            out: Value = 1
            for a in args:
                out = out * a(w)
            return _whole(out)
        return mul
    if op == "pow":
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
    if op == "mod":
        a, b = args
        def mod(w: int) -> Value:
            d = b(w)
            return _whole(a(w) % d) if d != 0 else 1
        return mod
    if op == "floor":
        (a,) = args
        return lambda w: math.floor(a(w))
    if op == "ceiling":
        (a,) = args
        return lambda w: math.ceil(a(w))
    if op in _RELATIONS:
        a, b = args
        rel = _RELATIONS[op]
        return lambda w: rel(a(w), b(w))
    if op == "and":
        if len(args) == 2:
            a, b = args
            return lambda w: a(w) and b(w)
        if len(args) == 3:
            a, b, c = args
            return lambda w: a(w) and b(w) and c(w)
        return lambda w: all(a(w) for a in args)
    if op == "or":
        if len(args) == 2:
            a, b = args
            return lambda w: a(w) or b(w)
        return lambda w: any(a(w) for a in args)
    if op == "not":
        (a,) = args
        return lambda w: not a(w)
    raise Unsupported(op)


_RELATIONS = {
    "eq": lambda x, y: x == y, "ne": lambda x, y: x != y,
    "lt": lambda x, y: x < y, "le": lambda x, y: x <= y,
    "gt": lambda x, y: x > y, "ge": lambda x, y: x >= y,
}


def holds(expr: object, world: int | None) -> bool:
    """Decide a condition; with world None it must not depend on the world."""
    e = _exact(expr)
    if world is None:
        assert not e.has_world
        return compile_condition(e)(1)
    return compile_condition(e)(world)


def value_at(expr: object, world: int | None) -> str:
    """A value for a message: an integer, a fraction, or the symbolic form when world is free."""
    e = _exact(expr)
    if world is None and e.has_world:
        return str(e)
    try:
        v = _compile(e)(world or 1)
    except (Unsupported, ZeroDivisionError, OverflowError, ValueError):
        return str(e)
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
