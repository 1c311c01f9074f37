"""An audio folder on the local disk: what ``audio_folder(path, tokenizer, processor)`` reads.
Written once for both readers, `ppdsl check`'s validation (dsl/data_check_speech.py) and the
ranks' read (runtime/data/speech.py).

The layout: ``path/transcripts.jsonl``, one JSON object per line, ``{"audio": "clips/a.wav",
"text": "the transcript"}``; ``audio`` is a path relative to ``path`` (or absolute), ``text`` the
target the model learns to write. Blank lines are skipped; the lines are the samples, in order.

Audio is decoded with the standard library's ``wave`` module: uncompressed PCM ``.wav`` of 8, 16,
24 or 32 bits, mono or several channels (averaged to one). Nothing is resampled: every file must
have the feature extractor's ``sampling_rate``.

Stdlib at import; numpy is imported only to turn samples into floats (`read_wav`).
"""

from __future__ import annotations

import os
import wave
from typing import Any

from .media_pairs import MediaError, Pair, read_pairs

__all__ = ["TRANSCRIPTS", "AudioError", "read_transcripts", "read_wav", "wav_rate"]

TRANSCRIPTS = "transcripts.jsonl"


class AudioError(MediaError):
    """A transcripts file or audio file that is not what audio_folder reads (`MediaError`; E0467
    unless another code is given)."""

    def __init__(self, path: str, why: str, line: int | None = None, code: str = "E0467"):
        super().__init__(path, why, line, code)


def read_transcripts(root: str) -> list[Pair]:
    """Every line of ``root/transcripts.jsonl`` (`Pair.media`: the audio file); AudioError for a
    missing or malformed file, line or field, or an audio file that is not a regular file."""
    try:
        return read_pairs(root, TRANSCRIPTS, "audio", "E0467", "audio file")
    except MediaError as exc:
        raise AudioError(exc.path, exc.why, exc.line) from None


def _open(path: str) -> Any:
    try:
        return wave.open(path, "rb")
    except (wave.Error, EOFError, OSError) as exc:
        raise AudioError(path, f"not a PCM .wav file the standard library reads: {str(exc) or type(exc).__name__}",
                         code="E0468") from None


def wav_rate(path: str) -> int:
    """The file's sample rate (its header only)."""
    with _open(path) as w:
        return int(w.getframerate())


def read_wav(path: str) -> tuple[int, Any]:
    """(sample rate, float32 numpy samples in [-1, 1], channels averaged); AudioError where the
    standard library cannot read it."""
    import numpy as np

    with _open(path) as w:
        width, channels, rate = w.getsampwidth(), w.getnchannels(), w.getframerate()
        try:
            raw = w.readframes(w.getnframes())
        except (wave.Error, EOFError, OSError) as exc:
            raise AudioError(path, f"its samples cannot be read: {exc}", code="E0468") from None
    if len(raw) % (width * channels):  # before numpy reads it as whole samples
        raise AudioError(path, f"a truncated last frame ({len(raw)} bytes of samples, not a multiple of "
                               f"{width * channels})", code="E0468")
    if width == 1:  # unsigned 8-bit
        samples = (np.frombuffer(raw, dtype=np.uint8).astype(np.float32) - 128.0) / 128.0
    elif width in (2, 4):
        dtype = np.int16 if width == 2 else np.int32
        samples = np.frombuffer(raw, dtype=f"<i{width}").astype(np.float32) / float(np.iinfo(dtype).max + 1)
    elif width == 3:
        b = np.frombuffer(raw, dtype=np.uint8).reshape(-1, 3).astype(np.int32)
        value = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
        samples = (np.where(value >= 1 << 23, value - (1 << 24), value)).astype(np.float32) / float(1 << 23)
    else:
        raise AudioError(path, f"{8 * width}-bit samples: audio_folder reads 8, 16, 24 or 32-bit PCM", code="E0468")
    if samples.size % channels:
        raise AudioError(path, "a truncated last frame", code="E0468")
    if channels > 1:
        samples = samples.reshape(-1, channels).mean(axis=1)
    if samples.size == 0:
        raise AudioError(path, "holds no samples", code="E0468")
    return int(rate), samples


PROCESSOR_FILE = "preprocessor_config.json"


def load_extractor(directory: str) -> Any:
    """The HF feature extractor saved in ``directory`` (AutoFeatureExtractor, local files only);
    AudioError (E0469) where there is none or it cannot be loaded."""
    if not os.path.isfile(os.path.join(directory, PROCESSOR_FILE)):
        raise AudioError(directory, f"holds no {PROCESSOR_FILE} (a saved feature extractor)", code="E0469")
    try:
        import warnings

        from transformers import AutoFeatureExtractor

        with warnings.catch_warnings():  # a few mel bins at a low sample rate: some filters empty, not an error
            warnings.filterwarnings("ignore", message=".*mel filter has all zero values.*")
            return AutoFeatureExtractor.from_pretrained(directory, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - any failure to load is the user's file: say which
        raise AudioError(directory, f"cannot load the feature extractor: {type(exc).__name__}: {exc}",
                         code="E0469") from None


def extractor_rate(extractor: Any) -> int:
    return int(getattr(extractor, "sampling_rate", 16000))


def extract(extractor: Any, clips: list[Any], shape: tuple[int, ...], where: str) -> Any:
    """float32 numpy ``(n, *shape)``: the extractor's ``input_features`` of each clip (its own
    padding: Whisper's pads every clip to its chunk). AudioError (E0469) where they are not
    ``shape``, the model's (`ppdsl.core.model_inputs.feature_shape`)."""
    import numpy as np

    try:
        out = extractor(clips, sampling_rate=extractor_rate(extractor), return_tensors="np")["input_features"]
    except Exception as exc:  # noqa: BLE001 - the user's extractor: say which
        raise AudioError(where, f"the feature extractor fails: {type(exc).__name__}: {exc}", code="E0469") from None
    out = np.asarray(out, dtype=np.float32)
    if tuple(out.shape[1:]) != tuple(shape):
        raise AudioError(where, f"the feature extractor gives features of {' x '.join(map(str, out.shape[1:]))}; the "
                                f"model takes {' x '.join(map(str, shape))} (from its config: num_mel_bins and 2 * "
                                "max_source_positions frames for Whisper)", code="E0469")
    return out
