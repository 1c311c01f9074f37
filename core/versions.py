"""Whether an installed dependency lies inside the range ppdsl declares for it (pyproject.toml,
read back from the installed package's metadata, so the range is written once): the range CI
tests. Outside it check warns (W0430): a model may build and check, then train differently."""

from __future__ import annotations

import re
from importlib import metadata

__all__ = ["describe_range", "untested"]


def describe_range(specifier: str) -> str:
    """A declared range for people: ``>=4.57.6,<5.26,!=5.0.*,...,!=5.23.*`` (the releases CI
    does not test left out one by one) reads ``>=4.57.6,<5.26 except 5.0 to 5.23``."""
    parts = [p.strip() for p in specifier.split(",") if p.strip()]
    left_out = [p for p in parts if re.fullmatch(r"!=\d+\.\d+\.\*", p)]
    kept = sorted((p for p in parts if p not in left_out), key=lambda p: (not p.startswith(">"), p))
    minors = sorted(tuple(int(x) for x in p[2:-2].split(".")) for p in left_out)
    runs: list[list[tuple[int, ...]]] = []
    for m in minors:
        if runs and runs[-1][-1][0] == m[0] and runs[-1][-1][1] + 1 == m[1]:
            runs[-1].append(m)
        else:
            runs.append([m])
    text = ",".join(kept)
    named = [".".join(map(str, r[0])) + ("" if len(r) == 1 else " to " + ".".join(map(str, r[-1]))) for r in runs]
    return text + (" except " + ", ".join(named) if named else "")


def untested(dist: str) -> tuple[str, str] | None:
    """(installed version, declared range) when `dist` is installed outside the range ppdsl
    declares for it; None when inside, not installed, or nothing is declared. The range is the
    requirement as pip reads it (``req.specifier``)."""
    try:
        installed = metadata.version(dist)
        requires = metadata.requires("ppdsl") or []
    except metadata.PackageNotFoundError:
        return None
    try:  # packaging comes with transformers (and pip environments); without it nothing is said
        from packaging.requirements import InvalidRequirement, Requirement
        from packaging.version import InvalidVersion, Version
    except ImportError:
        return None
    for line in requires:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if req.name.lower() != dist.lower() or not str(req.specifier):
            continue
        try:
            version = Version(Version(installed).public)  # a local build tag (2.13.0+cpu) is the same release
        except InvalidVersion:
            return None
        return None if req.specifier.contains(version, prereleases=True) else (installed, str(req.specifier))
    return None
