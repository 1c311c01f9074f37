"""A model config with nested blocks (`config { text_config { ... } }`): a dict whose dict values
are the blocks, at any depth. Plain functions over plain values, torch-free."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["FrozenDict", "deep_merge", "frozen", "leaves", "thawed"]


def deep_merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """`base` with `over`'s values over it; where both hold a dict under one key, those merge
    too (a nested block changes the keys it gives and keeps the others)."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def leaves(config: Mapping[str, Any], path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """(key path, value) of every value that is not a nested block, depth first in order."""
    for key, value in config.items():
        if isinstance(value, Mapping):
            yield from leaves(value, (*path, str(key)))
        else:
            yield (*path, str(key)), value


class FrozenDict(dict):
    """A nested block as a frozen plan holds it: a dict (it prints, compares and serialises as
    one) that is hashable and refuses changes."""

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(frozenset(self.items()))

    def __reduce__(self) -> tuple[Any, ...]:  # pickle and copy build it whole (not item by item)
        return FrozenDict, (dict(self),)

    def _frozen(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("a frozen config block cannot be changed")

    __setitem__ = __delitem__ = update = pop = popitem = setdefault = clear = _frozen  # type: ignore[assignment]
    __ior__ = _frozen  # type: ignore[assignment]


def frozen(value: Any) -> Any:
    """A plain JSON value as a frozen plan holds it: lists (at any depth) as tuples, dicts as FrozenDicts."""
    if isinstance(value, (list, tuple)):
        return tuple(frozen(v) for v in value)
    if isinstance(value, Mapping):
        return FrozenDict({k: frozen(v) for k, v in value.items()})
    return value


def thawed(value: Any) -> Any:
    """`frozen`'s value back as plain lists and dicts (strict HF configs refuse tuples)."""
    if isinstance(value, (list, tuple)):
        return [thawed(v) for v in value]
    if isinstance(value, Mapping):
        return {k: thawed(v) for k, v in value.items()}
    return value
