"""What the model takes as input, decided by check's trace of the built model (`OwnLayout.inputs`,
`ppdsl.core.model_inputs`), and what the spec may say about it.

- A model fed token ids needs ``train.seq_len`` (E0102; resolve already asks it of every family
  but the own forward, whose input only the built model tells).
- An encoder-decoder model (T5, BART) reads ``seq_len`` source ids and as many target ids; what
  it does not run yet (context parallelism, a file source other than ``hf_dataset`` pairs) is
  E0438. Its pairs are ``hf_dataset(..., target = "...")``: without ``target`` (or with
  ``messages``) E0442, and so is ``target`` on a model that is not an encoder-decoder.
- A model fed images (ViT) has no token length: its blocks see the positions check's trace
  measured (patches + CLS), which become the spec's activation length (``train.seq_len`` of the
  checked spec, `TrainPlan.seq_len` of the plan). Writing ``seq_len`` is E0435; what only token
  inputs run (context parallelism, a data source other than ``synthetic`` and ``image_folder``) is
  E0436, and so is ``image_folder`` data for a model fed token ids (a family's, or a traced one).
- A speech model (Whisper): dsl/input_check_speech.py (``seq_len`` is its target's length).
- An image-text model (LLaVA): dsl/data_check_image_text.py (``seq_len`` holds its image tokens).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs

from ppdsl.core.image_folder import CHANNEL_MODES
from .diagnostics import Diagnostic, error
from .families import by_name
from .data_check_image_text import image_text_data_elsewhere
from .input_check_speech import audio_data_elsewhere, check_speech
from .resolve.structure import missing_key
from .resolve.train import SEQ_LEN_DOC
from .span import Span
from .spec import Spec

if TYPE_CHECKING:
    from ppdsl.dsl.introspect import ModelInfo

__all__ = ["check_inputs", "input_of"]


def input_of(spec: Spec, info: ModelInfo | None) -> tuple[str, tuple[int, ...], int] | None:
    """(kind, one sample's shape, positions) of the own forward's traced model; None where no
    trace says (a family's model, or a refused one)."""
    layout = getattr(info, "own_layout", None)
    if not _traced(spec) or layout is None or not layout.ok:
        return None
    return layout.inputs, tuple(layout.input_shape), int(layout.positions)


def _traced(spec: Spec) -> bool:
    """The model runs its own forward, whose input check's trace tells (core/families/own/)."""
    return by_name(spec.model.family).layout_from_trace


def _fed_token_ids(spec: Spec) -> bool:
    """A family's HF model, fed token ids: not one whose input is traced, nor a python factory's."""
    family = by_name(spec.model.family)
    return not (family.layout_from_trace or family.python_factories)


def check_inputs(spec: Spec, info: ModelInfo | None) -> tuple[Spec, list[Diagnostic]]:
    """``spec`` with an image model's activation length as ``train.seq_len``, and what is wrong."""
    found = input_of(spec, info)
    if found is None or found[0] != "seq2seq":
        targets = _stray_targets(spec, info, found)
        if targets:
            return spec, targets
    if found is not None and found[0] == "speech":  # dsl/input_check_speech.py
        return check_speech(spec, info, found[1], found[2])
    if found is not None and found[0] == "image_text":  # dsl/data_check_image_text.py
        from .data_check_image_text import check_image_text

        return spec, audio_data_elsewhere(spec, info) + check_image_text(spec, info, found[1])
    if found is None or found[0] in ("tokens", "seq2seq"):
        out = _image_data(spec, info) if found is not None or _fed_token_ids(spec) else []
        if found is not None or _fed_token_ids(spec):
            out += audio_data_elsewhere(spec, info)
        out += image_text_data_elsewhere(spec, info)  # only a traced image-text model takes it
        if found is not None and found[0] == "seq2seq":
            out += _seq2seq_problems(spec, info)
        if found is not None and spec.train.seq_len is None:
            out.append(missing_key(_train_keyword(spec), "train", "seq_len", SEQ_LEN_DOC))
        return spec, out
    kind, shape, positions = found
    what = f"{info.class_name} takes images ({' x '.join(map(str, shape))}, `pixel_values`)"
    out: list[Diagnostic] = audio_data_elsewhere(spec, info) + image_text_data_elsewhere(spec, info)
    if "train.seq_len" in spec.spans:
        out.append(error("E0435", spec.span("train.seq_len"),
                         f"{what}, not tokens: its blocks see {positions} positions (traced), there is no seq_len",
                         hint="remove seq_len: the image size and patch size of the config decide the positions"))
    cp = spec.mesh.cp
    if "mesh.cp" in spec.spans and not (getattr(cp, "is_Integer", False) and int(cp) == 1):
        out.append(error("E0436", spec.span("mesh.cp"),
                         f"{what}: context parallelism splits token sequences, not images",
                         hint="set cp = 1 (or leave it out)"))
    for key, data in (("train.data", spec.train.data), ("train.eval.data", getattr(spec.train.eval, "data", None))):
        # holdout(...) reads train.data's images (dsl/data_check_mix.py: E0456 for what it cannot hold out of)
        if data is not None and data.kind not in ("synthetic", "image_folder", "audio_folder", "image_text_folder",
                                                  "holdout"):
            out.append(error("E0436", spec.span(key), f"{what}: data = {data.kind}(...) gives token ids",
                             hint='use data = image_folder("dir") (one sub-folder of images per class) or '
                                  "synthetic(seed = ...) (a fixed pattern per class, with noise)"))
        elif data is not None and data.kind == "image_folder" and shape[0] not in CHANNEL_MODES:
            out.append(error("E0436", spec.span(f"{key}.call") or spec.span(key),
                             f"{what}: image files give 1 (grey) or 3 (RGB) channels, not {shape[0]}",
                             hint="set num_channels = 3 (or 1) in the config, or use data = synthetic(seed = ...)"))
    return attrs.evolve(spec, train=attrs.evolve(spec.train, seq_len=positions)), out


def _image_data(spec: Spec, info: ModelInfo | None) -> list[Diagnostic]:
    """E0436 for image_folder data on a model fed token ids."""
    name = getattr(info, "class_name", None) or spec.model.source.target
    return [error("E0436", spec.span(f"{key}.call") or spec.span(key),
                  f"data = image_folder(...) gives images, but {name} takes token ids (`input_ids`)",
                  hint="image_folder is for a model fed images (`pixel_values`, such as ViTForImageClassification); "
                       "for this model use tokens(...), text(...), jsonl(...), csv(...) or hf_dataset(...)")
            for key, data in (("train.data", spec.train.data), ("train.eval.data", getattr(spec.train.eval, "data", None)))
            if data is not None and data.kind == "image_folder"]


def _seq2seq_problems(spec: Spec, info: ModelInfo | None) -> list[Diagnostic]:
    """E0438: what an encoder-decoder model (fed source ids, trained on target ids) does not run yet."""
    what = f"{info.class_name} is an encoder-decoder model"
    out: list[Diagnostic] = []
    cp = spec.mesh.cp
    if "mesh.cp" in spec.spans and not (getattr(cp, "is_Integer", False) and int(cp) == 1):
        out.append(error("E0438", spec.span("mesh.cp"), f"{what}: context parallelism of its two sequences is not built",
                         hint="set cp = 1 (or leave it out)"))
    for key, data in _sources(spec):
        if data.kind == "hf_dataset":
            if data.options.get("target") is None:
                out.append(error("E0442", spec.span(f"{key}.call") or spec.span(key),
                                 f"{what}, trained on source and target pairs: hf_dataset(...) needs the field of "
                                 "the targets", label="no target field",
                                 hint='name it: hf_dataset(path, tokenizer = "...", text = "source", target = "target")'))
            elif data.options.get("messages") is not None:
                out.append(error("E0442", spec.span(f"{key}.messages") or spec.span(key),
                                 f"{what}: messages (conversations) and target (pairs) are two kinds of data",
                                 hint="leave messages out: each row holds a source (text) and a target field"))
        elif data.kind not in ("synthetic", "image_folder", "audio_folder", "image_text_folder"):  # E0436, E0465, E0480
            out.append(error("E0438", spec.span(f"{key}.call") or spec.span(key),
                             f"{what}, trained on source and target pairs: data = {data.kind}(...) gives one sequence "
                             "per sample",
                             hint='use hf_dataset(path, tokenizer = "...", text = "source", target = "target") '
                                  "(JSON lines, CSV, Parquet, Arrow, save_to_disk) or synthetic(seed = ...)"))
    return out


def _stray_targets(spec: Spec, info: ModelInfo | None, found: tuple[str, tuple[int, ...], int] | None) -> list[Diagnostic]:
    """E0442: hf_dataset(..., target = ...) on a model that is not an encoder-decoder model (a
    family's model, or a traced one fed tokens or images); nothing where the trace failed."""
    if found is None and _traced(spec):
        return []
    name = getattr(info, "class_name", None) or spec.model.source.target
    return [error("E0442", spec.span(f"{key}.target") or spec.span(key),
                  f"target = ... gives source/target pairs for an encoder-decoder model, but {name} is not one "
                  "(its forward takes no decoder_input_ids)", label="pairs for an encoder-decoder model",
                  hint="leave target out; pairs train T5, BART and the other ...ForConditionalGeneration text models")
            for key, data in _sources(spec) if data.kind == "hf_dataset" and data.options.get("target") is not None]


def _sources(spec: Spec) -> list[tuple[str, Any]]:
    """Each source the model reads samples from, and its key: a mixture's parts
    (``train.data[i]``); ``holdout`` left out (it reads train.data's)."""
    from .resolve.data_mix import parts_of

    out = []
    for key, data in _data(spec):
        if data.kind == "mix":
            out += [(f"{key}[{i}]", part) for i, part in enumerate(parts_of(data))]
        elif data.kind != "holdout":
            out.append((key, data))
    return out


def _data(spec: Spec) -> list[tuple[str, Any]]:
    """The spec's data sources and their keys: train.data, and train.eval.data where written."""
    found = (("train.data", spec.train.data), ("train.eval.data", getattr(spec.train.eval, "data", None)))
    return [(key, data) for key, data in found if data is not None]


def _train_keyword(spec: Spec) -> Span | None:
    """Where resolve's E0102 points: the word `train` of the train block."""
    at = spec.span("train")
    return None if at is None else Span(at.file, at.line, at.column, at.line, at.column + len("train"))
