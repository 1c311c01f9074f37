"""The tokenizer of a local directory that the text sources encode with: tokenizer.json through the
`tokenizers` library, or whatever transformers' AutoTokenizer reads (local files only).
"""

from __future__ import annotations

import os
from typing import Any


class _Tokenizer:
    """A tokenizer from a local directory: tokenizer.json through the `tokenizers` library, or
    anything else transformers' AutoTokenizer reads (local files only; nothing is downloaded)."""

    def __init__(self, directory: str, max_length: int | None = None):
        self.directory = directory
        if not os.path.isdir(directory):
            raise ValueError(f"tokenizer directory {directory} does not exist")
        tj = os.path.join(directory, "tokenizer.json")
        try:
            if os.path.isfile(tj):
                from tokenizers import Tokenizer

                self._fast: Any = Tokenizer.from_file(tj)
                self._fast.no_padding()
                if max_length is None:
                    self._fast.no_truncation()
                else:
                    self._fast.enable_truncation(max_length)
                self._auto = None
            else:
                from transformers import AutoTokenizer

                self._fast = None
                self._auto = AutoTokenizer.from_pretrained(directory, local_files_only=True)
        except Exception as exc:  # noqa: BLE001 - any failure to load is the user's file: say which
            raise ValueError(f"cannot load the tokenizer in {directory}: {type(exc).__name__}: {exc}") from None
        self.max_length = max_length

    @property
    def vocab_size(self) -> int:
        return int(self._fast.get_vocab_size(with_added_tokens=True)) if self._fast is not None else len(self._auto)

    def separator_id(self) -> int:
        """The id put between documents: `ppdsl.core.special_tokens.document_separator`'s token.
        ValueError when the tokenizer has none."""
        from ppdsl.core.special_tokens import COMMON_EOS, document_separator

        if self._fast is not None:
            lookup = self._fast.token_to_id
        else:
            vocab = self._auto.get_vocab()
            lookup = vocab.get
        token = document_separator(self.directory, lambda t: lookup(t) is not None)
        if token is None:
            raise ValueError(f"the tokenizer in {self.directory} has no end-of-sequence or separator token to put "
                             f"between documents (eos_token, sep_token, or one of {', '.join(COMMON_EOS)})")
        return int(lookup(token))

    @property
    def pad_id(self) -> int:
        if self._fast is not None:
            from ppdsl.core.special_tokens import COMMON_PAD

            for name in COMMON_PAD:
                i = self._fast.token_to_id(name)
                if i is not None:
                    return int(i)
            return 0
        pad = self._auto.pad_token_id
        return int(pad) if pad is not None else 0

    def encode(self, texts: list[str], special: bool) -> list[list[int]]:
        if not texts:
            return []
        if self._fast is not None:
            return [e.ids for e in self._fast.encode_batch(texts, add_special_tokens=special)]
        kw: dict[str, Any] = {"add_special_tokens": special}
        if self.max_length is not None:
            kw.update(truncation=True, max_length=self.max_length)
        return [list(r) for r in self._auto(texts, **kw)["input_ids"]]

    def encode_targets(self, texts: list[str]) -> list[list[int]]:
        """Targets of an encoder-decoder model, with special tokens: transformers' ``text_target=``
        (a tokenizer's target mode, such as Marian's or mBART's) where AutoTokenizer loaded it; a
        tokenizer.json has no target mode, and encodes them as texts."""
        if self._fast is not None or not texts:
            return self.encode(texts, special=True)
        kw: dict[str, Any] = {"add_special_tokens": True}
        if self.max_length is not None:
            kw.update(truncation=True, max_length=self.max_length)
        return [list(r) for r in self._auto(text_target=texts, **kw)["input_ids"]]
