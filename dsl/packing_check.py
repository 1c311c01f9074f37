"""Check-time rules of `train.packing` (dsl/resolve/packing.py folds it into the sources):

- E0470: a source without documents to pack that way: ``documents`` and ``none`` need
  `hf_dataset` documents or conversations (`messages`) of a causal LM; ``windows`` takes the
  documents and the token streams (`tokens`, `text`, `synthetic`), not conversations (packed, they
  are packed whole, each attending to itself: ``documents``). A classifier's examples,
  source/target pairs (`target`) and images are one padded sample each, whatever packing says.
- E0473: ``documents`` with ``cp > 1``: context parallelism's attention builds its own causal
  mask over the whole sequence (runtime/parallel/context.py), blind to document boundaries.
- E0472 (with the model): ``documents`` for a model that cannot be told where each document
  starts: a python factory, a family whose stages do not pass the microbatch's position ids to
  the blocks, or a forward the probe (`ppdsl.dsl.packing_probe`) does not prove.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from ppdsl.core.document_masks import MASKED_IMPLEMENTATIONS
from ppdsl.core.families import by_name
from ppdsl.core.labels import is_classification
from .diagnostics import Diagnostic, error
from .exact import Expr
from .spec import DataSpec, Spec

if TYPE_CHECKING:
    from ppdsl.dsl.introspect import ModelInfo

__all__ = ["check_packing", "check_packing_model"]

STREAMS = ("tokens", "text", "synthetic")  # already windows: train.packing = windows changes nothing


def _sources(spec: Spec) -> Iterator[tuple[str, DataSpec]]:
    evaluation = spec.train.eval
    for where, data in (("train.data", spec.train.data),
                        *((("train.eval.data", evaluation.data),) if evaluation else ())):
        if data.kind == "mix":
            from .resolve.data_mix import parts_of

            for i, part in enumerate(parts_of(data)):
                yield f"{where}[{i}]", part
        elif data.kind != "holdout":  # train.data's own items
            yield where, data


def _no_documents(spec: Spec, data: DataSpec, mode: str) -> str | None:
    """Why `data` cannot be packed as `mode`, or None."""
    if _classification(spec):
        return "the model classifies sequences: its examples are padded one per sample"
    if data.kind == "hf_dataset":
        if data.options.get("messages") is not None:
            return None if mode != "windows" else ("its conversations are packed whole, each attending only to "
                                                   "itself: packing = documents")
        if data.options.get("target") is not None:
            return "its source/target pairs are one padded sample each"
        return None
    if mode == "windows" and data.kind in STREAMS:
        return None
    what = "a token stream without document boundaries" if data.kind in STREAMS else {
        "image_folder": "images", "audio_folder": "audio clips with their transcripts",
        "image_text_folder": "images with their captions"}.get(data.kind, "classification examples")
    return f"{data.kind}(...) gives {what}"


def check_packing(spec: Spec) -> list[Diagnostic]:
    """E0470 and E0473 (see the module docstring); for conversations, E0470 also where a source
    writes its own ``packing`` (it packs documents only: conversations by train.packing)."""
    out = [error("E0470", spec.span(f"{where}.packing"), f"{where}: packing = ... of hf_dataset(...) packs documents; "
                 "these are conversations, packed by train.packing", label="no effect on conversations",
                 hint="remove it; train { packing = documents } packs conversations whole")
           for where, data in _sources(spec)
           if spec.train.packing is None  # else E0471: given twice
           and data.options.get("messages") is not None and f"{where}.packing" in spec.spans]
    mode = spec.train.packing
    if mode is None:
        return out
    span = spec.span("train.packing")
    for where, data in _sources(spec):
        why = _no_documents(spec, data, mode)
        if why is not None:
            out.append(error("E0470", span, f"packing = {mode} needs documents of a causal LM, but {where}: {why}",
                             label=f"{where} has no documents to pack this way",
                             hint="use packing = documents (or none: one padded sample per conversation)"
                                  if data.options.get("messages") is not None else
                                  "remove train.packing, or read documents with hf_dataset(path, tokenizer, "
                                  "text = \"...\") on a causal LM"))
    cp = spec.mesh.cp
    if mode == "documents" and isinstance(cp, Expr) and not (cp.is_Integer and int(cp) == 1):
        written = f"cp = {int(cp)}" if cp.is_Integer else f"cp = {cp}, which the world size decides,"
        out.append(error("E0473", spec.span("mesh.cp") or span,
                         f"packing = documents with {written}: context parallelism's attention builds its own "
                         "causal mask over the whole sequence and would attend across documents",
                         label="context parallelism splits each window over cp ranks",
                         hint="set cp = 1, or packing = windows"))
    return out


def check_packing_model(spec: Spec, info: ModelInfo | None) -> Iterator[Diagnostic]:
    """E0472: packing = documents for a model that cannot be told the document boundaries."""
    if spec.train.packing != "documents" or _classification(spec):
        return
    family = by_name(spec.model.family)
    if spec.model.source.kind == "python":
        why = "a python factory's forward takes token ids only"
    elif not family.layout_from_trace and not family.positions_from_microbatch:
        why = f"ppdsl's {family.name} stages do not pass the microbatch's position ids to the blocks"
    elif info.packed_documents is None:
        why = "its forward was not probed with position ids"
    else:
        why = info.packed_documents or None
        implementation = spec.model.config.get("attn_implementation")
        if why is None and info.document_masks and implementation not in (None, *MASKED_IMPLEMENTATIONS):
            why = (f"its mask builders do not read the position ids, and ppdsl's document masks cannot be "
                   f"built for attn_implementation = \"{implementation}\" (only {', '.join(MASKED_IMPLEMENTATIONS)})")
    if why is None:
        return
    chat = any(data.options.get("messages") is not None for _, data in _sources(spec))
    yield error("E0472", spec.span("train.packing"),
                f"packing = documents cannot keep {info.class_name}'s attention inside each "
                f"{'conversation' if chat else 'document'}: {why}",
                label="documents need position ids that restart, and masks built from them",
                hint="use packing = none (one padded sample per conversation)" if chat else
                "use packing = windows (attention across documents) or none (one padded sample per document)")


def _classification(spec: Spec) -> bool:
    m = spec.model
    return is_classification(m.family, m.source.kind, m.source.target, m.resolved_config)
