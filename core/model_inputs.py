"""What a model takes as input: the one rule check's meta passes, the stages and the data share.

A model's input kind is decided by its forward's parameters, never by its class name:

- ``tokens``: the forward takes ``input_ids`` (decoder-only and encoder-only language models);
  each sample is ``seq_len`` token ids;
- ``seq2seq``: it takes ``input_ids`` and ``decoder_input_ids`` (encoder-decoder language models:
  T5, BART, Marian, ...); each sample is ``seq_len`` source ids and as many target ids (the
  labels). The decoder's input is the labels shifted right by the model's own
  ``prepare_decoder_input_ids_from_labels`` (`decoder_inputs`: ``decoder_start_token_id``, -100
  made padding);
- ``pixels``: it takes ``pixel_values`` and no ``input_ids`` (vision models such as ViT); each
  sample is an image of ``(num_channels, height, width)`` from the config (``image_size`` an int
  or a pair, ``num_channels`` 3 when the config does not say). The positions the blocks see
  (ViT: patches + CLS) are what check's trace measures (dsl/own_layout.py), not a spec value;
- ``speech``: it takes ``input_features`` and ``decoder_input_ids`` and no ``input_ids`` (speech
  seq2seq models such as Whisper); each sample is the audio's features, `feature_shape` from the
  config, and target ids (the labels; their length is the spec's ``seq_len``, `TARGET_LEN` by
  default: dsl/input_check.py), the decoder's input made from them as for ``seq2seq``. The
  positions the encoder's blocks see are what check's trace measures, as for pixels;
- ``image_text``: it takes ``input_ids`` and ``pixel_values`` (image-text models such as LLaVA);
  each sample is ``seq_len`` token ids, the first `image_tokens` of them the config's
  ``image_token_id`` (where the model merges the image's features), and an image of
  `pixel_shape` (the vision sub-config's size and channels). The vision tower runs in the first
  stage; the blocks are the language model's;
- anything else (``input_values`` of wav2vec-style models, ...) is not known yet: ``None``.

`meta_inputs` gives the keyword arguments of one forward on any device (check's meta passes run
them; the stages pass a microbatch's real tensors through `ppdsl.core.own_cut.model_inputs`).
torch is imported inside the functions: importing this module is torch-free.
"""

from __future__ import annotations

import inspect
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["DECODER_KINDS", "IMAGE_TEXT", "INPUT_NAMES", "KINDS", "PIXELS", "SEQ2SEQ", "SPEECH", "TARGET_LEN", "TEXT_KINDS", "TRACED_KIND", "TOKENS",
           "decoder_inputs", "feature_shape", "first_input", "image_text_shape", "forward_parameters", "input_kind", "kind_of", "meta_inputs",
           "pixel_shape", "sample_shape", "target_len"]

TOKENS = "tokens"
SEQ2SEQ = "seq2seq"
PIXELS = "pixels"
SPEECH = "speech"
IMAGE_TEXT = "image_text"
KINDS = (TOKENS, SEQ2SEQ, PIXELS, SPEECH, IMAGE_TEXT)
TEXT_KINDS = (TOKENS, SEQ2SEQ, IMAGE_TEXT)  # token ids in, ``seq_len`` of them per sample
DECODER_KINDS = (SEQ2SEQ, SPEECH)  # a decoder fed the labels shifted right (`decoder_inputs`)
INPUT_NAMES = {TOKENS: "input_ids", SEQ2SEQ: "input_ids", PIXELS: "pixel_values",
               SPEECH: "input_features", IMAGE_TEXT: "input_ids"}  # the forward's argument of each kind
# a speech model's target ids per sample where the spec writes no seq_len (at most the config's
# max_target_positions): room for a short transcript, and a decoder cheap to run
TARGET_LEN = 32


# set on a meta model by check (dsl/introspect.py) where its trace runs it as another kind than
# its forward's (an image-text model whose image path does not trace: its tokens alone), so that
# every later meta pass of the same model (probes, dataflow, proofs) feeds what the run feeds
TRACED_KIND = "_ppdsl_traced_kind"


def input_kind(parameters: Collection[str]) -> str | None:
    """The input kind of a forward with these parameter names, or None (not one ppdsl feeds)."""
    if "input_ids" in parameters:
        if "pixel_values" in parameters:  # Blip2's decoder_input_ids serve its encoder-decoder text models only
            return IMAGE_TEXT
        return SEQ2SEQ if "decoder_input_ids" in parameters else TOKENS
    if "pixel_values" in parameters:
        return PIXELS
    if "input_features" in parameters and "decoder_input_ids" in parameters:
        return SPEECH
    return None


def forward_parameters(model: Any) -> tuple[str, ...]:
    """The names of ``model.forward``'s parameters (a python factory's module: its forward's)."""
    try:
        return tuple(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return ()


def kind_of(model: Any) -> str | None:
    """The input kind of a built model (`input_kind` of its forward)."""
    return input_kind(forward_parameters(model))


def _pair(v: Any, what: str) -> tuple[int, int]:
    if isinstance(v, int) and not isinstance(v, bool) and v > 0:
        return v, v
    if isinstance(v, (list, tuple)) and len(v) == 2 and all(isinstance(x, int) and not isinstance(x, bool) and x > 0
                                                             for x in v):
        return int(v[0]), int(v[1])
    raise ValueError(f"the config's {what} is {v!r}, not a positive int or a pair of them")


def pixel_shape(config: Mapping[str, Any]) -> tuple[int, int, int]:
    """(channels, height, width) of one image: ``num_channels`` (3 by default) and ``image_size``
    (an int or a pair) of the config, or of its ``vision_config`` (an image classifier over a
    composite's vision tower: CLIP's, SigLIP's). ValueError when neither has an image size."""
    vision = config.get("vision_config")
    if "image_size" not in config and isinstance(vision, Mapping):
        config = vision
    if "image_size" not in config:
        raise ValueError("the config has no image_size: ppdsl cannot tell the size of the images the model takes "
                         "(write it in the model's config: config { image_size = 224 })")
    channels = config.get("num_channels", 3)
    if not isinstance(channels, int) or isinstance(channels, bool) or channels < 1:
        raise ValueError(f"the config's num_channels is {channels!r}, not a positive int")
    return (channels, *_pair(config["image_size"], "image_size"))


def _positive(config: Mapping[str, Any], key: str) -> int:
    v = config.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"the config's {key} is {v!r}, not a positive int")
    return v


def feature_shape(config: Mapping[str, Any]) -> tuple[int, int]:
    """One sample's audio features, in the layout the encoder takes, from the config:

    - ``num_mel_bins`` (Whisper): ``(num_mel_bins, frames)``, frames = 2 * ``max_source_positions``
      (its two convolutions halve them to the encoder's positions, and its encoder takes exactly
      that many: a feature extractor pads every clip to it);
    - ``input_feat_per_channel`` (Speech2Text): ``(frames, input_feat_per_channel * input_channels)``,
      frames = ``max_source_positions`` (its subsampler shortens them; its positions hold that many).

    ValueError where the config has neither."""
    if "num_mel_bins" in config:
        return _positive(config, "num_mel_bins"), 2 * _positive(config, "max_source_positions")
    if "input_feat_per_channel" in config:
        channels = config.get("input_channels", 1)
        return _positive(config, "max_source_positions"), _positive(config, "input_feat_per_channel") * int(channels)
    raise ValueError("the config has neither num_mel_bins nor input_feat_per_channel: ppdsl cannot tell the size of "
                     "the audio features the model takes")


def target_len(config: Mapping[str, Any], written: int | None) -> int:
    """A speech model's target ids per sample: the spec's ``seq_len``, else `TARGET_LEN` capped at
    the config's ``max_target_positions``."""
    if written is not None:
        return written
    limit = config.get("max_target_positions")
    return min(TARGET_LEN, limit) if isinstance(limit, int) and limit > 0 else TARGET_LEN


def image_text_shape(input_shape: tuple[int, ...]) -> tuple[tuple[int, int, int], int, int]:
    """An image-text model's traced input shape (`OwnForward.input_shape`: check's trace measures
    it with the model's own ``get_image_features``) as ((C, H, W) of its image, image tokens per
    sample, their id)."""
    c, h, w, tokens, token = input_shape
    return (c, h, w), tokens, token


def sample_shape(kind: str, config: Mapping[str, Any], seq_len: int) -> tuple[int, ...]:
    """One sample's input shape: ``(seq_len,)`` token ids, ``(C, H, W)`` pixels or the audio's features."""
    if kind in TEXT_KINDS:
        return (seq_len,)
    return feature_shape(config) if kind == SPEECH else pixel_shape(config)


def _config_of(model: Any, config: Mapping[str, Any] | None) -> Mapping[str, Any]:
    hf = getattr(model, "config", None)
    if hf is not None and hasattr(hf, "to_dict"):
        return {**hf.to_dict(), **(config or {})}
    return dict(config or {})


def meta_inputs(model: nn.Module, batch: int, seq_len: int, config: Mapping[str, Any] | None = None,
                device: Any = "meta", dtype: torch.dtype | None = None, kind: str | None = None) -> dict[str, Any]:
    """The keyword arguments of one forward of ``model`` at this batch: zero token ids of
    ``(batch, seq_len)`` (a seq2seq model: as many decoder ids too), zero pixels of
    ``(batch, C, H, W)``, or zero audio features and ``seq_len`` decoder ids (``dtype``: float32
    unless given). ValueError for a forward of no known kind, or inputs of no known size."""
    import torch

    params = forward_parameters(model)
    # `kind`: one the forward also takes (an image-text model on its tokens alone), else the one
    # check's trace settled on for this meta model (`TRACED_KIND`), else its forward's
    kind = kind or getattr(model, "__dict__", {}).get(TRACED_KIND) or input_kind(params)
    if kind is None:
        raise ValueError(f"{type(model).__name__}'s forward takes neither input_ids, pixel_values nor input_features "
                         "with decoder_input_ids")
    shape = (batch, *sample_shape(kind, _config_of(model, config), seq_len))
    out: dict[str, Any] = {INPUT_NAMES[kind]: torch.zeros(shape, dtype=torch.long, device=device) if kind in TEXT_KINDS
                           else torch.zeros(shape, dtype=dtype or torch.float32, device=device)}
    if kind == IMAGE_TEXT:
        out["pixel_values"] = torch.zeros((batch, *pixel_shape(_config_of(model, config))), dtype=dtype or torch.float32,
                                          device=device)
    if kind in DECODER_KINDS:
        out["decoder_input_ids"] = torch.zeros((batch, seq_len), dtype=torch.long, device=device)
    return out


def decoder_inputs(model: Any, labels: torch.Tensor) -> torch.Tensor:
    """A seq2seq model's decoder input for these labels, by the model's own rule
    (``prepare_decoder_input_ids_from_labels``, else its module's ``shift_tokens_right``, which
    its forward applies to ``labels=``: shifted right, ``decoder_start_token_id`` first, -100 made
    padding). ValueError when the model has no such rule or its config lacks what it
    needs (T5 without ``decoder_start_token_id``)."""
    import sys

    name = type(model).__name__
    prepare = getattr(model, "prepare_decoder_input_ids_from_labels", None)
    shift = getattr(sys.modules.get(type(model).__module__), "shift_tokens_right", None)
    shift_right = getattr(model, "_shift_right", None)  # T5's PreTrainedModel rule (Udop's forward applies it)
    rule = ("prepare_decoder_input_ids_from_labels" if prepare is not None else
            "shift_tokens_right" if shift is not None else "_shift_right")
    try:
        if prepare is not None:
            return prepare(labels=labels)
        if shift is not None:  # the rule its forward applies to labels= (Blenderbot, M2M100, ...)
            config = model.config
            text = getattr(config, "text_config", None)
            # the ids in a text_config where the top config has none (Florence2's forward reads them
            # there); not get_text_config(decoder=True), which builds Whisper a fresh default config
            if text is not None and not all(hasattr(config, k) for k in ("pad_token_id", "decoder_start_token_id")):
                config = text
            return shift(labels, config.pad_token_id, config.decoder_start_token_id)
        if shift_right is not None:
            return shift_right(labels)
    except (ValueError, TypeError, AttributeError, IndexError, RuntimeError) as exc:
        raise ValueError(f"the labels shifted right ({rule}) fail: {exc}") from None
    raise ValueError(f"{name} has neither prepare_decoder_input_ids_from_labels, its module's shift_tokens_right nor "
                     "_shift_right: ppdsl cannot tell its decoder's input from the labels")


def first_input(inputs: Mapping[str, Any]) -> Any:
    """The token ids, pixels or audio features among `meta_inputs`' arguments."""
    return next(inputs[n] for n in INPUT_NAMES.values() if n in inputs)
