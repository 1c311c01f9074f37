"""Exact values in `world` (ppdsl.dsl.exact): they fold, compare, evaluate and print as the sympy
expressions they replaced, and a cold `ppdsl check` loads neither sympy nor regex."""

from __future__ import annotations

import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest
import sympy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ppdsl.dsl import exact
from ppdsl.dsl.exact import WORLD, Expr, NotReal
from ppdsl.dsl.sympy_bridge import SYMPY_WORLD
from ppdsl.dsl.world import Unsupported, compile_condition, value_at

ROOT = Path(__file__).resolve().parent.parent
SPECS = sorted((ROOT / "specs").glob("*.ppspec"))

# ---- differential: the same operations on exact values and on sympy expressions ----------------

_OPS = ("+", "-", "*", "/", "//", "%", "**")


def _apply(op: str, a, b):
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    if op == "/":
        return a / b
    if op == "//":
        return a // b if isinstance(a, Expr) else sympy.floor(a / b)
    if op == "%":
        return a % b if isinstance(a, Expr) else sympy.Mod(a, b)
    return a**b


_leaf = st.one_of(st.just("world"), st.integers(-6, 12), st.tuples(st.integers(-6, 12), st.integers(2, 6)))
_tree = st.recursive(_leaf, lambda kids: st.tuples(st.sampled_from(_OPS), kids, kids), max_leaves=5)


def _build(tree) -> tuple[Expr, sympy.Expr] | None:
    """(exact, sympy) for a tree, or None where the spec language refuses it (division by zero,
    a power that is not a finite real number, an exponent that is not a small constant)."""
    if tree == "world":
        return WORLD, SYMPY_WORLD
    if isinstance(tree, int):
        return Expr.const(tree), sympy.Integer(tree)
    if isinstance(tree[0], int):
        return Expr.const(Fraction(*tree)), sympy.Rational(*tree)
    op, left, right = tree
    a, b = _build(left), _build(right)
    if a is None or b is None:
        return None
    if op in ("/", "//", "%") and b[0].is_zero:
        return None
    if op == "**" and not (b[0].is_Integer and -1 <= int(b[0]) <= 3):
        return None
    try:
        mine = _apply(op, a[0], b[0])
    except NotReal:
        return None
    return mine, _apply(op, a[1], b[1])


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck), database=None, derandomize=True)
@given(_tree)
def test_exact_values_agree_with_sympy(tree) -> None:
    built = _build(tree)
    if built is None:
        return
    mine, theirs = built
    assert str(mine) == str(theirs), tree
    if mine.is_number:
        assert sympy.sympify(mine) == theirs and mine.is_Integer == bool(theirs.is_Integer), tree
    else:
        # sympy sometimes simplifies a value in world to a constant (Mod(world, world) is 0); the
        # exact value keeps it and decides it per world size, with the same result (below)
        assert theirs.is_number or theirs.free_symbols == {SYMPY_WORLD}, tree
    for w in (1, 2, 3, 4, 6, 12):
        try:
            expected = theirs.subs(SYMPY_WORLD, w)
        except ZeroDivisionError:
            continue
        if not expected.is_Rational:
            continue  # zoo / nan after substitution: check treats that as "does not hold"
        try:
            got = compile_condition(exact.relation("eq", mine, Expr.const(0), evaluate=False))(w)
        except (ZeroDivisionError, Unsupported):
            continue
        assert got == (expected == 0), (tree, w)
        assert value_at(mine, w) == value_at(expected, w), (tree, w)


@pytest.mark.parametrize("text, expected", [
    ("world / 4", "world/4"), ("world * 8", "8*world"), ("4 * 4 * (world / 4)", "4*world"), ("16 / world", "16/world"),
    ("world / 4 * 3", "3*world/4"), ("world + 2 - 1", "world + 1"), ("2 - world", "2 - world"),
    ("(world + 1) * 2", "2*world + 2"), ("world // 3", "floor(world/3)"), ("world % 3", "Mod(world, 3)"),
    ("2 ** world", "2**world"), ("world ** 2 / 4", "world**2/4"), ("8 / (world - 4)", "8/(world - 4)"),
    ("world * 0.5", "0.5*world"), ("7 / 2", "7/2"), ("-7 / 2", "-7/2"), ("2.5", "2.50000000000000"),
    ("2 ** (1 / 2)", "sqrt(2)"), ("4 ** (1 / 2)", "2"), ("world - world + 3", "3"), ("(world / 4) * (4 / world)", "1"),
])
def test_prints_as_sympy_did(text: str, expected: str) -> None:
    from ppdsl.dsl.expr import to_expr
    from ppdsl.dsl.parse import parse

    doc = parse(f"mesh {{\n  tp = {text}\n}}\n")
    value = doc.items[0].entries[0].value
    assert str(to_expr(value, lambda name: WORLD)) == expected


def test_equal_values_compare_equal() -> None:
    assert 16 / (WORLD / 4 * 4) == 16 / WORLD
    assert WORLD / 4 * 4 == WORLD and 2 * WORLD == WORLD + WORLD
    assert Expr.const(4) == 4 and hash(Expr.const(4)) == hash(4)
    assert (WORLD / 4).subs(WORLD, 8) == 2 and not (WORLD / 4).subs(WORLD, 6).is_Integer
    assert sympy.simplify(sympy.sympify(WORLD / 4) - SYMPY_WORLD / 4) == 0


# ---- the cold path ----------------------------------------------------------------------------------


def test_cold_check_loads_neither_sympy_nor_regex_nor_torch() -> None:
    code = ("import sys\nfrom ppdsl.cli import main\n"
            f"codes = [main(['check', p, '--no-model']) for p in {[str(p) for p in SPECS]!r}]\n"
            "bad = sorted({m.split('.')[0] for m in sys.modules} & {'sympy', 'mpmath', 'regex', 'torch', 'transformers'})\n"
            # the run parser's table of torchrun's flags is torch-free data; nothing else of runtime/
            "bad += sorted(m for m in sys.modules if m.startswith(('ppdsl.runtime', 'ppdsl.models'))\n"
            "              and m not in ('ppdsl.runtime', 'ppdsl.runtime.run', 'ppdsl.runtime.run.torchrun_options'))\n"
            "print(codes, bad)\n"
            "raise SystemExit(0 if set(codes) == {0} and not bad else 1)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_regex_still_imports_after_the_parser() -> None:
    pytest.importorskip("regex")
    code = "import ppdsl.dsl.parse, regex\nprint(regex.compile('a+').match('aa').group())"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "aa", proc.stdout + proc.stderr


@pytest.mark.parametrize("expr", ["(2 ** 60) ** 60 * 0.5", "(2 ** 60) ** 60 / 0.5", "(0 - 8) ** (1 / 3)", "0 ** (0 - 1)"])
def test_numbers_out_of_range_are_diagnostics(expr: str) -> None:
    from ppdsl.dsl.check import check_text

    result = check_text((ROOT / "specs" / "tiny_cpu.ppspec").read_text() + f"\nrequire {expr} > 0\n")
    assert [d.code for d in result.diagnostics] == ["E0103"], result.diagnostics


@pytest.mark.parametrize("k", [-3, -2, -1, 1, 2, 3])
def test_a_power_of_world_prints_as_sympy_without_sympy(k: int) -> None:
    for c in [Fraction(n, d) for n in range(-5, 6) if n for d in range(1, 6)]:
        mine = Expr.poly({k: c})
        assert str(mine) == str(sympy.Rational(c.numerator, c.denominator) * SYMPY_WORLD**k), (c, k)
