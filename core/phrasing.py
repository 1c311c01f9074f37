"""Phrasings shared by check (dsl/) and the runtime (runtime/, families/): a rule enforced in both
places reads the same in both. No imports: the runtime may use it without ppdsl.dsl."""

from __future__ import annotations


def not_divisible_by_tp(what: object, tp: object) -> str:
    """"vocab_size = 127 is not divisible by tp = 2": how every size that tp must divide is refused.
    `what` names the size and its value ("in_features = 30"); both may be str.format fields."""
    return f"{what} is not divisible by tp = {tp}"
