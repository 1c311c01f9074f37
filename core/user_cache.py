"""Where ppdsl keeps what it computes once and reads again (model facts, tokenized corpora):
``$PPDSL_CACHE_DIR``, else ``$XDG_CACHE_HOME/ppdsl`` (an absolute XDG path only, as the XDG
spec says), else ``~/.cache/ppdsl``. ``PPDSL_NO_CACHE=1`` turns every cache off. Stdlib only."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["ENV_DIR", "ENV_OFF", "caching_off", "user_cache_root"]

ENV_DIR = "PPDSL_CACHE_DIR"
ENV_OFF = "PPDSL_NO_CACHE"


def caching_off() -> bool:
    return os.environ.get(ENV_OFF, "") not in ("", "0")


def user_cache_root() -> Path:
    """The user's ppdsl cache folder (not created here)."""
    base = os.environ.get(ENV_DIR)
    if not base:
        xdg = os.environ.get("XDG_CACHE_HOME")
        base = os.path.join(xdg, "ppdsl") if xdg and os.path.isabs(xdg) else os.path.join(
            os.path.expanduser("~"), ".cache", "ppdsl")
    return Path(base)
