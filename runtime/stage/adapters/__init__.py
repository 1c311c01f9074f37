"""The torch half of each model family: how its stages run (forward pieces or the model's own
forward cut to the stage, loss, attention localisation under tp, init quirks). The family's
descriptor (``ppdsl.core.families``, torch-free, read by check) names its adapter class
(``Family.stage``); `stage_adapter` loads it.
"""

from __future__ import annotations

import functools
import importlib

from ppdsl.core.families import by_name

from ppdsl.runtime.stage.adapters.base import StageAdapter

__all__ = ["StageAdapter", "stage_adapter"]


@functools.lru_cache(maxsize=None)
def stage_adapter(name: str) -> StageAdapter:
    """The adapter of the family ``name``: one stateless instance per family."""
    family = by_name(name)
    module, _, cls = family.stage.partition(":")
    return getattr(importlib.import_module(module), cls)(family)
