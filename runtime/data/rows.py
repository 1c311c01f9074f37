"""What the table sources share to turn their rows into samples (`runtime.data.chat`,
`runtime.data.docs`, `runtime.data.pairs`): a table's errors as the runtime's ValueError, the
padded tensors a batch of rows fills, and the check of its ids against the model's vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ppdsl.core.task_loss import IGNORE_INDEX

__all__ = ["check_vocabulary", "dataset_errors", "padded_samples"]


@contextmanager
def dataset_errors() -> Iterator[None]:
    """A `ppdsl.core.tables.TableError` raised inside as ``ValueError("hf_dataset: ...")``, the
    user's to fix (the launcher's exit status 2)."""
    from ppdsl.core.tables import TableError

    try:
        yield
    except TableError as exc:
        raise ValueError(f"hf_dataset: {exc}") from None


def padded_samples(n: int, s: int, pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`n` samples of `s` positions for the rows to fill: ids (all `pad`), labels (all -100) and
    the attention mask (all 0), int64."""
    ids = torch.full((n, s), pad, dtype=torch.long)
    labels = torch.full((n, s), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((n, s), dtype=torch.long)
    return ids, labels, mask


def check_vocabulary(ids: torch.Tensor, vocab_size: int | None, path: str, tokenizer: str) -> None:
    """ValueError when the tokenizer in `tokenizer` gave dataset `path` an id outside the model's
    vocabulary."""
    if vocab_size is not None and int(ids.max()) >= vocab_size:
        raise ValueError(f"dataset {path}: the tokenizer in {tokenizer} gives id {int(ids.max())}, "
                         f"outside the model's vocabulary (vocab_size = {vocab_size})")
