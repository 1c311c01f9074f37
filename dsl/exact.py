"""Exact symbolic values in one unknown, the world size: what a spec's numbers resolve to.

A spec's arithmetic needs very little algebra: whole numbers and fractions, `world`, and
+ - * / // % ** over them. `Expr` holds a number, `Cond` a true/false condition. Constants fold
exactly as sympy folds them (Integer, Rational, Float; a Float stays a Float); a Laurent
polynomial in `world` with exact coefficients (world / 4, 16 / world, 2 * world + 1) is kept in
one canonical form, so equal values compare equal; anything else (floor(world / 3), 2 ** world)
is kept as an unevaluated node. world.py decides conditions exactly for thousands of world sizes.

sympy is never imported to build, compare or evaluate these. It is imported only to print a value
that still holds `world` (or a Float, or an irrational number), through `ppdsl.dsl.sympy_bridge`,
so that diagnostics print exactly what sympy printed before (`world/4`, `8*world`), and by
callers that hand a value to sympy themselves (`sympy.sympify(v)` uses `_sympy_`).
The method names (`is_Integer`, `free_symbols`, `subs`, ...) follow sympy's on purpose.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any, Union

Const = Union[int, Fraction, float]  # a float is a sympy Float: inexact, and stays inexact
Terms = tuple[tuple[int, Union[int, Fraction]], ...]  # ((power of world, coefficient), ...) sorted

_MAX_BITS = 4096  # a constant power larger than this is certainly a typo, and too slow to work with


class NotReal(ArithmeticError):
    """A power that is not a finite real number: 0 ** -1, (-4) ** (1/2), 2.0 ** 5000."""


def _exact(v: Fraction | int) -> int | Fraction:
    if type(v) is Fraction and v.denominator == 1:
        return v.numerator
    return v


def _is_exact(v: object) -> bool:
    return type(v) is int or type(v) is Fraction


class Term:
    __slots__ = ("op", "args", "_hash")
    op: str
    args: tuple

    def __init__(self, op: str, args: tuple):
        object.__setattr__(self, "op", op)
        object.__setattr__(self, "args", args)
        object.__setattr__(self, "_hash", None)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable")

    def __hash__(self) -> int:
        h = self._hash
        if h is None:
            h = hash((self.op, self.args))
            object.__setattr__(self, "_hash", h)
        return h

    def __eq__(self, other: object) -> bool:
        if type(other) is type(self):
            return self is other or (self.op == other.op and self.args == other.args)  # type: ignore[attr-defined]
        return NotImplemented

    def __ne__(self, other: object) -> bool:
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    def __reduce__(self) -> tuple:
        return (type(self), (self.op, self.args))

    @property
    def has_world(self) -> bool:
        if self.op == "poly":
            return True
        return any(isinstance(a, Term) and a.has_world for a in self.args)

    @property
    def free_symbols(self) -> frozenset[Expr]:
        return frozenset((WORLD,)) if self.has_world else frozenset()

    def subs(self, symbol: Expr, world: int) -> Term:
        """The value at one world size, as a constant (self when it cannot be evaluated there)."""
        assert symbol == WORLD, symbol
        if not self.has_world:
            return self
        from .world import Unsupported, _compile

        try:
            v = _compile(self)(world)
        except (Unsupported, ArithmeticError, ValueError, TypeError):
            return self
        if isinstance(self, Cond):
            return TRUE if v else FALSE
        return Expr.const(v)

    def _sympy_(self) -> Any:
        from .sympy_bridge import to_sympy_object

        return to_sympy_object(self)

    def __str__(self) -> str:
        return str(self._sympy_())

    def __repr__(self) -> str:
        return str(self)


class Expr(Term):
    """A number. op: const (args = (value,)), poly (args = Terms, in world, never a bare constant),
    add, mul, pow, floor, ceiling, mod (args = Exprs, unevaluated)."""

    __slots__ = ()

    # ---- construction
    @staticmethod
    def const(v: Const) -> Expr:
        if type(v) is bool:
            v = int(v)
        if type(v) is Fraction:
            v = _exact(v)
        assert type(v) in (int, Fraction, float), v
        return Expr("const", (v,))

    @staticmethod
    def poly(terms: dict[int, int | Fraction]) -> Expr:
        items = tuple(sorted((k, _exact(c)) for k, c in terms.items() if c != 0))
        if not items:
            return ZERO
        if len(items) == 1 and items[0][0] == 0:
            return Expr.const(items[0][1])
        return Expr("poly", items)

    @staticmethod
    def node(op: str, *args: Expr) -> Expr:
        """An unevaluated operation (what a rule builds, or what does not fold)."""
        return Expr(op, tuple(args))

    # ---- what it is (sympy's names)
    @property
    def is_Integer(self) -> bool:
        return self.op == "const" and type(self.args[0]) is int

    @property
    def is_Float(self) -> bool:
        return self.op == "const" and type(self.args[0]) is float

    @property
    def is_Rational(self) -> bool:
        return self.op == "const" and type(self.args[0]) is not float

    @property
    def is_number(self) -> bool:
        return not self.has_world

    @property
    def is_zero(self) -> bool:
        return self.op == "const" and self.args[0] == 0

    @property
    def value(self) -> Const:
        assert self.op == "const", self.op
        return self.args[0]

    def _terms(self) -> dict[int, int | Fraction] | None:
        """Exact Laurent polynomial terms, or None (a float, or an unevaluated node)."""
        if self.op == "poly":
            return dict(self.args)
        if self.op == "const" and type(self.args[0]) is not float:
            return {0: self.args[0]}
        return None

    def _monomial(self) -> tuple[int, int | Fraction] | None:
        t = self._terms()
        return next(iter(t.items())) if t is not None and len(t) == 1 else None

    # ---- numbers
    def __int__(self) -> int:
        if self.op == "const":
            return int(self.args[0])
        if self.has_world:
            raise TypeError("cannot convert an expression in world to int")
        return int(self._float())

    def __float__(self) -> float:
        if self.op == "const":
            return float(self.args[0])
        if self.has_world:
            raise TypeError("cannot convert an expression in world to float")
        return self._float()

    def _float(self) -> float:
        """A constant that does not fold exactly (an irrational power such as 2 ** (1/2))."""
        from .world import Unsupported

        if self.op == "pow":
            return float(self.args[0]) ** float(self.args[1])
        from .world import _compile

        try:
            return float(_compile(self)(1))
        except Unsupported as exc:
            raise TypeError(str(exc)) from None

    def __str__(self) -> str:
        if self.op == "const" and type(self.args[0]) is not float:
            return str(self.args[0])  # Fraction prints p/q, as sympy's Rational does
        if self.op == "poly" and len(self.args) == 1:  # the usual value in world (dp = world/4): no sympy
            return _monomial_str(*self.args[0])
        return super().__str__()

    def __eq__(self, other: object) -> bool:
        if type(other) in (int, Fraction, float):
            return self.op == "const" and self.args[0] == other
        return super().__eq__(other)

    def __hash__(self) -> int:
        if self.op == "const":
            return hash(self.args[0])
        return super().__hash__()

    # ---- arithmetic (folding, as sympy evaluates it)
    def __add__(self, other: object) -> Expr:
        o = as_expr(other, strict=False)
        return NotImplemented if o is None else add(self, o)

    def __radd__(self, other: object) -> Expr:
        o = as_expr(other, strict=False)
        return NotImplemented if o is None else add(o, self)

    def __sub__(self, other: object) -> Expr:
        o = as_expr(other, strict=False)
        return NotImplemented if o is None else add(self, mul(MINUS_ONE, o))

    def __rsub__(self, other: object) -> Expr:
        o = as_expr(other, strict=False)
        return NotImplemented if o is None else add(o, mul(MINUS_ONE, self))

    def __mul__(self, other: object) -> Expr:
        o = as_expr(other, strict=False)
        return NotImplemented if o is None else mul(self, o)

    def __rmul__(self, other: object) -> Expr:
        o = as_expr(other, strict=False)
        return NotImplemented if o is None else mul(o, self)

    def __truediv__(self, other: object) -> Expr:
        o = as_expr(other, strict=False)
        return NotImplemented if o is None else div(self, o)

    def __rtruediv__(self, other: object) -> Expr:
        o = as_expr(other, strict=False)
        return NotImplemented if o is None else div(o, self)

    def __floordiv__(self, other: object) -> Expr:
        o = as_expr(other, strict=False)
        return NotImplemented if o is None else floor(div(self, o))

    def __rfloordiv__(self, other: object) -> Expr:
        o = as_expr(other, strict=False)
        return NotImplemented if o is None else floor(div(o, self))

    def __mod__(self, other: object) -> Expr:
        o = as_expr(other, strict=False)
        return NotImplemented if o is None else mod(self, o)

    def __rmod__(self, other: object) -> Expr:
        o = as_expr(other, strict=False)
        return NotImplemented if o is None else mod(o, self)

    def __pow__(self, other: object) -> Expr:
        o = as_expr(other, strict=False)
        return NotImplemented if o is None else power(self, o)

    def __rpow__(self, other: object) -> Expr:
        o = as_expr(other, strict=False)
        return NotImplemented if o is None else power(o, self)

    def __neg__(self) -> Expr:
        return mul(MINUS_ONE, self)

    def __pos__(self) -> Expr:
        return self

    def __abs__(self) -> Expr:
        if self.op == "const":
            return Expr.const(abs(self.args[0]))
        raise TypeError("abs of an expression in world")


def _monomial_str(k: int, c: int | Fraction) -> str:
    """c * world**k as sympy prints it: world/4, 3*world/4, 16/world, 1/(4*world), world**(-2)."""
    c = Fraction(c)
    sign, p, q = "-" if c < 0 else "", abs(c.numerator), c.denominator
    w = "world" if abs(k) == 1 else f"world**{abs(k)}"
    if k > 0:
        num = w if p == 1 else f"{p}*{w}"
        return sign + (num if q == 1 else f"{num}/{q}")
    if q == 1:
        if p == 1 and not sign and k < -1:
            return f"world**({k})"
        return f"{sign}{p}/{w}"
    return f"{sign}{p}/({q}*{w})"


class Cond(Term):
    """A condition. op: true, false, eq, ne, lt, le, gt, ge (args = (Expr, Expr)), and, or (args =
    Conds), not (args = (Cond,)), in (args = (Expr, (allowed constants, ...)))."""

    __slots__ = ()

    def __bool__(self) -> bool:
        if self.op in ("true", "false"):
            return self.op == "true"
        raise TypeError("cannot decide a condition in world without a world size")


WORLD = Expr("poly", ((1, 1),))  # the world size: the polynomial 1 * world**1
ZERO = Expr("const", (0,))
ONE = Expr("const", (1,))
MINUS_ONE = Expr("const", (-1,))
TRUE = Cond("true", ())
FALSE = Cond("false", ())


def as_expr(v: object, strict: bool = True) -> Expr | None:
    """int / Fraction / float -> a constant; an Expr as is. Anything else: TypeError (or None)."""
    if isinstance(v, Expr):
        return v
    if type(v) in (int, Fraction, float, bool):
        return Expr.const(v)  # type: ignore[arg-type]
    if strict:
        raise TypeError(f"not a number: {v!r}")
    return None


def number(v: int | float) -> Expr:
    return Expr.const(v)


# ---- folding operations (evaluate=True: what `a + b` in a spec means)


def add(a: Expr, b: Expr) -> Expr:
    if a.op == "const" and b.op == "const":
        return Expr.const(a.args[0] + b.args[0])
    if a.is_zero and not a.is_Float:
        return b
    if b.is_zero and not b.is_Float:
        return a
    ta, tb = a._terms(), b._terms()
    if ta is not None and tb is not None:
        for k, c in tb.items():
            ta[k] = ta.get(k, 0) + c
        return Expr.poly(ta)
    return Expr.node("add", a, b)


def mul(a: Expr, b: Expr) -> Expr:
    if a.op == "const" and b.op == "const":
        return Expr.const(a.args[0] * b.args[0])
    for x, y in ((a, b), (b, a)):
        if x.op == "const" and type(x.args[0]) is not float:
            if x.args[0] == 0:
                return ZERO
            if x.args[0] == 1:
                return y
    ta, tb = a._terms(), b._terms()
    if ta is not None and tb is not None:
        ma, mb = a._monomial(), b._monomial()
        if ma is not None and ma[0] == 0:  # a constant times a polynomial: sympy distributes it
            return Expr.poly({k: ma[1] * c for k, c in tb.items()})
        if mb is not None and mb[0] == 0:
            return Expr.poly({k: mb[1] * c for k, c in ta.items()})
        if ma is not None and mb is not None:  # c * world**j times d * world**k
            return Expr.poly({ma[0] + mb[0]: ma[1] * mb[1]})
    return Expr.node("mul", a, b)


def div(a: Expr, b: Expr) -> Expr:
    """a / b; the caller has refused a constant zero b."""
    if b.op == "const" and a.op == "const":
        x, y = a.args[0], b.args[0]
        if type(x) is float or type(y) is float:
            return Expr.const(x / y)
        return Expr.const(Fraction(x, 1) / y)
    return mul(a, power(b, MINUS_ONE))


def floor(x: Expr) -> Expr:
    return _round(x, "floor", math.floor)


def ceiling(x: Expr) -> Expr:
    return _round(x, "ceiling", math.ceil)


def _round(x: Expr, op: str, fn: Any) -> Expr:
    if x.op == "const":
        v = x.args[0]
        if type(v) is float and not math.isfinite(v):
            return Expr.node(op, x)
        return Expr.const(fn(v))
    if _whole_valued(x):
        return x
    return Expr.node(op, x)


def mod(a: Expr, b: Expr) -> Expr:
    """a % b (the sign of b, as Python and sympy.Mod); the caller has refused a constant zero b."""
    if a.op == "const" and b.op == "const" and b.args[0] != 0:
        return Expr.const(a.args[0] % b.args[0])
    # what sympy.Mod simplifies even in world: 0 % q, q % q, -q % q, and a whole number % 1
    if (a.is_zero and not a.is_Float) or a == b or a == -b or (b == 1 and _whole_valued(a)):
        return ZERO
    return Expr.node("mod", a, b)


def _whole_valued(x: Expr) -> bool:
    """A whole number for every world size (integer coefficients, no negative power)."""
    t = x._terms()
    return t is not None and all(k >= 0 and type(c) is int for k, c in t.items())


def power(a: Expr, b: Expr) -> Expr:
    """a ** b. Raises NotReal where sympy gives zoo, nan, oo or a complex number."""
    if b.op == "const":
        e = b.args[0]
        if a.op == "const":
            return _const_power(a.args[0], e)
        if _is_exact(e) and type(e) is int:
            if e == 0:
                return ONE
            if e == 1:
                return a
            m = a._monomial()
            if m is not None:  # (c * world**k) ** e
                c = m[1] ** e if e > 0 else Fraction(1) / Fraction(m[1]) ** -e
                return Expr.poly({m[0] * e: c})
    if a.op == "const" and a.args[0] == 1 and type(a.args[0]) is int:
        return ONE
    return Expr.node("pow", a, b)


def _const_power(x: Const, e: Const) -> Expr:
    if type(x) is float or type(e) is float:
        if x == 0 and e < 0:
            raise NotReal("0 ** negative")
        try:
            if x < 0 and not float(e).is_integer():
                raise NotReal("negative base, fractional exponent")
            v = float(x) ** float(e)
        except (OverflowError, ValueError, ZeroDivisionError):
            raise NotReal("out of range") from None
        if not math.isfinite(v) or isinstance(v, complex):
            raise NotReal("out of range")
        return Expr.const(v)
    if type(e) is int:
        if x == 0 and e < 0:
            raise NotReal("0 ** negative")
        return Expr.const(Fraction(x) ** e if e < 0 else x ** e)
    # a fractional exponent p/q: exact when the base is a perfect q-th power, else left as is
    if x < 0:
        raise NotReal("negative base, fractional exponent")
    if x == 0:
        if e < 0:
            raise NotReal("0 ** negative")
        return ZERO
    fx = Fraction(x)
    p, q = e.numerator, e.denominator
    rn, rd = _root(fx.numerator, q), _root(fx.denominator, q)
    if rn is not None and rd is not None:
        r = Fraction(rn, rd)
        return Expr.const(r ** p if p >= 0 else Fraction(1) / r ** -p)
    return Expr.node("pow", Expr.const(x), Expr.const(e))


def _root(n: int, q: int) -> int | None:
    """The exact q-th root of n >= 0, or None."""
    if n < 2:
        return n
    r = round(n ** (1.0 / q)) if n.bit_length() < 1000 else _iroot(n, q)
    for c in (r - 1, r, r + 1):
        if c >= 0 and c**q == n:
            return c
    return None


def _iroot(n: int, q: int) -> int:
    lo, hi = 0, 1 << (n.bit_length() // q + 1)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if mid**q <= n:
            lo = mid
        else:
            hi = mid - 1
    return lo


def magnitude(v: Expr) -> float:
    """|v| of a constant, as a float (inf when beyond the float range)."""
    try:
        return abs(float(v))
    except (OverflowError, ValueError, TypeError):
        return math.inf


def too_large(base: Expr, exponent: Expr) -> bool:
    """A constant power whose result would have more than _MAX_BITS bits."""
    try:
        x = abs(base.args[0]) if base.op == "const" else magnitude(base)
        bits = math.log2(x) if x > 1 else 0.0
    except (OverflowError, ValueError, TypeError):
        return True
    return magnitude(exponent) * bits > _MAX_BITS


# ---- conditions


_ORDER = {"eq": lambda x, y: x == y, "ne": lambda x, y: x != y, "lt": lambda x, y: x < y,
          "le": lambda x, y: x <= y, "gt": lambda x, y: x > y, "ge": lambda x, y: x >= y}


def relation(op: str, a: Expr, b: Expr, evaluate: bool = True) -> Cond:
    """a <op> b; evaluated (as sympy's Eq(a, b)) when both sides are constants and evaluate is set."""
    assert op in _ORDER, op
    if evaluate and a.op == "const" and b.op == "const":
        return TRUE if _ORDER[op](a.args[0], b.args[0]) else FALSE
    return Cond(op, (a, b))


def both(*conds: Cond, evaluate: bool = True) -> Cond:
    if evaluate:
        if any(c.op == "false" for c in conds):
            return FALSE
        conds = tuple(c for c in conds if c.op != "true")
        if not conds:
            return TRUE
        if len(conds) == 1:
            return conds[0]
    return Cond("and", tuple(conds))


def either(*conds: Cond, evaluate: bool = True) -> Cond:
    if evaluate:
        if any(c.op == "true" for c in conds):
            return TRUE
        conds = tuple(c for c in conds if c.op != "false")
        if not conds:
            return FALSE
        if len(conds) == 1:
            return conds[0]
    return Cond("or", tuple(conds))


def negate(c: Cond, evaluate: bool = True) -> Cond:
    if evaluate and c.op in ("true", "false"):
        return FALSE if c.op == "true" else TRUE
    return Cond("not", (c,))


def member(v: Expr, allowed: tuple[int, ...]) -> Cond:
    return Cond("in", (v, tuple(allowed)))
