"""Writes the shipped speech-to-text example (specs/whisper_wav.ppspec): specs/data/speech/ (short
mono 16-bit PCM .wav clips at 8 kHz in clips/, and transcripts.jsonl, one {"audio": "clips/000.wav",
"text": "three one four"} per clip) and specs/data/speech_extractor/ (a WhisperFeatureExtractor of
16 mel bins over 1-second chunks: 8000 Hz, hop 80, so 100 frames, what a Whisper of
num_mel_bins = 16 and max_source_positions = 50 takes). The transcripts' tokenizer is
specs/data/pairs_tokenizer (make_pairs.py), whose words include the English numbers used here.

Each clip says 2 to 4 number words; a "word" is a 0.16 s tone of its own pitch (mel-spaced between
250 Hz and 3.2 kHz, so each falls in other mel bins), faded in and out, with 0.03 s of silence
between words, plus a little noise. The model learns to write the words from the pitches, in order.
Deterministic: running it again writes the same bytes (the extractor's JSON included).

    python specs/data/make_speech.py
"""

from __future__ import annotations

import json
import math
import os
import random
import struct
import wave

HERE = os.path.dirname(os.path.abspath(__file__))
WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven"]
RATE = 8000
WORD_S, GAP_S = 0.16, 0.03
CLIPS = 40


def _mel(f: float) -> float:
    return 2595.0 * math.log10(1.0 + f / 700.0)


def _hz(m: float) -> float:
    return 700.0 * (10 ** (m / 2595.0) - 1.0)


def pitches() -> dict[str, float]:
    lo, hi = _mel(250.0), _mel(3200.0)
    return {w: _hz(lo + (hi - lo) * i / (len(WORDS) - 1)) for i, w in enumerate(WORDS)}


def clip(words: list[str], rng: random.Random) -> list[int]:
    """16-bit samples of one clip."""
    freq = pitches()
    out: list[float] = []
    n = int(WORD_S * RATE)
    for w in words:
        for i in range(n):
            fade = min(1.0, i / 80, (n - 1 - i) / 80)
            out.append(0.5 * fade * math.sin(2 * math.pi * freq[w] * i / RATE))
        out += [0.0] * int(GAP_S * RATE)
    return [max(-32768, min(32767, int(round((x + rng.gauss(0.0, 0.01)) * 32767)))) for x in out]


def write_wav(path: str, samples: list[int]) -> None:
    with wave.open(path, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(RATE)
        w.writeframes(struct.pack(f"<{len(samples)}h", *samples))


def write_extractor(directory: str) -> None:
    from transformers import WhisperFeatureExtractor

    WhisperFeatureExtractor(feature_size=16, sampling_rate=RATE, hop_length=80, chunk_length=1,
                            n_fft=400).save_pretrained(directory)


def main() -> None:
    rng = random.Random(0)
    root = os.path.join(HERE, "speech")
    os.makedirs(os.path.join(root, "clips"), exist_ok=True)
    with open(os.path.join(root, "transcripts.jsonl"), "w") as f:
        for k in range(CLIPS):
            words = [rng.choice(WORDS) for _ in range(rng.randint(2, 4))]
            name = f"clips/{k:03d}.wav"
            write_wav(os.path.join(root, name), clip(words, rng))
            f.write(json.dumps({"audio": name, "text": " ".join(words)}, sort_keys=True) + "\n")
    write_extractor(os.path.join(HERE, "speech_extractor"))


if __name__ == "__main__":
    main()
