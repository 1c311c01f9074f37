"""Write specs/data/shapes: small PNG images of three classes, one sub-folder per class, for
`image_folder(...)` (specs/vit_images.ppspec).

Generated (not downloaded), seeded: `python specs/data/make_images.py` rewrites the same files.
Each image is 32 x 32 RGB: stripes (``horizontal``, ``vertical``) or a ``checker`` board of a
random colour that leans to the class's channel (red, green, blue), over a random dark
background, at a random stripe width (2 to 4 pixels) and phase. A tiny ViT tells the classes
apart within tens of steps. ``train/`` holds 24 images per class,
``validation/`` 8 more.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

from PIL import Image

OUT = Path(__file__).resolve().parent / "shapes"
SIZE = 32
CLASSES = ("checker", "horizontal", "vertical")
SPLITS = {"train": 24, "validation": 8}
SEED = 0


def _image(kind: str, rng: random.Random) -> Image.Image:
    # the stripes' colour leans to the class's own channel (red, green, blue), over a dark background
    lean = CLASSES.index(kind)
    a = tuple(rng.randint(150, 255) if c == lean else rng.randint(0, 120) for c in range(3))
    b = tuple(rng.randint(0, 80) for _ in range(3))
    width, phase = rng.randint(2, 4), rng.randrange(4)
    img = Image.new("RGB", (SIZE, SIZE))
    px = img.load()
    for y in range(SIZE):
        for x in range(SIZE):
            row, col = (y + phase) // width, (x + phase) // width
            on = {"horizontal": row, "vertical": col, "checker": row + col}[kind] % 2
            px[x, y] = a if on else b
    return img


def main() -> None:
    rng = random.Random(SEED)
    shutil.rmtree(OUT, ignore_errors=True)
    for split, count in SPLITS.items():
        for kind in CLASSES:
            folder = OUT / split / kind
            folder.mkdir(parents=True)
            for i in range(count):
                _image(kind, rng).save(folder / f"{i:03d}.png", optimize=True)
    print(f"wrote {sum(SPLITS.values()) * len(CLASSES)} images under {OUT}")


if __name__ == "__main__":
    main()
