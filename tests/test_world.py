"""World sizes: the exact condition compiler, the descriptions, and what check reports for a spec
whose world size is left free (or fixed with --world)."""

from __future__ import annotations

from fractions import Fraction

import pytest
import sympy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ppdsl.dsl.check import check_text
from ppdsl.dsl.spec import WORLD
from ppdsl.dsl.world import MAX_WORLD, Unsupported, compile_condition, describe, holds, value_at

W = WORLD

# ---- the compiler ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cond, true_at, false_at",
    [
        (sympy.Eq(sympy.Mod(W / 4, 1, evaluate=False), 0, evaluate=False), [4, 8, 4096], [1, 2, 6, 4095]),
        (sympy.Eq(sympy.Mod(W, 3), 0), [3, 6], [1, 4]),
        (sympy.Ge(W / 4, 1, evaluate=False), [4, 5, 100], [1, 3]),
        (sympy.Eq(W, 2 * 2 * (W / 4), evaluate=False), [3, 4, 7], []),  # exact: never rounds
        (sympy.Eq(sympy.floor(W / 3), 2), [6, 7, 8], [5, 9]),
        (sympy.Eq(sympy.ceiling(W / 3), 2), [4, 5, 6], [3, 7]),
        (sympy.Lt(W ** 2, 17), [1, 4], [5]),
        (sympy.Eq(2 ** W, 1024), [10], [9, 11]),
        (sympy.Eq(W ** -1, sympy.Rational(1, 8)), [8], [4]),
        (sympy.Ne(W, 3), [1, 2, 4], [3]),
        (sympy.Gt(W, 3), [4], [3]),
        (sympy.Le(W, 3), [3], [4]),
        (sympy.Or(sympy.Eq(W, 1), sympy.Eq(W, 5)), [1, 5], [2]),
        (sympy.Not(sympy.Eq(W, 1)), [2], [1]),
        (sympy.And(sympy.Eq(sympy.Mod(W, 2), 0), sympy.Gt(W, 4)), [6, 8], [4, 5]),
        (sympy.Eq(sympy.Mod(-W, 4), 1), [3, 7], [1, 4]),  # the remainder has the sign of the divisor
        (sympy.Eq(sympy.Float(0.5) * W, 2), [4], [3]),  # floats are exact binary fractions
        (sympy.true, [1, 7], []),
        (sympy.false, [], [1, 7]),
    ],
)
def test_compile_condition(cond: sympy.Basic, true_at: list[int], false_at: list[int]) -> None:
    fn = compile_condition(cond)
    for w in true_at:
        assert fn(w) is True, (cond, w)
    for w in false_at:
        assert fn(w) is False, (cond, w)


def test_compile_refuses_what_it_cannot_decide() -> None:
    with pytest.raises(Unsupported):
        compile_condition(sympy.Eq(sympy.Symbol("x"), 1))
    with pytest.raises(Unsupported):
        compile_condition(sympy.Eq(sympy.sin(W), 0, evaluate=False))
    with pytest.raises(Unsupported):  # a float beyond the double range
        compile_condition(sympy.Eq(W, sympy.Float("1e400")))
    fractional = compile_condition(sympy.Eq(W ** sympy.Rational(1, 2), 2))
    with pytest.raises(Unsupported):
        fractional(4)
    huge = compile_condition(sympy.Gt(10 ** (W * 64), 0, evaluate=False))
    with pytest.raises(Unsupported):  # a result of about 850,000 digits is refused, not computed
        huge(4096)
    zero = compile_condition(sympy.Eq(sympy.Mod(8, W - 4, evaluate=False), 0))
    assert zero(4) is False  # x % 0 never holds


def test_division_by_zero_raises_for_the_caller() -> None:
    fn = compile_condition(sympy.Eq(8 / (W - 4), 2))
    assert fn(8) is True
    with pytest.raises(ZeroDivisionError):
        fn(4)


def test_holds() -> None:
    assert holds(sympy.Eq(sympy.Integer(4) % 2, 0), None)
    assert holds(sympy.Eq(sympy.Mod(W, 4), 0), 8)
    assert not holds(sympy.Eq(sympy.Mod(W, 4), 0), 6)


def test_value_at() -> None:
    assert value_at(W / 4, 8) == "2"
    assert value_at(W / 4, 6) == "1.5"
    assert value_at(W / 4, None) == "world/4"
    assert value_at(sympy.Integer(7), None) == "7"
    assert value_at(sympy.Rational(2, 3), None) == "0.666667"
    assert value_at(sympy.Eq(W, 4), 4) == "true"
    assert value_at(8 / (W - 4), 4) == "8/(world - 4)"  # undefined at 4: the symbolic form


_leaf = st.one_of(st.just(W), st.integers(-6, 12).map(sympy.Integer),
                  st.tuples(st.integers(-6, 12), st.integers(1, 6)).map(lambda t: sympy.Rational(*t)))


def _node(children: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(
        st.tuples(children, children).map(lambda t: t[0] + t[1]),
        st.tuples(children, children).map(lambda t: t[0] * t[1]),
        st.tuples(children, st.integers(1, 5)).map(lambda t: t[0] / t[1]),
        st.tuples(children, st.integers(1, 5)).map(lambda t: sympy.Mod(t[0], t[1])),
        st.tuples(children, st.integers(0, 3)).map(lambda t: t[0] ** t[1]),
        children.map(lambda x: sympy.floor(x / 2)),
    )


_exprs = st.recursive(_leaf, _node, max_leaves=6)
_relations = st.sampled_from([sympy.Eq, sympy.Ne, sympy.Lt, sympy.Le, sympy.Gt, sympy.Ge])


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), database=None, derandomize=True)
@given(_exprs, _relations, _exprs, st.booleans())
def test_compiler_agrees_with_sympy(a: sympy.Expr, rel: type, b: sympy.Expr, evaluate: bool) -> None:
    """Differential: the compiled condition decides exactly what sympy decides after substitution."""
    try:
        cond = rel(a, b, evaluate=evaluate)
    except TypeError:
        return  # sympy refuses to order something complex: never built by the checker either
    fn = compile_condition(cond)
    for w in (1, 2, 3, 4, 6, 12, 97):
        expected = cond.subs(WORLD, w)
        if expected not in (sympy.true, sympy.false):
            expected = sympy.simplify(expected)
        if expected not in (sympy.true, sympy.false):
            continue  # nan / zoo after substitution: sympy itself cannot decide
        try:
            got = fn(w)
        except (ZeroDivisionError, Unsupported):
            continue  # check treats these as "does not hold"
        assert got == bool(expected), (cond, w)


# ---- descriptions ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "worlds, text",
    [
        ([4, 8, 16], "multiples of 4 that divide 16: 4, 8, 16"),
        ([1, 2, 4, 8], "divisors of 8: 1, 2, 4, 8"),
        (list(range(4, MAX_WORLD + 1, 4)), f"multiples of 4 (checked up to {MAX_WORLD})"),
        (list(range(1, MAX_WORLD + 1)), f"any world size (checked up to {MAX_WORLD})"),
        ([8, 12, 16, 20, 24], "multiples of 4 from 8 to 24"),
        (list(range(8, MAX_WORLD + 1, 4)), f"multiples of 4 from 8 on (checked up to {MAX_WORLD})"),
        ([3, 4, 5, 6], "world sizes from 3 to 6"),
        ([8], "world = 8"),
        ([], f"no world size up to {MAX_WORLD}"),
        ([6, 10, 15], "6, 10, 15"),
        (list(range(6, 200, 6)), "multiples of 6 from 6 to 198"),
        ([2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43], "2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, ... (14 sizes)"),
    ],
)
def test_describe(worlds: list[int], text: str) -> None:
    assert describe(worlds) == text


# ---- what check reports ---------------------------------------------------------------------------

BASE = """ppspec 1
model tiny {{
  source = python("ppdsl.models.decoder:build_decoder")
  config {{ vocab_size = 128, dim = 64, n_layers = 8, n_heads = 4, max_seq_len = 64 }}
}}
mesh {{
{mesh}
}}
pipeline {{
  style = 1f1b
{pipeline}
}}
train {{
  global_batch = {batch}
  seq_len = 32
}}
{extra}
"""


def spec(mesh: str = "  tp = 2\n  pp = 2", pipeline: str = "  microbatches = 4", batch: str = "16", extra: str = "") -> str:
    return BASE.format(mesh=mesh, pipeline=pipeline, batch=batch, extra=extra)


def test_valid_for_some_world_sizes() -> None:
    r = check_text(spec())  # dp must divide 16 / 4 = 4
    assert r.ok
    assert r.valid_worlds == (4, 8, 16)
    assert r.worlds == "multiples of 4 that divide 16: 4, 8, 16"


def test_valid_for_every_multiple() -> None:
    r = check_text(spec(pipeline="  microbatch_size = 2", batch="dp * 8"))
    assert r.ok, r.diagnostics
    assert r.valid_worlds == tuple(range(4, MAX_WORLD + 1, 4))
    assert r.worlds == f"multiples of 4 (checked up to {MAX_WORLD})"


def test_fixed_data_parallel_fixes_the_world() -> None:
    r = check_text(spec(mesh="  tp = 2\n  pp = 2\n  dp = 2"))
    assert r.ok
    assert r.valid_worlds == (8,)
    assert r.worlds == "world = 8"


def test_valid_for_none_reports_each_rule_alone() -> None:
    r = check_text(spec(extra='require world % 3 == 0 "a multiple of 3"'))
    assert not r.ok
    codes = [(d.code, d.severity.value) for d in r.diagnostics]
    assert codes[0] == ("E0601", "error")
    notes = {d.code: d.message for d in r.diagnostics if d.severity.value == "note"}
    assert notes["E0201"].endswith("holds for multiples of 4 (checked up to 4096)")
    assert notes["E0302"].endswith("holds for divisors of 16: 1, 2, 4, 8, 16")
    assert notes["E0501"] == "a multiple of 3: holds for multiples of 3 (checked up to 4096)"
    assert sum(d.is_error for d in r.diagnostics) == 1


def test_a_rule_that_holds_for_no_world_size_is_the_error() -> None:
    """Not E0601 ("the rules never hold together"): one rule alone never holds up to MAX_WORLD."""
    r = check_text(spec(mesh="  tp = 2\n  pp = 2\n  dp = 2048", batch="2048 * 4"))
    (d,) = r.diagnostics
    assert d.code == "E0201"
    assert d.message == ("the world must split into data-parallel replicas of tp * pp = 4 ranks (dp = 2048): "
                         f"holds for no world size up to {MAX_WORLD}")
    assert d.hint.endswith(f"world sizes above {MAX_WORLD} are not searched: check one with --world N")
    assert check_text(spec(mesh="  tp = 2\n  pp = 2\n  dp = 2048", batch="2048 * 4"), world=8192).ok
    r = check_text(spec(pipeline="  microbatches = 3", batch="16"))  # 16 = dp * 3 * mbs has no solution
    assert [d.code for d in r.diagnostics] == ["E0302"]
    assert r.diagnostics[0].message.endswith(f"holds for no world size up to {MAX_WORLD}")


@pytest.mark.parametrize("world, ok", [(4, True), (8, True), (16, True), (12, False), (6, False), (32, False), (1, False)])
def test_world_verdicts(world: int, ok: bool) -> None:
    r = check_text(spec(), world=world)
    assert r.ok is ok, r.diagnostics
    assert r.world == world
    assert r.valid_worlds is None
    if not ok:
        assert {d.code for d in r.diagnostics} <= {"E0201", "E0302"}


def test_world_verdict_messages_name_the_values() -> None:
    r = check_text(spec(), world=6)
    (d,) = r.diagnostics
    assert d.code == "E0201"
    assert d.message == "world = 6 does not split into data-parallel replicas of tp * pp = 4 ranks"
    assert d.label == "dp = 1.5"
    r = check_text(spec(), world=32)
    (d,) = r.diagnostics
    assert d.code == "E0302"
    assert d.message == "global_batch = 16 does not split into dp = 8 replicas x 4 microbatches of 0.5 samples"


def test_world_in_expressions() -> None:
    r = check_text(spec(mesh="  tp = 2\n  pp = world // 4", batch="64", extra="require world <= 32"))
    assert r.ok, r.diagnostics
    # pp = world // 4 and dp = world / (2 * pp); the require cuts at 32
    assert r.valid_worlds and set(r.valid_worlds) <= set(range(4, 33))
    for w in r.valid_worlds:
        assert check_text(spec(mesh="  tp = 2\n  pp = world // 4", batch="64", extra="require world <= 32"), world=w).ok


def test_every_reported_world_passes_and_the_others_fail() -> None:
    text = spec(mesh="  tp = 2\n  pp = 2", batch="48")
    r = check_text(text)
    assert r.valid_worlds == (4, 8, 12, 16, 24, 48)  # microbatch_size = 48 / (dp * 4) -> dp divides 12
    assert r.worlds == "multiples of 4 that divide 48: 4, 8, 12, 16, 24, 48"
    for w in range(1, 25):
        assert check_text(text, world=w).ok is (w in r.valid_worlds), w


def test_value_checked_at_a_fraction_is_exact() -> None:
    # microbatch_size = 3 / dp: holds for dp = 1 and 3 only, never by float rounding
    r = check_text(spec(pipeline="  microbatches = 4", batch="12"))
    assert r.valid_worlds == (4, 12)
    assert Fraction(12, 4 * 3) == 1
