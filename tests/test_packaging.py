"""The wheel holds every package: setup.py finds them with setuptools' find_packages, which sees
a folder only through its __init__.py. (.ci/wheel_check builds and installs the real wheel; this
is its fast half, for the folder that would be missed.)"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _trees() -> dict[str, str]:
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and [t.id for t in node.targets if isinstance(t, ast.Name)] == ["TREES"]:
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py has no TREES")


def test_every_source_folder_is_a_package() -> None:
    missing = []
    for folder in _trees().values():
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "__pycache__" not in path.parts and not (path.parent / "__init__.py").exists():
                missing.append(str(path.parent.relative_to(ROOT)))
    assert not missing, f"folders without __init__.py (left out of the wheel): {sorted(set(missing))}"


def test_the_trees_are_the_floors_under_one_import_name() -> None:
    assert _trees() == {"ppdsl": "ppdsl", "ppdsl.core": "core", "ppdsl.dsl": "dsl",
                        "ppdsl.lowering": "lowering", "ppdsl.runtime": "runtime"}
