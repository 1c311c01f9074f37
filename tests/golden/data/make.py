"""Writes the small data files that the E04xx data goldens (tests/golden/E041*_*.ppspec) name.

    .venv/bin/python tests/golden/data/make.py

Deterministic; the files are committed, so this only needs running after a change here.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
SENTENCES = [
    "a wonderful film with a great cast", "the plot was dull and the acting bad", "i loved every minute of it",
    "a waste of time", "great music and a good story", "bad film , bad script", "the cast was wonderful",
    "dull , slow and long",
]


def tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    directory.mkdir(exist_ok=True)
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(SENTENCES, trainers.WordLevelTrainer(special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]"]))
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tok.save(str(directory / "tokenizer.json"))


def images() -> None:
    """image_folder goldens (E0436, E0450 to E0453): `images` has 2 classes of 2 PNGs each; in
    `images_broken`, class b's file is text named .png."""
    from PIL import Image

    for cls, colour in (("a", (200, 30, 30)), ("b", (30, 30, 200))):
        for root in ("images", "images_broken"):
            (HERE / root / cls).mkdir(parents=True, exist_ok=True)
        for i in range(2):
            Image.new("RGB", (8, 8), colour).save(HERE / "images" / cls / f"{i}.png")
    Image.new("RGB", (8, 8), (200, 30, 30)).save(HERE / "images_broken" / "a" / "0.png")
    (HERE / "images_broken" / "b" / "0.png").write_text("not an image\n")


def main() -> None:
    ids = (np.arange(512) * 7 % 128).astype(np.uint16)
    ids.tofile(HERE / "tokens.bin")  # 512 uint16 ids below 128
    (HERE / "odd_size.bin").write_bytes(bytes(7))  # not a whole number of uint16
    big = ids.copy()
    big[300] = 1000
    big.tofile(HERE / "big_ids.bin")  # one id beyond a 128-token vocabulary
    np.save(HERE / "floats.npy", np.linspace(0, 1, 16, dtype=np.float32))
    np.save(HERE / "matrix.npy", ids.reshape(4, 128))
    np.save(HERE / "short.npy", ids[:100].astype(np.uint32))  # fewer than 8 * 32 tokens
    tokenizer(HERE / "tokenizer")
    (HERE / "no_tokenizer").mkdir(exist_ok=True)
    (HERE / "no_tokenizer" / "README").write_text("a directory without tokenizer.json (golden E0415)\n")
    (HERE / "corpus.txt").write_text("\n".join(SENTENCES * 4) + "\n", encoding="utf-8")
    (HERE / "latin1.txt").write_bytes("un film très bon\n".encode("latin-1"))
    rows = [{"sentence": s, "label": i % 2} for i, s in enumerate(SENTENCES)]
    (HERE / "reviews.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    bad = [dict(r, label=5 if i == 3 else r["label"]) for i, r in enumerate(rows)]
    (HERE / "labels_out_of_range.jsonl").write_text("".join(json.dumps(r) + "\n" for r in bad), encoding="utf-8")
    (HERE / "reviews.csv").write_text("review,label\n" + "".join(f'"{r["sentence"]}",{r["label"]}\n' for r in rows),
                                      encoding="utf-8")
    images()


if __name__ == "__main__":
    main()
