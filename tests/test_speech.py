"""Speech-to-text models (issue 32, items 2, 3 and 4 for speech): Whisper on audio features.

The input kind is the forward's (`ppdsl.core.model_inputs`: `input_features` with
`decoder_input_ids`, no `input_ids`: "speech"); the features' shape comes from the config
(Whisper: num_mel_bins x 2 * max_source_positions); the spec's seq_len is the target's length
(dsl/input_check_speech.py), the encoder's traced positions the activation's. The loss is HF's
(labels, -100 ignored, the decoder's input shifted right by the model's own rule). Data:
synthetic features that spell their targets, or an audio folder (`ppdsl.core.audio_folder`: wav
files read by the standard library, transcripts.jsonl, the saved feature extractor). One gloo
verify of a tiny Whisper at pp 2.
"""

from __future__ import annotations

import json
import math
import struct
import wave
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from _exec_harness import equivalence_worker  # noqa: E402
from dist_harness import run_distributed  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
WHISPER = dict(vocab_size=32, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
               decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=16,
               max_source_positions=50, max_target_positions=32, bos_token_id=0, pad_token_id=1, eos_token_id=2,
               decoder_start_token_id=0, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
SMALL = {**WHISPER, "max_source_positions": 8}  # 16 frames: the cheapest encoder (verify)
EXTRACTOR = REPO / "specs" / "data" / "speech_extractor"  # 16 mel bins, 100 frames at 8 kHz
TOKENIZER = REPO / "specs" / "data" / "pairs_tokenizer"


def _spec(config: dict[str, Any] = WHISPER, data: str = "synthetic(seed = 0)", train: str = "seq_len = 8",
          mesh: str = "pp = 2") -> str:
    values = ", ".join(f"{k} = {v}" for k, v in config.items())
    return f"""ppspec 1
model m {{
  source = hf("WhisperForConditionalGeneration")
  config {{ {values} }}
}}
mesh {{ {mesh} }}
pipeline {{ style = 1f1b, microbatches = 2 }}
train {{
  global_batch = 4
  {train}
  steps = 2
  optimizer = sgd(lr = 1e-2)
  data = {data}
}}
"""


from _spec_text import check_text as _check, plan_text as _plan  # noqa: E402


def _errors(tmp_path: Path, text: str) -> list[Any]:
    return [d for d in _check(tmp_path, text).diagnostics if d.is_error]


def _wav(path: Path, seconds: float = 0.3, rate: int = 8000, width: int = 2, channels: int = 1) -> None:
    n = int(seconds * rate)
    peak = (1 << (8 * width - 1)) - 1
    values = [int(0.5 * peak * math.sin(2 * math.pi * 440 * i / rate)) for i in range(n) for _ in range(channels)]
    if width == 1:
        raw = bytes(v + 128 for v in values)
    elif width == 3:
        raw = b"".join(struct.pack("<i", v)[:3] for v in values)
    else:
        raw = struct.pack(f"<{len(values)}{'h' if width == 2 else 'i'}", *values)
    with wave.open(str(path), "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(raw)


def _folder(root: Path, n: int = 4, rate: int = 8000, lines: list[str] | None = None) -> Path:
    (root / "clips").mkdir(parents=True)
    rows = []
    for i in range(n):
        _wav(root / "clips" / f"{i}.wav", rate=rate)
        rows.append(json.dumps({"audio": f"clips/{i}.wav", "text": ["one two", "three", "four five six", "zero"][i % 4]}))
    (root / "transcripts.jsonl").write_text("\n".join(lines if lines is not None else rows) + "\n", encoding="utf-8")
    return root


def _audio(root: Path) -> str:
    return f'audio_folder("{root}", tokenizer = "{TOKENIZER}", processor = "{EXTRACTOR}")'


# ---- the rules

def test_the_input_kind_shape_and_task_are_the_forwards_and_the_configs() -> None:
    from ppdsl.core.model_inputs import feature_shape, input_kind, target_len
    from ppdsl.core.task_loss import own_task

    assert input_kind(("input_features", "attention_mask", "decoder_input_ids")) == "speech"
    assert input_kind(("input_features",)) is None  # no decoder: not a speech-to-text model
    assert input_kind(("input_values", "labels")) is None  # raw audio (wav2vec 2): not fed
    assert own_task("WhisperForConditionalGeneration", "speech") == "seq2seq_lm"
    assert feature_shape({"num_mel_bins": 80, "max_source_positions": 1500}) == (80, 3000)
    assert feature_shape({"input_feat_per_channel": 80, "input_channels": 1, "max_source_positions": 6000}) == (6000, 80)
    with pytest.raises(ValueError, match="num_mel_bins"):
        feature_shape({"d_model": 32})
    assert target_len({"max_target_positions": 448}, None) == 32
    assert target_len({"max_target_positions": 16}, None) == 16
    assert target_len({"max_target_positions": 16}, 12) == 12


def test_the_task_loss_is_hfs_labels_loss() -> None:
    import transformers

    from ppdsl.core.own_cut import model_inputs
    from ppdsl.core.task_loss import task_loss

    model = transformers.WhisperForConditionalGeneration(transformers.WhisperConfig(**SMALL)).eval()
    gen = torch.Generator().manual_seed(0)
    features = torch.randn((2, 16, 16), generator=gen)
    labels = torch.randint(3, 32, (2, 6), generator=gen)
    labels[1, 4:] = -100  # a shorter target: the pad id in the decoder's input, no loss there
    with torch.no_grad():
        hf = model(input_features=features, labels=labels).loss
        logits = model(**model_inputs(model, None, input_features=features, labels=labels)).logits
    assert torch.allclose(task_loss("seq2seq_lm", model.config, logits, labels), hf, atol=1e-6)


def test_the_encoder_is_cut_seq_len_is_the_targets_and_the_data_spells_them(tmp_path: Path) -> None:
    from ppdsl.runtime.data.source import make_data

    plan = _plan(tmp_path, _spec())
    own = plan.own_forward
    assert (plan.model.task, own.inputs, own.input_shape, plan.blocks) == ("seq2seq_lm", "speech", (16, 100),
                                                                    "model.encoder.layers")
    assert plan.train.seq_len == 50  # the encoder's positions: what the stages send
    assert plan.train.data.options_dict["target_len"] == 8
    assert plan.stages[0].first == ("model.encoder.conv1", "model.encoder.conv2", "model.encoder.embed_positions")
    batch = make_data(plan).batch(0, 0)
    assert batch.input_features.shape == (4, 16, 100) and batch.labels.shape == (4, 8)
    assert torch.equal(batch.labels, make_data(plan).batch(0, 0).labels)  # a pure function of (seed, step)
    # the default target length: 32, at most max_target_positions
    assert _plan(tmp_path, _spec(train="")).train.data.options_dict["target_len"] == 32


def test_what_a_speech_model_does_not_run_is_refused_at_its_line(tmp_path: Path) -> None:
    text = _spec(train="seq_len = 40")
    errors = _errors(tmp_path, text)
    assert [d.code for d in errors] == ["E0466"]
    assert errors[0].span.line == next(i for i, l in enumerate(text.splitlines(), 1) if "seq_len = 40" in l)
    errors = _errors(tmp_path, _spec(data=f'text("{REPO}/specs/data/pairs.jsonl", tokenizer = "{TOKENIZER}")'))
    assert [d.code for d in errors] == ["E0465"] and "token ids" in errors[0].message
    held = _spec().replace("data = synthetic(seed = 0)", "data = synthetic(seed = 0)\n  eval { data = holdout(0.25) }")
    errors = _errors(tmp_path, held)  # an audio folder can be held out of, synthetic clips cannot
    assert [d.code for d in errors] == ["E0456"] and "synthetic data" in errors[0].message
    # audio for a model fed tokens
    gpt = f"""ppspec 1
model m {{
  source = hf("GPT2LMHeadModel")
  config {{ n_layer = 2, n_embd = 32, n_head = 4, vocab_size = 64, n_positions = 32 }}
}}
mesh {{ pp = 2 }}
train {{ global_batch = 4, seq_len = 8, data = {_audio(_folder(tmp_path / "a"))} }}
"""
    assert "E0465" in [d.code for d in _errors(tmp_path, gpt)]


# ---- audio files

def test_wav_files_are_read_by_the_standard_library(tmp_path: Path) -> None:
    from ppdsl.core.audio_folder import AudioError, read_wav

    for width in (1, 2, 3, 4):
        _wav(tmp_path / f"w{width}.wav", width=width, channels=2 if width == 2 else 1)
        rate, samples = read_wav(str(tmp_path / f"w{width}.wav"))
        assert rate == 8000 and samples.shape == (2400,) and 0.45 < float(abs(samples).max()) < 0.55
    (tmp_path / "bad.wav").write_bytes(b"RIFF0000WAVEfmt junk")
    with pytest.raises(AudioError) as info:
        read_wav(str(tmp_path / "bad.wav"))
    assert info.value.code == "E0468"
    (tmp_path / "text.wav").write_bytes(b"hello")  # wave's EOFError has no message: the reason is its name
    with pytest.raises(AudioError, match="reads: EOFError"):
        read_wav(str(tmp_path / "text.wav"))
    # a header, then one byte of 16-bit samples: E0468 naming the cut frame, not numpy's ValueError
    (tmp_path / "cut.wav").write_bytes((tmp_path / "w2.wav").read_bytes()[:45])
    with pytest.raises(AudioError, match="truncated last frame") as info:
        read_wav(str(tmp_path / "cut.wav"))
    assert info.value.code == "E0468"


def test_the_audio_folder_gives_features_and_padded_targets(tmp_path: Path) -> None:
    from ppdsl.runtime.data.source import make_data

    root = _folder(tmp_path / "speech")
    plan = _plan(tmp_path, _spec(data=_audio(root)))
    batch = make_data(plan).batch(0, 0)
    assert batch.input_features.shape == (4, 16, 100) and batch.input_features.dtype == torch.float32
    counted = (batch.labels != -100).sum(1).tolist()
    assert sorted(counted) == [3, 3, 4, 5]  # <s> words </s>: "zero", "three", "one two", "four five six"
    assert (batch.labels[:, 0] == 0).all()  # <s>


def test_held_out_clips_are_evaluated_and_never_trained_on(tmp_path: Path) -> None:
    from ppdsl.runtime.data.source import make_data

    root = _folder(tmp_path / "speech", n=8)
    plan = _plan(tmp_path, _spec(data=_audio(root), train="seq_len = 8\n  eval { data = holdout(0.5) }"))
    train, held = make_data(plan), make_data(plan, data=plan.train.eval.data)
    train._ready(), held._ready()
    trained, evaluated = set(train._orders[0](range(16))), set(held._orders[0](range(8)))
    assert len(evaluated) == 4 and not trained & evaluated and len(trained | evaluated) == 8
    batch = held.batch(0, 0)  # the held-out clips' features and targets, as the folder reads them alone
    alone = train.parts[0].read([held._orders[0]([k])[0] for _, k in held.positions(0, 0)])
    assert torch.equal(batch.labels, alone[1]) and torch.equal(batch.input_features, alone[5])
    assert batch.input_features.shape == (4, 16, 100) and batch.input_ids.shape == (4, plan.train.seq_len)
    # check counts the clips (transcripts.jsonl): too few held out, or too few kept, is E0456
    for fraction, needle in (("0.25", "holds out 2 of 8 clips"), ("0.75", "keeps 2 clips")):
        errors = _errors(tmp_path, _spec(data=_audio(root), train=f"seq_len = 8\n  eval {{ data = holdout({fraction}) }}"))
        assert [d.code for d in errors] == ["E0456"] and needle in errors[0].message, errors[0].message
    # the last stage's ranks read the same rows (the own forward reads the inputs on every stage)
    last = make_data(plan, pp_rank=1, data=plan.train.eval.data).batch(0, 0)
    assert torch.equal(last.labels, batch.labels) and torch.equal(last.input_features, batch.input_features)


@pytest.mark.parametrize("case, code, needle", [
    ("bad_json", "E0467", "line 2"),
    ("no_text", "E0467", "'text'"),
    ("missing_audio", "E0467", "does not exist"),
    ("other_rate", "E0468", "16000 Hz"),
    ("extractor_shape", "E0469", "16 x 100"),
])
def test_bad_audio_data_is_refused_by_check(tmp_path: Path, case: str, code: str, needle: str) -> None:
    root = tmp_path / "speech"
    config = WHISPER
    if case == "bad_json":
        _folder(root, lines=['{"audio": "clips/0.wav", "text": "one"}', '{"audio": "clips/1.wav",'])
    elif case == "no_text":
        _folder(root, lines=['{"audio": "clips/0.wav"}'])
    elif case == "missing_audio":
        _folder(root, lines=['{"audio": "clips/9.wav", "text": "one"}'])
    elif case == "other_rate":
        _folder(root, rate=16000)
    else:
        _folder(root)
        config = {**WHISPER, "max_source_positions": 40}  # 80 frames; the extractor gives 100
    text = _spec(config, data=_audio(root))
    errors = _errors(tmp_path, text)
    assert [d.code for d in errors] == [code], [f"{d.code} {d.message}" for d in errors]
    assert needle in errors[0].message
    assert errors[0].span.line == next(i for i, l in enumerate(text.splitlines(), 1) if "audio_folder" in l)


# ---- one process == pipeline

@pytest.mark.distributed
def test_whisper_at_pp2_matches_one_process(tmp_path: Path) -> None:
    plan = _plan(tmp_path, _spec(SMALL))
    (report, _seconds), = run_distributed(equivalence_worker, 2, [plan], timeout=180)[0]
    assert report.ok, report.render()


def test_speech2text_takes_frames_first_features(tmp_path: Path) -> None:
    from ppdsl.runtime.data.source import make_data

    s2t = dict(vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
               decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=64,
               max_target_positions=32, input_feat_per_channel=16, input_channels=1, conv_channels=32,
               decoder_start_token_id=2)
    text = _spec(s2t).replace("WhisperForConditionalGeneration", "Speech2TextForConditionalGeneration")
    plan = _plan(tmp_path, text)
    assert (plan.own_forward.inputs, plan.own_forward.input_shape, plan.train.seq_len) == ("speech", (64, 16), 16)
    assert make_data(plan).batch(0, 0).input_features.shape == (4, 64, 16)  # frames x bins
