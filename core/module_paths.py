"""Module paths as dotted names (``transformer.h.3.attn``): whether one lies under another, and
which lie above one. Torch-free, for check, lowering and the runtime alike."""

from __future__ import annotations

from collections.abc import Iterable


def under(path: str, prefix: str) -> bool:
    """``path`` is strictly inside the module ``prefix``."""
    return path.startswith(prefix + ".")


def under_any(name: str, paths: Iterable[str]) -> bool:
    """``name`` is one of ``paths`` or inside one of them."""
    return any(name == p or under(name, p) for p in paths)


def above(path: str) -> list[str]:
    """The paths of the modules that hold the module ``path``, the root ("") first: for the block
    list, the modules the stages split, each stage holding a part of them."""
    parts = path.split(".")
    return ["", *(".".join(parts[:i]) for i in range(1, len(parts)))]
