"""What a speech model (`ppdsl.core.model_inputs` kind ``speech``: Whisper, Speech2Text) takes, and
what the spec may say about it (called by dsl/input_check.py).

- Its source is the audio's features, of the shape the config gives (`feature_shape`); the
  encoder's blocks see the positions check's trace measured, which become the spec's activation
  length (``train.seq_len`` of the checked spec, `TrainPlan.seq_len` of the plan), as for images.
- Its target is token ids: the spec's ``seq_len`` is the target's length (the labels, and the
  decoder's input shifted right from them), `model_inputs.TARGET_LEN` (32, at most
  ``max_target_positions``) when not written. It reaches the data through the data options
  (``target_len``, which only check writes), so the plan carries it without a field of its own.
  A length beyond the config's ``max_target_positions`` is E0466 (the decoder's positions end there).
- What it does not run (context parallelism), and data that gives token ids, are E0465: a speech
  model reads ``synthetic`` or ``audio_folder`` data; ``audio_folder`` on a model not fed speech
  is E0465 too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs

from .diagnostics import Diagnostic, error
from .spec import DataSpec, Spec

if TYPE_CHECKING:
    from ppdsl.dsl.introspect import ModelInfo

__all__ = ["SPEECH_DATA", "audio_data_elsewhere", "check_speech"]

SPEECH_DATA = ("synthetic", "audio_folder")
TARGET_OPTION = "target_len"  # the data option check writes: the target ids per sample


def check_speech(spec: Spec, info: ModelInfo | None, shape: tuple[int, ...], positions: int) -> tuple[Spec, list[Diagnostic]]:
    """``spec`` with the encoder's positions as ``train.seq_len`` and the target length in its data
    options, and what is wrong."""
    from ppdsl.core.model_inputs import target_len

    config = dict(spec.model.resolved_config or spec.model.config)
    what = f"{info.class_name} takes speech ({' x '.join(map(str, shape))} audio features, `input_features`)"
    out: list[Diagnostic] = []
    written = spec.train.seq_len if "train.seq_len" in spec.spans else None
    limit = config.get("max_target_positions")
    if written is not None and isinstance(limit, int) and written > limit:
        out.append(error("E0466", spec.span("train.seq_len"),
                         f"{what}: seq_len = {written} target tokens, more than the decoder's max_target_positions = {limit}",
                         label="the target's length", hint=f"set seq_len to at most {limit}, or raise max_target_positions"))
    cp = spec.mesh.cp
    if "mesh.cp" in spec.spans and not (getattr(cp, "is_Integer", False) and int(cp) == 1):
        out.append(error("E0465", spec.span("mesh.cp"), f"{what}: context parallelism of its encoder and decoder is not built",
                         hint="set cp = 1 (or leave it out)"))
    for key, data in _data(spec):
        if data.kind not in SPEECH_DATA and data.kind != "holdout":  # holdout: train.data's clips (E0456)
            why = "is not built for it" if data.kind == "mix" else "gives token ids, not audio"
            out.append(error("E0465", spec.span(key), f"{what}: data = {data.kind}(...) {why}",
                             hint='use data = audio_folder("dir") (wav files and a transcripts.jsonl) or '
                                  "synthetic(seed = ...)"))
    target = target_len(config, written)
    train = attrs.evolve(spec.train, seq_len=positions, data=_with_target(spec.train.data, target))
    if spec.train.eval is not None:
        train = attrs.evolve(train, eval=attrs.evolve(spec.train.eval, data=_with_target(spec.train.eval.data, target)))
    return attrs.evolve(spec, train=train), out


def audio_data_elsewhere(spec: Spec, info: ModelInfo | None) -> list[Diagnostic]:
    """E0465 for ``audio_folder`` data on a model not fed speech (tokens, images, a family's)."""
    name = getattr(info, "class_name", None) or spec.model.source.target
    return [error("E0465", spec.span(f"{key}.call") or spec.span(key),
                  f"data = audio_folder(...) gives audio features, but {name} does not take them (`input_features` "
                  "with `decoder_input_ids`)",
                  hint="audio_folder is for a speech-to-text model such as WhisperForConditionalGeneration")
            for key, data in _data(spec) if data.kind == "audio_folder"]


def _with_target(data: DataSpec, target: int) -> DataSpec:
    return attrs.evolve(data, options={**data.options, TARGET_OPTION: target})


def _data(spec: Spec) -> list[tuple[str, Any]]:
    found = (("train.data", spec.train.data), ("train.eval.data", getattr(spec.train.eval, "data", None)))
    return [(key, data) for key, data in found if data is not None]
