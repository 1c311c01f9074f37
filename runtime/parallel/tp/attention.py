"""Make HF attention modules work on local heads once their projections are column-split.

Which attributes a family's attention reads (head counts, fused split sizes) is the family's
knowledge: its torch half's ``attention_changes`` (runtime/stage/adapters/<name>.py) returns the
(attribute, global, local) rewrites, read from transformers 5.24's forward. This module applies
them once per module. Every family checks that its head counts divide by tp.
"""

from __future__ import annotations

import attrs
from torch import nn

from ppdsl.core.families import attention_family, hf_attention_classes

__all__ = ["SUPPORTED_ATTENTION", "AttentionLocalization", "localize_attention"]

_MARK = "_ppdsl_tp_size"

SUPPORTED_ATTENTION: tuple[str, ...] = hf_attention_classes()


@attrs.frozen
class AttentionLocalization:
    """What `localize_attention` changed: (attribute, global value, local value) triples."""

    family: str
    tp_size: int
    changes: tuple[tuple[str, int, int], ...]


def localize_attention(module: nn.Module, tp_size: int) -> AttentionLocalization:
    """Rewrite the head-count / width attributes of an HF attention module whose projections
    are (or will be) column-split over `tp_size` ranks, in place. Raises ValueError for an
    unknown attention class, indivisible head counts, or a module already localized."""
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    cls = type(module).__name__
    family = attention_family(cls)
    if family is None:
        raise ValueError(
            f"no tensor-parallel rule for attention class {type(module).__module__}.{cls}; "
            f"supported: {', '.join(SUPPORTED_ATTENTION)}"
        )
    if hasattr(module, _MARK):
        raise ValueError(
            f"{cls} was already localized for tp = {getattr(module, _MARK)}; "
            "localizing twice would divide its head counts again"
        )
    from ppdsl.runtime.stage.adapters import stage_adapter

    changes = stage_adapter(family.name).attention_changes(module, tp_size)
    for name, _, local in changes:
        setattr(module, name, local)
    setattr(module, _MARK, tp_size)
    return AttentionLocalization(family=family.name, tp_size=tp_size, changes=tuple(changes))
