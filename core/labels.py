"""What a model's labels are, and how a label is read: the one rule check and the runtime share."""

from __future__ import annotations

from typing import Any

from .families import by_name

__all__ = ["class_id", "is_classification"]


def is_classification(family: str, target: str) -> bool:
    """Labels are one class id per sequence: a sequence-classification family, or any
    `...ForSequenceClassification` class; otherwise next tokens (causal LM)."""
    return by_name(family).task == "sequence_classification" or "ForSequenceClassification" in target


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
