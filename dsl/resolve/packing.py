"""`train.packing`: how a causal LM's documents become samples, folded into each `hf_dataset`
source of `train.data` and `train.eval.data` (mixture parts included) as its ``packing`` option,
so that the plan carries one value per source and the runtime reads only that:

- ``windows``: ``True``, documents packed into ``seq_len`` windows, attention across them;
- ``documents``: ``"documents"``, the same windows with position ids restarting at each
  document, from which the model's mask builders keep attention inside each document;
- ``none``: ``False``, one padded sample per document.

Without `train.packing` each source's own ``packing`` argument (a bool, default true) stands,
as before; both at once is E0471 at the source's argument: there is one place that says it.
Whether the sources have documents to pack, and the model can be told their boundaries, is
dsl/packing_check.py's (E0470, E0472, E0473).
"""

from __future__ import annotations

from typing import Any

from .. import ast
from ..spec import DataSpec
from .coerce import enum_value
from .scope import Scope

PACKING_OPTION = {"windows": True, "documents": "documents", "none": False}  # train.packing -> the source's option


def packing_value(scope: Scope, entries: dict[str, ast.Assign]) -> str | None:
    """train.packing as written (``none`` lexes as the none literal), or None when not written."""
    if "packing" not in entries:
        return None
    if isinstance(entries["packing"].value, ast.NoneLit):
        return "none"
    return enum_value(scope, "train", "packing", entries)


def fold_packing(scope: Scope, data: DataSpec, packing: str, where: str) -> DataSpec:
    """`data` with every hf_dataset source's ``packing`` option set to `packing`'s value; E0471
    where a source writes its own."""
    if data.kind == "mix":
        parts = []
        for i, (kind, options) in enumerate(data.options["parts"]):
            part = fold_packing(scope, DataSpec(kind, dict(options)), packing, f"{where}[{i}]")
            parts.append((part.kind, tuple(sorted(part.options.items()))))
        return DataSpec("mix", {**data.options, "parts": tuple(parts)})
    if data.kind != "hf_dataset":
        return data  # no packing option: E0470 says whether that is a problem
    written = scope.spans.get(f"{where}.packing")
    if written is not None:
        scope.err("E0471", written, f"packing is given twice: here and as train.packing = {packing}",
                  label="the source's packing argument",
                  hint="remove this argument: train.packing decides for every source "
                       "(windows, documents or none)")
    options: dict[str, Any] = {**data.options, "packing": PACKING_OPTION[packing]}
    return DataSpec(data.kind, options)
