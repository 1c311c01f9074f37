"""check of an audio folder (`audio_folder(path, tokenizer, processor)`, E0467 to E0469): its
transcripts.jsonl line by line, every audio file it names (present; a bounded sample decoded and
of the feature extractor's sample rate), and the feature extractor, whose features must be the
model's shape. The layout is `ppdsl.core.audio_folder`'s, the one the ranks read
(runtime/data/speech.py). The tokenizer is checked by `data_check` as for every source.

A mixin of `data_check`'s checker: it reads `opts`, `roots`, `spec`, and reports through `err`,
`unreadable`, `too_little`, `global_batch`, `_exists` and `_folder`.

Whether the model takes speech at all is known from the traced model (dsl/input_check_speech.py, E0465).
"""

from __future__ import annotations

import os
from typing import Any

from ppdsl.core.audio_folder import PROCESSOR_FILE, TRANSCRIPTS, AudioError, read_transcripts, read_wav, wav_rate
from ppdsl.core.locate import outside

from .data_quote import show
from .resolve.located import outside_error

SAMPLE_CLIPS = 32  # clips decoded (and run through the feature extractor) at check time; every header is read


class SpeechChecks:
    def _audio_folder(self, path: str) -> None:
        if not self._folder(path, "audio folder", f"{TRANSCRIPTS} and the .wav files it names"):
            return
        try:
            clips = read_transcripts(path)
        except AudioError as exc:
            self._audio_error(exc)
            return
        if self.roots is not None:
            stray = next((c for c in clips if outside(c.media, (path,))), None)
            if stray is not None:
                self.out.append(outside_error(self.span("path"), f"'{show(stray.media)}' (line {stray.line} of "
                                              f"{TRANSCRIPTS})", "the audio folder"))
                return
        gb = self.global_batch()
        if gb is not None and len(clips) < gb:
            what = "global_batch" if self.batches == 1 else "eval.batches * global_batch"
            self.too_little(f"audio folder '{show(path)}' holds {len(clips)} clips, fewer than {self.needed()} "
                            f"({what} = {gb})", hint="add clips (lines of transcripts.jsonl) or use a smaller global_batch")
        extractor = self._extractor()
        rate = None if extractor is None else int(getattr(extractor, "sampling_rate", 16000))
        try:
            for clip in clips:  # every header: a wrong rate anywhere would stop the run midway
                got = wav_rate(clip.media)
                if rate is not None and got != rate:
                    raise AudioError(clip.media, f"{got} Hz; the feature extractor's sampling_rate is {rate} Hz "
                                                 "(audio_folder does not resample)", code="E0468")
            samples = [read_wav(c.media)[1] for c in clips[:SAMPLE_CLIPS]]
        except AudioError as exc:
            self._audio_error(exc)
            return
        shape = self._model_features()
        if extractor is not None and shape is not None and not getattr(extractor, "json_only", False):
            from ppdsl.core.audio_folder import extract

            try:
                extract(extractor, samples, shape, self.opts.get("processor") or self.spec.model.source.target)
            except AudioError as exc:
                self._audio_error(exc)

    def _audio_error(self, exc: AudioError) -> None:
        where = show(exc.path) + ("" if exc.line is None else f", line {exc.line}")
        option = "processor" if exc.code == "E0469" else "path"
        hint = {"E0467": f'each line of {TRANSCRIPTS}: {{"audio": "clips/a.wav", "text": "the transcript"}}, '
                         "audio relative to the folder",
                "E0468": "write 8, 16, 24 or 32-bit PCM .wav files at the feature extractor's sampling_rate",
                "E0469": "save the model's feature extractor with save_pretrained(dir) at the model's sizes "
                         "(Whisper: feature_size = num_mel_bins, chunk_length * sampling_rate / hop_length = "
                         "2 * max_source_positions)"}[exc.code]
        self.err(exc.code, option, f"audio folder: {where}: {exc.why}", hint=hint)

    def _extractor(self) -> Any:
        """The feature extractor the ranks will load, or None (reported)."""
        from ppdsl.core.audio_folder import load_extractor

        directory = self.opts.get("processor")
        if directory is None:
            if self.spec.model.source.kind != "hf_pretrained":
                self.err("E0469", "path", "audio_folder(...) needs processor = \"dir\", a saved feature extractor "
                         "(the model is not hf_pretrained, whose own directory would hold one)",
                         hint='audio_folder("dir", tokenizer = "...", processor = "feature_extractor_dir")')
                return None
            directory = self.spec.model.source.target
        elif not self._exists(directory, "processor", f"feature extractor directory '{show(directory)}'",
                              f"a directory saved by feature_extractor.save_pretrained(), holding {PROCESSOR_FILE}"):
            return None
        if self.roots is not None and outside(os.path.join(directory, PROCESSOR_FILE), (directory,)):
            self.out.append(outside_error(self.span("processor"), f"'{show(directory)}/{PROCESSOR_FILE}'",
                                          "the feature extractor directory"))
            return None
        if self.roots is not None:  # --no-model: its JSON alone, so check imports no transformers
            return self._extractor_json(directory)
        try:
            return load_extractor(directory)
        except AudioError as exc:
            self._audio_error(exc)
            return None

    def _extractor_json(self, directory: str) -> Any:
        """--no-model: the saved extractor's sampling rate from its JSON (the ranks load it whole)."""
        import json
        import types

        try:
            with open(os.path.join(directory, PROCESSOR_FILE), "rb") as f:
                doc = json.loads(f.read())
            if not isinstance(doc, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as exc:
            self._audio_error(AudioError(directory, f"cannot read {PROCESSOR_FILE}: {exc}", code="E0469"))
            return None
        return types.SimpleNamespace(sampling_rate=doc.get("sampling_rate", 16000), json_only=True)

    def _model_features(self) -> tuple[int, ...] | None:
        from ppdsl.core.model_inputs import feature_shape

        try:
            return feature_shape(self.spec.model.resolved_config or self.spec.model.config)
        except ValueError:
            return None  # not a speech model: E0465 says so
