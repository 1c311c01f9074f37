"""The arguments of transformers' mask builders (masking_utils.create_*_mask), for the installed
release: the one place that knows how their signature moved (4.57: input_embeds, cache_position,
past_key_values; 5.x: inputs_embeds, cache)."""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable


@functools.cache
def _parameters(builder: Callable[..., Any]) -> frozenset[str]:
    return frozenset(inspect.signature(builder).parameters)


def build_mask(builder: Callable[..., Any], config: Any, hidden: Any, attention_mask: Any, position_ids: Any) -> Any:
    """`builder(...)` for a forward without a cache over `hidden` (batch, seq, width)."""
    names = _parameters(builder)
    kwargs: dict[str, Any] = {"config": config, "attention_mask": attention_mask, "position_ids": position_ids}
    kwargs["inputs_embeds" if "inputs_embeds" in names else "input_embeds"] = hidden
    if "cache" in names:
        kwargs["cache"] = None
    if "past_key_values" in names:
        kwargs["past_key_values"] = None
    if "cache_position" in names:
        import torch

        kwargs["cache_position"] = torch.arange(hidden.shape[1], device=hidden.device)
    return builder(**{k: v for k, v in kwargs.items() if k in names})
