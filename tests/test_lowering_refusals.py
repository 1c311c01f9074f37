"""What check accepts, lowering lowers (issue 30, item 4): no uncoded refusal after check.

Every refusal a spec can meet is a catalogue code raised by check. Lowering states what it relies
on as an `assert` naming the code that proves it (a failure is a bug in ppdsl, which the command
line reports as `ppdsl: internal error`). Here the AST of lowering/*.py (and of the schedule
generators lowering calls) is walked: each `raise` must be one listed below, with the reason it
is no refusal of a checked spec, so a new uncoded `raise ValueError` cannot creep in.
"""

from __future__ import annotations

import ast
import random
import re
from pathlib import Path

import pytest

from ppdsl.dsl.blocks import block_count, range_problems
from ppdsl.dsl.catalogue import RULES
from ppdsl.lowering.stages import check_ranges, cost_split, even_split

ROOT = Path(__file__).resolve().parent.parent
WALKED = ("lowering/*.py", "core/schedules/*.py")

_GENERATORS = ("style_problem's arguments: check decides them at its world (E0202, E0301, E0303 to E0307 as rules, "
               "E0312 by generating the very schedule lowering generates); `ppdsl schedule --style` without a spec "
               "prints them as a usage error")
_SIMULATOR = ("the simulator's checks of a hand-built Schedule or cost function (a library API, tested as such); "
              "lowering passes it schedules generate() built and the profile's finite costs")

# (file, function, exception) -> why it is no refusal of a spec check accepted
ALLOWED: dict[tuple[str, str, str], str] = {
    ("lowering/costs.py", "calibration_factor", "ValueError"):
        "ppdsl tune's calibration of its own traced run against the --profile it was given: not lowering of a spec",
    ("core/schedules/__init__.py", "generate", "ValueError"): _GENERATORS,
    ("core/schedules/_common.py", "raise_if", "ValueError"): _GENERATORS,
    ("core/schedules/profile.py", "CostProfile.from_json", "ValueError"):
        "reading a cost profile: check's E0314 (dsl/profile_check.py's load_profile) reports it with the spec's span",
    ("core/schedules/simulate.py", "simulate", "ValueError"): _SIMULATOR,
    ("core/schedules/simulate.py", "_check_shape", "ValueError"): _SIMULATOR,
    ("core/schedules/simulate.py", "_costs", "ValueError"): _SIMULATOR,
    # the message pass the simulator and the executor share: a hand-built action list it cannot run
    ("core/schedules/messages.py", "action_codes", "ValueError"): _SIMULATOR,
    ("core/schedules/messages.py", "_posts", "ValueError"): _SIMULATOR,
}


def _raises() -> list[tuple[str, str, str, int]]:
    """(file, enclosing function's qualified name, exception class, line) of every `raise X` walked."""
    out = []
    for pattern in WALKED:
        for path in sorted(ROOT.glob(pattern)):
            rel = path.relative_to(ROOT).as_posix()

            def walk(node: ast.AST, scope: tuple[str, ...]) -> None:
                for child in ast.iter_child_nodes(node):
                    if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                        walk(child, (*scope, child.name))
                        continue
                    if isinstance(child, ast.Raise) and child.exc is not None:
                        exc = child.exc.func if isinstance(child.exc, ast.Call) else child.exc
                        name = exc.id if isinstance(exc, ast.Name) else ast.unparse(exc)
                        out.append((rel, ".".join(scope), name, child.lineno))
                    walk(child, scope)

            walk(ast.parse(path.read_text(encoding="utf-8")), ())
    return out


def test_every_raise_in_lowering_is_listed_with_its_reason() -> None:
    found = _raises()
    unlisted = [f"{f}:{line} {fn}: raise {exc}" for f, fn, exc, line in found if (f, fn, exc) not in ALLOWED]
    assert not unlisted, ("a refusal after check: make it a rule of check (a catalogue code), or, where check "
                          "already proves it, an assert naming that code; or list it in ALLOWED with the reason "
                          "it is no refusal of a checked spec:\n" + "\n".join(unlisted))
    stale = set(ALLOWED) - {(f, fn, exc) for f, fn, exc, _ in found}
    assert not stale, f"listed but no longer raised (drop them): {sorted(stale)}"


def test_lowering_asserts_name_declared_codes() -> None:
    """The codes lowering's asserts (and their comments) say prove them exist in the catalogue."""
    for path in sorted(ROOT.glob("lowering/*.py")):
        for code in re.findall(r"\bE\d{4}\b", path.read_text(encoding="utf-8")):
            assert code in RULES, f"{path.name} names {code}, which dsl/catalogue.py does not declare"


def test_lower_py_raises_nothing() -> None:
    """lower.py and stages.py refuse nothing: check did."""
    assert not [r for r in _raises() if r[0] in ("lowering/lower.py", "lowering/stages.py")]


def test_check_and_lowering_hold_one_range_rule() -> None:
    """E0309 / E0311 at check and lowering's check_ranges are dsl/blocks.py's one rule."""
    rng = random.Random(30)
    for _ in range(300):
        n, stages = rng.randint(1, 12), rng.randint(1, 5)
        cuts = sorted(rng.randint(0, n + 1) for _ in range(stages - 1))
        ranges = list(zip([0, *cuts], [*cuts, n + rng.choice((0, 0, 1, -1))]))
        if rng.random() < 0.2 and len(ranges) > 1:
            rng.shuffle(ranges)
        problems = list(range_problems(ranges, n))
        assert all(p.code in ("E0309", "E0311") for p in problems)
        if problems:
            with pytest.raises(AssertionError, match="E0309, E0311"):
                check_ranges(ranges, n, len(ranges))
        else:
            check_ranges(ranges, n, len(ranges))
    for n, stages in ((13, 4), (5, 5), (30, 7)):
        assert not list(range_problems(even_split(n, stages), n))
        assert not list(range_problems(cost_split([1.0] * n, stages, 3.0, 1.0), n))


def test_block_count_is_the_models_else_the_configs() -> None:
    class M:
        def __init__(self, children: tuple[str, ...]) -> None:
            self.children = children

    class Info:
        modules = {"model.layers": M(("0", "1", "2")), "model": M(("layers", "norm"))}

    assert block_count("model.layers", {"layers": 8}, Info()) == 3  # the built model wins
    assert block_count("h", {"layers": 8}, Info()) == 8  # not a module of it: the config's count
    assert block_count("h", {"layers": 8}, None) == 8
    assert block_count("h", {}, None) is None  # E0429 without the model
    assert block_count("h", {"layers": True}, None) is None


PAIRED = ROOT / "tests" / "golden" / "E0308_model_has_fewer_blocks.ppspec"


def test_E0308_is_decided_on_the_models_blocks_at_every_world() -> None:
    """The config says 4 layers, the model has 2 blocks: with `pp = world` the rule, not model_check
    at one pp, must leave out the worlds whose stages the model's blocks cannot fill."""
    from ppdsl.dsl.check import _decide, check_file

    spec = check_file(str(PAIRED), world=4, model=False).spec
    assert spec is not None and spec.model.dims["layers"] == 4
    assert not [d for d in _decide(spec, 4)[0] if d.code == "E0308"]  # on the config's count: 4 stages fill
    found = [d for d in _decide(spec, 4, blocks=2)[0] if d.code == "E0308"]
    assert [d.message for d in found] == ["2 blocks cannot fill pp * chunks = 4 stages: some stage would be empty"]
    assert (found[0].span.line, found[0].span.column) == (10, 8)
    _, valid, _ = _decide(spec, None, blocks=2)
    assert valid == (1, 2)


def test_a_model_with_fewer_blocks_than_its_config_says_plans_where_check_accepts(capsys) -> None:
    pytest.importorskip("torch")
    from ppdsl import cli

    assert cli.main(["check", str(PAIRED)]) == 0
    assert "ok for divisors of 2: 1, 2" in capsys.readouterr().out
    assert cli.main(["plan", str(PAIRED), "--world", "2"]) == 0
    assert cli.main(["plan", str(PAIRED), "--world", "4"]) == 2  # E0308, not lowering's assert
    err = capsys.readouterr().err
    assert "error[E0308]" in err and "internal error" not in err
