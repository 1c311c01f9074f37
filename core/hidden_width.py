"""The width of the hidden state a model's blocks pass on: one rule for check's proofs,
lowering (`ModelRef.hidden`, which the runtime reads) and the memory model."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ppdsl.core.families.descriptor import DIM_ALIASES


def hidden_width(traced: int | None, written: int | None, config: Mapping[str, Any],
                 first_embedding: int | None) -> int | None:
    """In this order: the width the own forward's trace measured; the spec's hidden dimension
    (its config over the class's defaults, the family's keys first); the built model's config
    (an ``hf_pretrained`` directory's config.json included) under the usual hidden-size keys;
    the first module's embedding width when it is an embedding. None when none of them tells."""
    if traced:
        return int(traced)
    if written:
        return int(written)
    for key in DIM_ALIASES["hidden"]:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return first_embedding or None
