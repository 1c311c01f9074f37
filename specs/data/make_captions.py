"""Writes the shipped image-text example: specs/data/shapes/captions.jsonl (rows {"image":
"train/checker/000.png", "text": ...}, one per training image of specs/data/shapes, written by
make_images.py) and specs/data/captions_tokenizer/ (a word-level tokenizer of the captions' words,
built with the `tokenizers` library as make_pairs.py builds its own: <s> 0, <pad> 1, </s> 2,
<unk> 3, every caption wrapped in <s> ... </s>). Deterministic: running it again writes the same
bytes.

A caption says what its image shows, in words of different lengths per class (a checker board
leans red, horizontal stripes green, vertical stripes blue), so an image-text model learns the
caption only by reading the image (specs/llava_images.ppspec).

    python specs/data/make_captions.py
"""

from __future__ import annotations

import json
import os

from make_pairs import write_tokenizer

HERE = os.path.dirname(os.path.abspath(__file__))
CAPTIONS = {"checker": "a red checker board", "horizontal": "green stripes across", "vertical": "blue stripes running down"}


def main() -> None:
    root = os.path.join(HERE, "shapes")
    rows = [{"image": f"train/{kind}/{name}", "text": CAPTIONS[kind]}
            for kind in sorted(CAPTIONS) for name in sorted(os.listdir(os.path.join(root, "train", kind)))]
    with open(os.path.join(root, "captions.jsonl"), "w") as f:
        for row in rows:
            f.write(json.dumps(row, sort_keys=True) + "\n")
    words = sorted({w for caption in CAPTIONS.values() for w in caption.split()})
    write_tokenizer(os.path.join(HERE, "captions_tokenizer"), words)
    print(f"wrote {len(rows)} captions and a {len(words) + 4}-token tokenizer")


if __name__ == "__main__":
    main()
