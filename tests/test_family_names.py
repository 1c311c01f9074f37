"""One model path: no code outside the family registry (core/families/) branches on a family's
name or identity; it asks the family's descriptor (`ppdsl.core.families.descriptor.Family`).

Read from the sources' AST: a comparison (``==``, ``!=``, ``in``, ``not in``, ``is``, ``is not``)
of an expression naming a family (its source text holds ``family``: ``spec.model.family``,
``family.name``, ``plan.model.family``) with a string literal that is a registered family's name
(or a tuple / list / set holding one), or any comparison with the registry's ``OWN`` / ``GENERIC``
descriptors, is reported as file:line.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from ppdsl.core.families import REGISTRY

ROOT = Path(__file__).resolve().parent.parent
REGISTRY_DIR = ROOT / "core" / "families"
SOURCES = sorted(p for d in ("dsl", "lowering", "runtime", "core", "ppdsl") for p in (ROOT / d).rglob("*.py")
                 if REGISTRY_DIR not in p.parents)
NAMES = frozenset({f.name for f in REGISTRY} | {"own", "generic"})
IDENTITIES = frozenset({"OWN", "GENERIC"})  # core/families' descriptor constants
_OPS = (ast.Eq, ast.NotEq, ast.In, ast.NotIn, ast.Is, ast.IsNot)
# only files that spell a family's name as a literal, or a registry constant, are parsed
_CANDIDATE = re.compile("|".join([*(f"{q}{re.escape(n)}{q}" for n in NAMES for q in "'\""),
                                   *(rf"\b{n}\b" for n in IDENTITIES)]))


def _names_family(node: ast.expr) -> bool:
    """A string literal naming a family, or a tuple / list / set holding one."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and node.value in NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_family(e) for e in node.elts)
    return False


def _is_identity(node: ast.expr) -> bool:
    """``OWN`` / ``GENERIC`` (or ``families.OWN``): a family's descriptor by identity."""
    return (isinstance(node, ast.Name) and node.id in IDENTITIES) or \
        (isinstance(node, ast.Attribute) and node.attr in IDENTITIES)


def family_comparisons(source: str, filename: str = "<source>") -> list[str]:
    """file:line and the text of each comparison that branches on a family's name or identity."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        for op, left, right in zip(node.ops, sides, sides[1:]):
            if not isinstance(op, _OPS):
                continue
            for literal, other in ((left, right), (right, left)):
                if _is_identity(literal) or (_names_family(literal) and "family" in ast.unparse(other)):
                    found.append((node.lineno, f"{filename}:{node.lineno}: {ast.unparse(node)}"))
                    break
    return [text for _, text in sorted(found)]


def test_detector_sees_name_and_identity_comparisons():
    """The detector itself: each way of branching on a family is caught, the descriptor's questions are not."""
    caught = [
        'spec.model.family == "own"', 'spec.model.family != "own"', 'family.name != "own"',
        'spec.model.family not in ("own", "generic")', '"gemma" == plan.model.family',
        'x and family.name in ["phi3", "opt"]', 'family_of(kind, target, config) is OWN',
        'by_name(name) is not families.GENERIC', 'family.name is "falcon"',
    ]
    for text in caught:
        assert family_comparisons(text), text
    for text in ('by_name(spec.model.family).layout_from_trace', 'kind == "python"', 'rule.style == "column"',
                 'family.name == name', 'data.kind in ("synthetic", "image_folder")'):
        assert not family_comparisons(text), text


def test_no_code_outside_the_registry_branches_on_a_family():
    assert SOURCES and all(REGISTRY_DIR not in p.parents for p in SOURCES)
    found = []
    for path in SOURCES:
        text = path.read_text(encoding="utf-8")
        if _CANDIDATE.search(text):
            found += family_comparisons(text, str(path.relative_to(ROOT)))
    assert not found, ("ask the family's descriptor (core/families/descriptor.py) instead of comparing its name "
                       "or identity:\n  " + "\n  ".join(found))
