"""Module path patterns (`transformer.h[*].attn.c_attn`, `model.layers[0:4].mlp.up_proj`) -> paths."""

from __future__ import annotations

from typing import Iterable, Sequence

from .spec import PatternIndex, PatternSegment


def _indices(index: PatternIndex, count: int) -> range | list[int]:
    if index.kind == "all":
        return range(count)
    if index.kind == "one":
        return [index.start] if index.start is not None and index.start < count else []
    start = 0 if index.start is None else index.start
    stop = count if index.stop is None else min(index.stop, count)
    return range(start, stop)


def expand(pattern: Sequence[PatternSegment], list_len: "callable") -> list[str]:
    """All concrete paths of a pattern. `list_len(path)` gives the length of the module list at
    `path` (None when unknown: then only `[i]` indices expand)."""
    paths = [""]
    for seg in pattern:
        nxt = []
        for p in paths:
            base = f"{p}.{seg.name}" if p else seg.name
            if seg.index is None:
                nxt.append(base)
                continue
            count = list_len(base)
            if count is None:
                if seg.index.kind == "one" and seg.index.start is not None:
                    nxt.append(f"{base}.{seg.index.start}")
                continue
            nxt.extend(f"{base}.{i}" for i in _indices(seg.index, count))
        paths = nxt
    return paths


def match(pattern: Sequence[PatternSegment], modules: Iterable[str]) -> list[str]:
    """Paths among `modules` (a model's real module paths) that the pattern names, in model order."""
    module_list = list(modules)
    known = set(module_list)

    def list_len(path: str) -> int | None:
        n = 0
        while f"{path}.{n}" in known:
            n += 1
        return n if n else None

    found = set(expand(pattern, list_len))
    return [m for m in module_list if m in found]


def block_index(path: str, blocks: str) -> int | None:
    """`transformer.h.3.attn.c_attn`, `transformer.h` -> 3; None outside the blocks."""
    prefix = blocks + "."
    if not path.startswith(prefix):
        return None
    head = path[len(prefix):].split(".", 1)[0]
    return int(head) if head.isdigit() else None
