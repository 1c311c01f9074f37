"""What a model's labels are, and how a label is read: the one rule check and the runtime share."""

from __future__ import annotations

from typing import Any, Mapping

from .families import by_name, hf_class_of

__all__ = ["class_id", "is_classification"]


def is_classification(family: str, kind: str, target: str, config: Mapping[str, Any]) -> bool:
    """Labels are one class id per sequence: a sequence-classification family, or any
    `...ForSequenceClassification` class (an hf_pretrained directory's: its config's
    ``architectures``); otherwise next tokens (causal LM)."""
    hf_class = hf_class_of(kind, target, config) or ""
    return by_name(family).task == "sequence_classification" or any(
        "ForSequenceClassification" in name for name in (hf_class, target))


def class_id(v: Any) -> int | None:
    """An integer class id: a JSON integer, or a string holding one (CSV values are strings)."""
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, str):
        try:
            return int(v.strip())
        except ValueError:
            return None
    return None
