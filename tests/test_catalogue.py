"""dsl/catalogue.py declares every diagnostic code once; the source, the docs and the constructors agree with it.

- every code literal in ppdsl's source is declared (the fuzz and golden runs check the codes and
  severities produced at run time: tests/test_fuzz.py, tests/test_golden_diagnostics.py);
- each code is raised from one module: a rule checked in two places (against the config and
  against the built model, say) is one function that both call;
- docs/diagnostics.md's table is the one generated from the catalogue, and every code has its section;
- error() / warning() / note() refuse an undeclared code or a severity the catalogue does not declare.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

from ppdsl.dsl import catalogue, diagnostics as dg

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted(p for d in ("dsl", "lowering", "runtime", "ppdsl") for p in (ROOT / d).rglob("*.py"))
CODE = re.compile(r"[EWN]0\d{3}")


def _code_literals(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    return {n.value for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and CODE.fullmatch(n.value)}


def test_every_code_in_the_source_is_declared() -> None:
    assert len(SOURCES) > 50
    undeclared = {f"{p.relative_to(ROOT)}: {c}" for p in SOURCES for c in _code_literals(p) if c not in catalogue.RULES}
    assert not undeclared, f"codes missing from dsl/catalogue.py: {sorted(undeclared)}"


# Codes raised from more than one module, each with why. Any other code raised from two modules
# fails the test below.
RAISED_FROM_SEVERAL = {
    # one rule, the family's refusal of a config (its descriptor's data), met in two situations:
    # a config value it cannot run (resolve, without the model) and a split it cannot run under
    # the config (model_check, on the built model)
    "E0407",
}


def test_each_code_is_raised_from_one_module() -> None:
    modules: dict[str, set[str]] = defaultdict(set)
    for p in SOURCES:
        if p != ROOT / "dsl" / "catalogue.py":  # which declares them all
            for c in _code_literals(p):
                modules[c].add(p.relative_to(ROOT).as_posix())
    several = {c: sorted(ms) for c, ms in sorted(modules.items()) if len(ms) > 1 and c not in RAISED_FROM_SEVERAL}
    assert not several, f"codes raised from several modules (one rule, one function that each place calls): {several}"


def test_the_docs_table_is_generated_from_the_catalogue() -> None:
    text = catalogue.DOCS.read_text(encoding="utf-8")
    assert catalogue.with_table(text) == text, \
        "docs/diagnostics.md's table differs from dsl/catalogue.py: run `.venv/bin/python -m ppdsl.dsl.catalogue --write-docs`"


def test_every_declared_code_has_its_section_in_the_docs() -> None:
    text = catalogue.DOCS.read_text(encoding="utf-8")
    sections = set(re.findall(r"^#### ([EWN]\d{4})$", text, re.M))
    assert sections == set(catalogue.RULES), (sorted(set(catalogue.RULES) - sections), sorted(sections - set(catalogue.RULES)))


def test_declarations_are_well_formed() -> None:
    for code, r in catalogue.RULES.items():
        assert CODE.fullmatch(code) and r.code == code
        assert r.severity.value[0].upper() == code[0], f"{code}: the letter says the severity"
        assert r.title and "|" not in r.title and "\n" not in r.title, code
        for key in r.depends_on + r.invalid_value:
            assert "." in key, f"{code}: {key} is not a dotted spec key"
        for hide in r.hides:
            assert all(c in catalogue.RULES for c in hide.codes), code


def test_constructors_refuse_undeclared_codes_and_wrong_severities() -> None:
    assert dg.error("E0203", None, "m").severity is dg.Severity.ERROR
    assert dg.diagnostic("W0217", None, "m").severity is dg.Severity.WARNING
    assert dg.note("E0203", None, "m").severity is dg.Severity.NOTE  # an E0601 note keeps its rule's code
    with pytest.raises(AssertionError, match="not declared"):
        dg.error("E0999", None, "m")
    with pytest.raises(AssertionError, match="not declared a warning"):
        dg.warning("E0203", None, "m")
    with pytest.raises(AssertionError, match="not declared an error"):
        dg.error("W0217", None, "m")
    with pytest.raises(AssertionError):
        dg.note("W0217", None, "m")


def test_the_cascade_reads_the_catalogue() -> None:
    assert catalogue.dependent_on({"mesh.tp"}) >= {"E0203", "E0204", "E0205", "E0206", "E0207", "E0208", "E0213", "E0214"}
    assert catalogue.dependent_on({"pipeline.chunks"}) == {"E0303", "E0305", "E0307", "E0308", "E0310"}
    assert "E0302" in catalogue.rule("E0201").hides[0].codes
