"""The arrows between the floors: text -> AST -> checked spec (dsl/) -> plan (lowering/) ->
runtime (runtime/), all standing on core/, with the CLI and its views (ppdsl/) on top.

Every import is counted, also the lazy ones inside functions: an arrow is an arrow."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FLOORS = {"core": "ppdsl.core", "dsl": "ppdsl.dsl", "lowering": "ppdsl.lowering", "runtime": "ppdsl.runtime"}
TOP = ("ppdsl.cli", "ppdsl.tune", "ppdsl.lsp", "ppdsl.views", "ppdsl.completion")

# what each floor may not import
FORBIDDEN = {
    "core": ("ppdsl.dsl", "ppdsl.lowering", "ppdsl.runtime", *TOP),
    "dsl": ("ppdsl.lowering", "ppdsl.runtime", *TOP),
    "lowering": ("ppdsl.runtime", *TOP),
    "runtime": ("ppdsl.dsl", *TOP),
}
# A family's torch half is the runtime's (runtime/stage/adapters/): core/families holds its descriptor only,
# and no file of core/ is exempt.


def _package_of(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    parts[0] = FLOORS[parts[0]]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, module: str | None = None) -> set[str]:
    """The modules `path` imports; `module`: its import name (default: from where it lies)."""
    module = module or _package_of(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            out.add(name)
            out.update(f"{name}.{a.name}" for a in node.names)
    return out


def _floor_files(floor: str) -> list[Path]:
    return sorted((ROOT / floor).rglob("*.py"))


@pytest.mark.parametrize("floor", sorted(FORBIDDEN))
def test_no_floor_imports_one_above_it(floor: str) -> None:
    bad = []
    for path in _floor_files(floor):
        for name in _imports(path):
            if any(name == f or name.startswith(f + ".") for f in FORBIDDEN[floor]):
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, "\n".join(bad)


def test_the_scan_sees_relative_and_lazy_imports(tmp_path: Path) -> None:
    probe = tmp_path / "_layout_probe.py"  # read as if it were runtime/_layout_probe.py
    probe.write_text("def f():\n    from ..dsl import check\n")
    assert "ppdsl.dsl.check" in _imports(probe, "ppdsl.runtime._layout_probe")
