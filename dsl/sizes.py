"""Sizes in bytes, as the language writes them (`train.device_memory = 80GiB`, `ppdsl check
--device-memory 141GB`) and as diagnostics show them.

A size is a number with a unit: `B`; decimal `KB`, `MB`, `GB`, `TB` (10^3 ...); binary `KiB`,
`MiB`, `GiB`, `TiB` (2^10 ...), the unit's case aside. Bare in a spec it is a whole number glued
to its unit (`80GiB` lexes as one word, like the style `1f1b`); quoted (`"1.5 TiB"`) or on the
command line it may have a fraction and a space. A plain number is bytes. Accelerators sell
their HBM in binary units written "GB": an "80GB" H100 has 80 GiB (a little less is free to use).
"""

from __future__ import annotations

import re

UNITS: dict[str, int] = {
    "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
UNIT_NAMES = "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"
MIN_DEVICE_MEMORY = 2**20  # a device memory below 1 MiB is a forgotten unit (`device_memory = 80`)

_SIZE = re.compile(r"\s*([0-9][0-9_]*(?:\.[0-9_]*)?(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*")


class SizeError(ValueError):
    """Why a text is not a size (the message says what a size looks like)."""


def parse_size(text: str) -> int:
    """Bytes of a size such as ``80GiB``, ``141 GB``, ``1.5TiB`` or ``85899345920`` (rounded down).
    Raises SizeError for anything else, or a size below one byte."""
    m = _SIZE.fullmatch(text)
    if m is None:
        raise SizeError(f"'{text}' is not a size")
    number, unit = m.group(1).replace("_", ""), m.group(2)
    scale = UNITS.get(unit.lower(), None) if unit else 1
    if scale is None:
        raise SizeError(f"'{unit}' in '{text}' is not a unit of size")
    try:
        value = int(float(number) * scale) if any(c in number for c in ".eE") else int(number) * scale
    except (ValueError, OverflowError):
        raise SizeError(f"'{text}' is not a size") from None
    if value < 1:
        raise SizeError(f"'{text}' is less than one byte")
    return value


def format_size(n: float) -> str:
    """``49152.1GiB``, ``8.5MiB``, ``512B``: as `ppdsl plan`'s table shows memory."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return f"{int(n)}B"


def written_size(n: int) -> str:
    """A size as a spec would write it: ``80GiB``, ``141GB`` when whole in such a unit, else bytes."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("TB", 10**12), ("GB", 10**9), ("MiB", 2**20), ("MB", 10**6)):
        if n % size == 0:
            return f"{n // size}{unit}"
    return str(n)
