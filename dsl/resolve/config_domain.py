"""Config values outside the range the model's code can run (E0432).

The forward on meta (E0428) proves the shapes; these are values it cannot prove, because check
traces in eval mode on meta tensors: a dropout probability outside [0, 1] fails only when a
training step draws the mask, an input embedding without rows only when a real token id indexes
it, a classifier without outputs only in the loss. Each such config would pass the trace and
crash every worker at step 1.

The rules read the config as the model is built from it (written values over an hf_pretrained
directory's config.json), and name the key: at its line where the spec writes it, else at the
source (a config.json's value).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Iterator

from ..families import DIM_ALIASES

__all__ = ["DROPOUT_KEY", "config_domain_problems", "nested_domain_problems"]

# A probability the model drops with (HF's names: attention_dropout, hidden_dropout_prob,
# resid_pdrop, layerdrop, encoder_layerdrop, drop_path_rate, classifier_dropout, ...)
DROPOUT_KEY = re.compile(r"dropout|pdrop|layerdrop|drop_path|drop_rate", re.IGNORECASE)


def _number(v: object) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _dim_key(config: dict[str, Any], family_keys: dict[str, Any], dim: str) -> str | None:
    return next((k for k in (*family_keys.get(dim, ()), *DIM_ALIASES.get(dim, ())) if k in config), None)


def config_domain_problems(config: dict[str, Any], family_keys: dict[str, Any],
                           classification: bool) -> Iterator[tuple[str, str, str]]:
    """(key, message, hint) for each config value the model cannot run with."""
    for key, value in config.items():
        rates = [_number(v) for v in (value if isinstance(value, (list, tuple)) else [value])]  # (CvT: one per stage)
        if DROPOUT_KEY.search(key) and any(p is not None and not 0.0 <= p <= 1.0 for p in rates):
            yield (key, f"{key} = {value!r} is a dropout probability outside [0, 1]: the first training step "
                   "would fail in every worker (torch refuses such a rate when it draws the mask)",
                   f"set {key} to a rate between 0 and 1 (0 turns it off)")
    vocab_key = _dim_key(config, family_keys, "vocab")
    vocab = _number(config.get(vocab_key)) if vocab_key else None
    if vocab is not None and vocab < 1:
        yield (vocab_key, f"{vocab_key} = {config[vocab_key]!r}: the input embedding would have no rows, so no "
               "token id is in range (every worker fails at its first lookup)",
               f"set {vocab_key} to the tokenizer's vocabulary size (at least the largest token id + 1)")
    labels_key = _dim_key(config, family_keys, "labels")
    labels = _number(config.get(labels_key)) if labels_key else None
    if classification and labels is not None and labels < 1:
        yield (labels_key, f"{labels_key} = {config[labels_key]!r}: the classifier would have no outputs, so no "
               "label is in range (the loss fails in every worker)",
               f"set {labels_key} to the number of classes (1: regression)")


def nested_domain_problems(config: Mapping[str, Any], family_keys: dict[str, Any],
                           classification: bool, path: str = "") -> Iterator[tuple[str, str, str]]:
    """`config_domain_problems` over the config and each nested block in it (a sub-config such as
    `text_config`, at any depth), the key as a dotted path (`text_config.attention_dropout`). A
    nested block is judged by the generic names (`DIM_ALIASES`) and never as a classifier."""
    flat = {k: v for k, v in config.items() if not isinstance(v, Mapping)}
    for key, message, hint in config_domain_problems(flat, family_keys if not path else {}, classification and not path):
        yield (f"{path}{key}", message.replace(f"{key} = ", f"{path}{key} = ", 1),
               hint.replace(f"set {key} ", f"set {path}{key} ", 1))
    for key, value in config.items():
        if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
            yield from nested_domain_problems(value, family_keys, classification, f"{path}{key}.")
