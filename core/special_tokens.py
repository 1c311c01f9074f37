"""The token ``hf_dataset`` puts between documents: one rule for check (which only says whether
there is one) and the ranks (which use its id). Stdlib only.

The tokenizer directory's own end-of-sequence token (``eos_token`` in tokenizer_config.json or
special_tokens_map.json), else its separator (``sep_token``: BERT's WordPiece tokenizers have
no EOS, their ``[SEP]`` ends a segment), else the first of the usual EOS spellings its
vocabulary holds. None: the tokenizer has none of them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

__all__ = ["COMMON_EOS", "COMMON_PAD", "document_separator"]

# a tokenizer.json's padding token, the first of these it holds (else id 0): what padded samples hold
COMMON_PAD = ("[PAD]", "<pad>", "<|pad|>", "<|endoftext|>")
COMMON_EOS = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|im_end|>", "[SEP]")
_CONFIGS = ("tokenizer_config.json", "special_tokens_map.json")


def _declared(directory: str, key: str) -> list[str]:
    out = []
    for name in _CONFIGS:
        try:
            with open(os.path.join(directory, name), "rb") as f:
                doc: Any = json.loads(f.read(4 << 20))
        except (OSError, ValueError):
            continue
        value = doc.get(key) if isinstance(doc, dict) else None
        if isinstance(value, dict):  # {"content": "</s>", ...}
            value = value.get("content")
        if isinstance(value, str) and value:
            out.append(value)
    return out


def document_separator(directory: str, known: Callable[[str], bool]) -> str | None:
    """The separator token of the tokenizer in `directory` (see the module docstring); `known`:
    whether the tokenizer's vocabulary holds a token."""
    for token in (*_declared(directory, "eos_token"), *_declared(directory, "sep_token"), *COMMON_EOS):
        if known(token):
            return token
    return None
