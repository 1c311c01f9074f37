"""Check-time diagnostics of sources made of sources (E0454 to E0456): ``mix(...)`` and
``holdout(fraction)`` (dsl/resolve/data_mix.py types them; runtime/data/mix.py reads them).

- E0454: a mixture that is not one: fewer than two sources, weights that are not one positive
  number per source, or a part that is not a file source of samples (``synthetic``, the
  image, audio and image-text folders, a nested ``mix`` or ``holdout``).
- E0455: parts that give different kinds of samples (token windows, padded documents, examples,
  conversations, source/target pairs).
- E0456: ``holdout`` outside ``train.eval.data``, a fraction outside (0, 1), training data it
  cannot hold out of (``synthetic``), or, for token files (whose windows check counts from the
  file size) and the media folders (their index files, or an image folder's files), a fraction
  that holds out less than one global batch or keeps less than one for training. Elsewhere the
  run checks the counts when it first reads the data (exit status 2).

`leaves(spec)` gives the file sources the per-file checks of dsl/data_check.py run on: each part
of a mixture, under its own spans (``train.data[i]``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

from ppdsl.core.labels import is_classification
from .diagnostics import Diagnostic, error
from .exact import Expr
from .resolve.data_mix import parts_of
from .spec import WORLD, DataSpec, Spec

TOKEN_DTYPES_BYTES = {"uint16": 2, "uint32": 4}


def leaves(spec: Spec) -> Iterator[tuple[str, DataSpec, int]]:
    """(where, source, eval batches) of each file source train.data and train.eval.data read."""
    evaluation = spec.train.eval
    for where, data, batches in (("train.data", spec.train.data, 1),
                                 *((("train.eval.data", evaluation.data, evaluation.batches),) if evaluation else ())):
        if data.kind == "mix":
            for i, part in enumerate(parts_of(data)):
                if part.kind not in ("synthetic", "mix", "holdout"):
                    yield f"{where}[{i}]", part, batches
        elif data.kind not in ("synthetic", "holdout"):
            yield where, data, batches


MEDIA_FOLDERS = ("image_folder", "audio_folder", "image_text_folder")  # held out of, not mixed
NOT_MIXED = ("synthetic", *MEDIA_FOLDERS, "mix", "holdout")  # not a part of mix(...)
# the kinds of sample a mixture draws and holdout splits (runtime/data/mix.py's forms)
SAMPLE_FORMS = ("token windows", "padded documents", "examples", "conversations", "source/target pairs")


def form(spec: Spec, data: DataSpec) -> str:
    """The kind of sample a source gives the model."""
    if data.kind in NOT_MIXED:
        return data.kind
    if is_classification(spec.model.family, spec.model.source.kind, spec.model.source.target,
                         spec.model.resolved_config):
        return "examples"
    if data.kind == "hf_dataset":
        if data.options.get("messages") is not None:
            return "conversations"
        if data.options.get("target") is not None:
            return "source/target pairs"
        if data.options.get("packing") is False:
            return "padded documents"
    return "examples" if data.kind in ("jsonl", "csv") else "token windows"


def check_mix(spec: Spec, world: int | None) -> list[Diagnostic]:
    out: list[Diagnostic] = []
    evaluation = spec.train.eval
    for where, data in (("train.data", spec.train.data), ("train.eval.data", getattr(evaluation, "data", None))):
        if data is not None and data.kind == "mix":
            out += _mixture(spec, data, where)
    if spec.train.data.kind == "holdout":
        out.append(error("E0456", spec.span("train.data.call"), "holdout(...) is evaluation data: it holds out part "
                         "of train.data", hint="write it in the eval block: eval { data = holdout(0.05) }"))
    elif evaluation is not None and evaluation.data.kind == "holdout":
        out += _holdout(spec, world, float(evaluation.data.options["fraction"]))
    return out


def _mixture(spec: Spec, data: DataSpec, where: str) -> list[Diagnostic]:
    parts = parts_of(data)
    call = spec.span(f"{where}.call")
    out: list[Diagnostic] = []
    if len(parts) < 2:
        out.append(error("E0454", call, f"mix(...) of {len(parts)} source{'s' if len(parts) != 1 else ''}: a mixture "
                         "draws from two sources or more", label="one source" if parts else "no source",
                         hint="write the source itself, or add another: mix(a, b, weights = [0.7, 0.3])"))
    weights = data.options.get("weights")
    if weights is not None:
        if len(weights) != len(parts):
            out.append(error("E0454", spec.span(f"{where}.weights"), f"mix(...) has {len(parts)} sources but "
                             f"{len(weights)} weights", label=f"{len(weights)} weights",
                             hint="give one weight per source, in the sources' order"))
        for i, w in enumerate(weights):
            if not w > 0:
                out.append(error("E0454", spec.span(f"{where}.weights[{i}]"), f"weight {w:g} is not positive: each "
                                 "source is drawn with probability weight / sum of the weights", label="not positive",
                                 hint="leave a source out rather than weighting it 0"))
    forms = [form(spec, p) for p in parts]
    for i, f in enumerate(forms):
        span = spec.span(f"{where}[{i}].call")
        if f in NOT_MIXED:
            out.append(error("E0454", span, f"{f}(...) cannot be a source of mix(...): a part is a file source of "
                             "token windows, documents, examples, conversations or pairs", label="not a file source",
                             hint="mix tokens(...), text(...), jsonl(...), csv(...) and hf_dataset(...) sources"))
    kinds = [f for f in forms if f in SAMPLE_FORMS]
    if len(set(kinds)) > 1:
        i = next(i for i, f in enumerate(forms) if f in kinds and f != kinds[0])
        out.append(error("E0455", spec.span(f"{where}[{i}].call"), f"this source gives {forms[i]}, the first gives "
                         f"{kinds[0]}: a mixture's samples must be of one kind (shape, mask and labels)",
                         label=forms[i], hint="mix sources of one kind: documents with documents (all packing = "
                         "true, or all false), conversations with conversations, pairs with pairs"))
    return out


def _holdout(spec: Spec, world: int | None, fraction: float) -> list[Diagnostic]:
    span = spec.span("train.eval.data.fraction")
    if not 0 < fraction < 1:
        return [error("E0456", span, f"holdout({fraction:g}): the fraction of train.data held out must lie between "
                      "0 and 1", label="outside (0, 1)", hint="e.g. holdout(0.05): 5% of the items for evaluation")]
    data = spec.train.data
    parts = parts_of(data) if data.kind == "mix" else [data]
    for i, part in enumerate(parts):
        f = form(spec, part)
        if f not in SAMPLE_FORMS and f not in MEDIA_FOLDERS:  # media folders: held out, not mixed
            at = spec.span(f"train.data[{i}].call" if data.kind == "mix" else "train.data.call") or span
            return [error("E0456", at, f"holdout(...) cannot hold out part of {f if f != 'synthetic' else 'synthetic data'}"
                          ": it holds out token windows, documents, examples, conversations, pairs, labelled "
                          "images, audio clips or captioned images", label=f"{f}",
                          hint="synthetic data: evaluate on synthetic(seed = ...), another stream; "
                               "otherwise name held-out files: eval { data = ... }")]
    gb = _global_batch(spec, world)
    seq_len = spec.train.seq_len
    if gb is None or not isinstance(seq_len, int) or seq_len <= 0:
        return []
    counted = [_items(p, seq_len) for p in parts]
    if any(c is None for c in counted):
        return []  # counted when the run first reads the data
    counts = [c for c, _ in counted]  # type: ignore[misc]
    noun = counted[0][1]  # type: ignore[index]  # (media folders are not mixed: one noun)
    what = f"{noun} (seq_len = {seq_len})" if noun == "windows" else noun
    held = sum(int(fraction * c) for c in counts)
    kept = sum(counts) - held
    if held < gb:
        return [error("E0456", span, f"holdout({fraction:g}) holds out {held} of {sum(counts)} {what}, "
                      f"fewer than one global batch ({gb}): no eval batch",
                      label="too small", hint=f"hold out at least {gb / sum(counts):.3g} of the data")]
    if kept < gb:
        return [error("E0456", span, f"holdout({fraction:g}) keeps {kept} {noun} for training, fewer than one "
                      f"global batch ({gb})", label="too large", hint="hold out a smaller fraction")]
    if any(int(fraction * c) == 0 for c in counts):
        i = next(i for i, c in enumerate(counts) if int(fraction * c) == 0)
        return [error("E0456", span, f"holdout({fraction:g}) holds out none of the {counts[i]} {noun} of source "
                      f"{i + 1}", label="too small", hint="hold out a larger fraction")]
    return []


def _items(data: DataSpec, seq_len: int) -> tuple[int, str] | None:
    """(how many items, what they are) of a source whose items check counts without reading
    its data: a token file's windows (its size) and a media folder's samples (its index file or
    its image files); None for other sources, or a folder its own checks refuse."""
    path = data.options.get("path")
    if data.kind == "tokens":
        windows = _windows(data, seq_len)
        return None if windows is None else (windows, "windows")
    if data.kind not in MEDIA_FOLDERS or not isinstance(path, str) or not os.path.isdir(path):
        return None
    from ppdsl.core.media_pairs import MediaError

    try:
        if data.kind == "audio_folder":
            from ppdsl.core.audio_folder import read_transcripts

            return len(read_transcripts(path)), "clips"
        from ppdsl.core import image_folder

        if data.kind == "image_text_folder":
            return len(image_folder.read_captions(path)), "captioned images"
        split = data.options.get("split")
        root = image_folder.class_root(path, split if isinstance(split, str) else None)
        return sum(len(image_folder.image_files(os.path.join(root, c)))
                   for c in image_folder.class_names(root)), "images"
    except (MediaError, ValueError, OSError):  # (image_folder.FolderError is a ValueError)
        return None  # the folder's own checks say what is wrong


def _global_batch(spec: Spec, world: int | None) -> int | None:
    gb = spec.train.global_batch
    if world is not None and isinstance(gb, Expr):
        gb = gb.subs(WORLD, world)
    return int(gb) if isinstance(gb, Expr) and gb.is_Integer and int(gb) > 0 else None


def _windows(data: DataSpec, seq_len: int) -> int | None:
    """Windows of a token file, from its size (a .npy's from its header); None for other sources."""
    path = data.options.get("path")
    if data.kind != "tokens" or not isinstance(path, str) or not os.path.isfile(path):
        return None
    try:
        with open(path, "rb") as f:
            magic = f.read(6)
        if magic == b"\x93NUMPY":
            import numpy as np

            arr = np.load(path, mmap_mode="r", allow_pickle=False)
            return int(arr.shape[0]) // seq_len if arr.ndim == 1 else None
        size = TOKEN_DTYPES_BYTES.get(data.options.get("dtype") or "uint16")
        return os.path.getsize(path) // size // seq_len if size else None
    except (OSError, ValueError):
        return None  # the file's own checks say what is wrong
