"""What check proves of an image-text model's inputs (`OwnLayout.inputs = "image_text"`: a forward
taking ``input_ids`` and ``pixel_values``, LLaVA's; `ppdsl.core.model_inputs`).

Each sample is ``seq_len`` token ids, the first of them the config's ``image_token_id`` as many
times as the model's own ``get_image_features`` yields features per image (check's trace counts
them on meta: `OwnLayout.input_shape`), and an image of the vision sub-config's size.

- E0475: ``seq_len`` holds no text token after the image's placeholders (or none is written:
  E0102, as for any model fed tokens);
- E0476: what an image-text model does not run yet: context parallelism, a data source other
  than ``synthetic`` and ``image_text_folder``;
- E0477: an ``image_token_id`` outside the language model's vocabulary (the forward embeds the
  placeholders with the text's embedding table before it puts the image's features there).
- E0480: ``image_text_folder`` data for a model that does not take images with token ids.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ppdsl.core.model_inputs import image_text_shape
from .diagnostics import Diagnostic, error
from .resolve.structure import missing_key
from .resolve.train import SEQ_LEN_DOC
from .span import Span
from .spec import Spec

if TYPE_CHECKING:
    from ppdsl.dsl.introspect import ModelInfo

__all__ = ["IMAGE_TEXT_DATA", "check_image_text", "image_text_data_elsewhere"]

IMAGE_TEXT_DATA = ("synthetic", "image_text_folder")


def check_image_text(spec: Spec, info: ModelInfo | None, shape: tuple[int, ...]) -> list[Diagnostic]:
    """The problems of an image-text model's spec, given its traced input shape."""
    pixels, tokens, token_id = image_text_shape(shape)
    name = info.class_name
    out: list[Diagnostic] = []
    seq = spec.train.seq_len
    if seq is None:
        at = spec.span("train")
        out.append(missing_key(None if at is None else Span(at.file, at.line, at.column, at.line, at.column + 5),
                               "train", "seq_len", SEQ_LEN_DOC))
    elif isinstance(seq, int) and seq <= tokens:
        out.append(error("E0475", spec.span("train.seq_len"),
                         f"{name} puts its image's {tokens} features at {tokens} image tokens (id {token_id}) at the "
                         f"start of each sample: seq_len = {seq} leaves no text token after them",
                         label=f"at least {tokens + 1}",
                         hint=f"set seq_len to more than {tokens} (the vision config's image and patch size decide "
                              "the image tokens)"))
    rows = _text_vocab(info.config)
    if rows is not None and not 0 <= token_id < rows:
        out.append(error("E0477", spec.span("model.config.image_token_id") or spec.span("model.source"),
                         f"{name}'s image_token_id = {token_id} is not a row of its language model's {rows}-token "
                         "vocabulary: its forward embeds the image tokens before it puts the image's features there",
                         hint=f"set image_token_id below {rows} (or make text_config's vocab_size larger)"))
    what = f"{name} takes images and token ids"
    cp = spec.mesh.cp
    if "mesh.cp" in spec.spans and not (getattr(cp, "is_Integer", False) and int(cp) == 1):
        out.append(error("E0476", spec.span("mesh.cp"),
                         f"{what}: context parallelism would split its image's tokens from the sequence it runs the "
                         "vision tower for (not built)", hint="set cp = 1 (or leave it out)"))
    for key, data in (("train.data", spec.train.data), ("train.eval.data", getattr(spec.train.eval, "data", None))):
        if data is not None and data.kind not in IMAGE_TEXT_DATA and data.kind != "holdout":  # train.data's (E0456)
            out.append(error("E0476", spec.span(f"{key}.call") or spec.span(key),
                             f"{what}: data = {data.kind}(...) gives no image-text pairs",
                             hint='use data = image_text_folder("dir", tokenizer = "...") (images and a captions.jsonl) '
                                  "or synthetic(seed = ...): an image of one of a few classes, then the class's "
                                  "token sequence"))
    return out


def image_text_data_elsewhere(spec: Spec, info: ModelInfo | None) -> list[Diagnostic]:
    """E0480 for ``image_text_folder`` data on a model not fed images with token ids."""
    name = getattr(info, "class_name", None) or spec.model.source.target
    return [error("E0480", spec.span(f"{key}.call") or spec.span(key),
                  f"data = image_text_folder(...) gives images with their captions' token ids, but {name} does not "
                  "take both (`pixel_values` with `input_ids`)",
                  hint="image_text_folder is for an image-text model such as LlavaForConditionalGeneration; "
                       "image_folder(...) gives labelled images, hf_dataset(...) text")
            for key, data in (("train.data", spec.train.data), ("train.eval.data", getattr(spec.train.eval, "data", None)))
            if data is not None and data.kind == "image_text_folder"]


def _text_vocab(config: Mapping[str, Any]) -> int | None:
    """The language model's vocabulary: the text sub-config's ``vocab_size``, else the config's."""
    for where in (config.get("text_config"), config):
        if isinstance(where, Mapping) and isinstance(where.get("vocab_size"), int):
            return int(where["vocab_size"])
    return None
