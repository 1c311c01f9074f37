"""Whether an installed dependency lies inside the range ppdsl declares for it (pyproject.toml,
read back from the installed package's metadata, so the range is written once): the range CI
tests. Outside it check warns (W0430): a model may build and check, then train differently."""

from __future__ import annotations

from importlib import metadata

__all__ = ["untested"]


def untested(dist: str) -> tuple[str, str] | None:
    """(installed version, declared range) when `dist` is installed outside the range ppdsl
    declares for it; None when inside, not installed, or nothing is declared."""
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
