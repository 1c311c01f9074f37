"""The arguments of transformers' mask builders (masking_utils.create_*_mask) and blocks, for the
installed release: the one place that knows how their signatures moved (4.57: input_embeds,
cache_position, past_key_values, blocks returning tuples; 5.x: inputs_embeds, cache, tensors)."""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable


@functools.cache
def _parameters(builder: Callable[..., Any]) -> frozenset[str]:
    return frozenset(inspect.signature(builder).parameters)


@functools.cache
def _takes_any_keyword(forward: Callable[..., Any]) -> bool:
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(forward).parameters.values())


def build_mask(builder: Callable[..., Any], config: Any, hidden: Any, attention_mask: Any, position_ids: Any,
               **extra: Any) -> Any:
    """`builder(...)` for a forward without a cache over `hidden` (batch, seq, width); `extra`
    keywords go through where the installed builder takes them."""
    names = _parameters(builder)
    kwargs: dict[str, Any] = {"config": config, "attention_mask": attention_mask, "position_ids": position_ids,
                              **extra}
    kwargs["inputs_embeds" if "inputs_embeds" in names else "input_embeds"] = hidden
    if "cache" in names:
        kwargs["cache"] = None
    if "past_key_values" in names:
        kwargs["past_key_values"] = None
    if "cache_position" in names:
        import torch

        kwargs["cache_position"] = torch.arange(hidden.shape[1], device=hidden.device)
    return builder(**{k: v for k, v in kwargs.items() if k in names})


def call_block(block: Any, hidden: Any, *args: Any, **kwargs: Any) -> Any:
    """`block(hidden, *args, **kwargs)` with the keywords the installed block's forward takes (all
    of them when it takes ``**kwargs``), returning its hidden state (4.x blocks return tuples)."""
    forward = type(block).forward
    if not _takes_any_keyword(forward):
        names = _parameters(forward)
        kwargs = {k: v for k, v in kwargs.items() if k in names}
    out = block(hidden, *args, **kwargs)
    return out[0] if isinstance(out, tuple) else out
