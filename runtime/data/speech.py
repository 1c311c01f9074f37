"""Data for a speech-to-text model (`OwnForward.inputs = "speech"`: Whisper): audio features in,
target token ids as labels. Each sample is the features of `OwnForward.input_shape` (the
config's, `ppdsl.core.model_inputs.feature_shape`) and ``target_len`` target ids (the data
option check writes from the spec's ``seq_len``, dsl/input_check_speech.py), -100 where a target
is shorter. The stages make the decoder's input from the labels by the model's own rule (shifted
right, ``decoder_start_token_id`` first); the loss is HF's (`ppdsl.core.task_loss`, seq2seq_lm).

- ``synthetic(seed)``: target ids follow the causal-LM rule of `runtime.data.synthetic.rule_tokens`
  (``x[t+1] = (a * x[t] + b) % K``, ``K = min(vocab_size, 16)``); the features spell them: the frames are cut into
  ``target_len`` equal segments, segment ``t`` is token ``x[t]``'s fixed random pattern over the
  feature bins (drawn once from the seed) plus unit noise of `NOISE` scale. The encoder must read
  the features for the decoder to write the first token and tell the rule.
- ``audio_folder(path, tokenizer, processor)``: ``path/transcripts.jsonl`` lines ``{"audio":
  "a.wav", "text": "..."}`` (`ppdsl.core.audio_folder`): each wav decoded with the standard
  library, turned into features by the HF feature extractor saved in ``processor`` (an
  ``hf_pretrained`` model's own when left out), the text tokenized with the tokenizer's special
  tokens, truncated to ``target_len``. Transcripts are read and tokenized whole on first use; the
  audio is decoded per batch, on every rank (the own forward reads its inputs on every stage).

Order: sample ``g`` of the run is line ``perm_e[g % n]`` of epoch ``e = g // n``
(`runtime.data.order._Order`), a pure function of (seed, step, data-parallel rank) as for every
file source; the synthetic step's global batch comes from one generator per step, so neither
depends on how the replicas split it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from ppdsl.core.task_loss import IGNORE_INDEX
from ppdsl.lowering.plan import DataPlan, Plan

from ppdsl.runtime.data.synthetic import rule_tokens
from ppdsl.runtime.data.batch import Batch, DataSource, Needs, Task, _placeholder, _vocab_or_none
from ppdsl.runtime.parallel.rng import mix_seed

__all__ = ["AudioData", "SpeechSynthetic", "speech_source"]

NOISE = 0.5  # synthetic features: each token's pattern plus this much unit noise
ALPHABET = 16  # synthetic targets use ids below min(vocab_size, this): a tiny model tells their patterns apart quickly
TARGET_OPTION = "target_len"


@dataclass
class _Speech(DataSource):
    """What both sources share: the shapes, and the batch a rank sees."""

    features: tuple[int, ...]  # one sample's (OwnForward.input_shape)
    target_len: int
    seq_len: int  # the encoder's positions (the activation's length; the token placeholder's)
    batch_size: int
    microbatch_size: int
    dp: int
    seed: int
    needs: Needs

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.dp

    def assemble(self, features: torch.Tensor | None, labels: torch.Tensor | None, device: torch.device | str) -> Batch:
        n = self.batch_size
        feats = features.to(device) if self.needs.inputs and features is not None else \
            torch.zeros((), dtype=torch.float32, device=device).expand(n, *self.features)
        out_labels = labels.to(device) if self.needs.labels and labels is not None else \
            _placeholder((n, self.target_len), device)
        return Batch(_placeholder((n, self.seq_len), device), out_labels, None, None, input_features=feats)


@dataclass
class SpeechSynthetic(_Speech):
    vocab_size: int = 0
    task: Task = "seq2seq"

    def batch(self, step: int, dp_rank: int, device: torch.device | str = "cpu") -> Batch:
        gen = torch.Generator().manual_seed(mix_seed(self.seed, step, 0))
        n, t = self.global_batch, self.target_len
        k = max(1, min(self.vocab_size, ALPHABET))
        tokens = rule_tokens(n, t, k, gen)
        rows = slice(dp_rank * self.batch_size, (dp_rank + 1) * self.batch_size)
        return self.assemble(self._features(tokens, k, gen)[rows], tokens[rows], device)

    def _features(self, tokens: torch.Tensor, k: int, gen: torch.Generator) -> torch.Tensor:
        """Frames cut into target_len segments, each its token's pattern plus noise, in the
        model's layout (bins first, as Whisper's; frames first, as Speech2Text's)."""
        bins_first = self.features[0] < self.features[1]  # Whisper: (mel bins, frames); Speech2Text: (frames, bins)
        bins, frames = self.features if bins_first else self.features[::-1]
        patterns = torch.randn((k, bins), generator=torch.Generator().manual_seed(mix_seed(self.seed, 1)))
        segment = (torch.arange(frames) * self.target_len) // frames  # frame -> the token it spells
        spelled = patterns[tokens[:, segment]]  # (n, frames, bins)
        spelled = spelled + NOISE * torch.randn(spelled.shape, generator=gen)
        return spelled.transpose(1, 2).contiguous() if bins_first else spelled


@dataclass
class AudioData(_Speech):
    path: str = ""
    tokenizer: str = ""
    processor: str = ""
    vocab_size: int | None = None
    task: Task = "seq2seq"
    _clips: Any = field(default=None, repr=False)
    _labels: Any = field(default=None, repr=False)
    _order: Any = field(default=None, repr=False)
    _extractor: Any = field(default=None, repr=False)

    def clips(self) -> list[Any]:
        """The transcripts, read and tokenized on first use; ValueError for what check refuses."""
        if self._clips is None:
            from ppdsl.core.audio_folder import read_transcripts

            from ppdsl.runtime.data.tokenizer import _Tokenizer

            clips = read_transcripts(self.path)
            if len(clips) < self.global_batch:
                raise ValueError(f"audio folder {self.path} holds {len(clips)} clips, fewer than one global batch "
                                 f"(global_batch = {self.global_batch})")
            targets = _Tokenizer(self.tokenizer, max_length=self.target_len).encode_targets([c.text for c in clips])
            top = max(max(ids, default=0) for ids in targets)
            if self.vocab_size is not None and top >= self.vocab_size:
                raise ValueError(f"audio folder {self.path}: the tokenizer in {self.tokenizer} gives id {top}, outside "
                                 f"the model's vocabulary (vocab_size = {self.vocab_size})")
            labels = torch.full((len(clips), self.target_len), IGNORE_INDEX, dtype=torch.long)
            for r, ids in enumerate(targets):
                ids = ids[: self.target_len]
                labels[r, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            self._clips, self._labels = clips, labels
            self._order = _order(len(clips), self.seed)
        return self._clips

    def count(self) -> int:
        return len(self.clips())

    def batch(self, step: int, dp_rank: int, device: torch.device | str = "cpu") -> Batch:
        self.clips()
        start = step * self.global_batch + dp_rank * self.batch_size
        return self.assemble_read(self.read(self._order.items(range(start, start + self.batch_size))), device)

    def assemble_read(self, got: Any, device: torch.device | str) -> Batch:
        return self.assemble(got[5], got[1], device)

    def read(self, picked: list[int]) -> tuple[None, torch.Tensor, None, None, None, torch.Tensor | None]:
        """Clips `picked`: their target ids (labels) and audio features (`runtime.data.batch.READ_SLOTS`;
        decoded only where the stages take the inputs)."""
        clips = self.clips()
        labels = self._labels[picked]
        if not self.needs.inputs:  # labels only: no audio is decoded
            return None, labels, None, None, None, None
        from ppdsl.core.audio_folder import extract, extractor_rate, load_extractor, read_wav

        if self._extractor is None:
            self._extractor = load_extractor(self.processor)
        rate = extractor_rate(self._extractor)
        samples = []
        for i in picked:
            got, wav = read_wav(clips[i].media)
            if got != rate:
                raise ValueError(f"{clips[i].media}: {got} Hz, the feature extractor's sampling_rate is {rate} Hz")
            samples.append(wav)
        features = torch.from_numpy(extract(self._extractor, samples, self.features, self.processor))
        return None, labels, None, None, None, features


def _order(n: int, seed: int) -> Any:
    from ppdsl.runtime.data.order import _Order

    return _Order(n, seed)


def processor_of(plan: Plan, opts: dict[str, Any]) -> str:
    """The feature extractor's directory: the option, else an hf_pretrained model's own."""
    given = opts.get("processor")
    if given is not None:
        return str(given)
    if plan.model.kind == "hf_pretrained":
        return plan.model.target
    raise ValueError("audio_folder(...) needs processor = \"dir\" (a saved feature extractor) for a model that is not "
                     "hf_pretrained")


def speech_source(plan: Plan, data: DataPlan, seed: int, needs: Needs) -> DataSource:
    """The speech data `data` names; ValueError for one that gives no audio."""
    own, train = plan.own_forward, plan.train
    assert own is not None
    opts = data.options_dict
    target = opts.get(TARGET_OPTION)
    if not isinstance(target, int):
        raise ValueError("the plan's speech data has no target_len: check it again with ppdsl check")
    common = dict(features=tuple(own.input_shape), target_len=target, seq_len=train.seq_len,
                  batch_size=plan.replica_batch, microbatch_size=train.microbatch_size,
                  dp=plan.mesh.dp, seed=seed, needs=needs)
    if data.kind == "synthetic":
        vocab = _vocab_or_none(plan.model)
        if vocab is None:
            raise ValueError(f"model {plan.model.target!r}: synthetic data needs vocab_size in its config")
        return SpeechSynthetic(vocab_size=vocab, **common)  # type: ignore[arg-type]
    if data.kind == "audio_folder":
        return AudioData(path=os.fspath(opts["path"]), tokenizer=opts["tokenizer"], processor=processor_of(plan, opts),
                         vocab_size=_vocab_or_none(plan.model), **common)  # type: ignore[arg-type]
    raise ValueError(f"data = {data.kind}(...) gives token ids; model {plan.model.target!r} takes speech: use "
                     "audio_folder(...) or synthetic(...)")
