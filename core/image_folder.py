"""An image folder on the local disk, one sub-folder per class: what ``image_folder(path, ...)``
reads. Written once for both readers, `ppdsl check`'s bounded sample (dsl/data_check_images.py)
and the ranks' read (runtime/data/images.py).

The layout is torchvision's ``ImageFolder``'s: the classes are the sorted names of the folder's
sub-folders (hidden ones left out), class ``i`` the ``i``-th of them; a class's images are the
files under its sub-folder (nested folders included) whose names end in one of
`IMAGE_EXTENSIONS`, sorted by path. Other files (a README, ``.DS_Store``) are not samples.

``split``: a sub-folder of ``path`` that holds the class folders (``train``, ``validation``).
Left out, ``path/train`` when that is a folder, else ``path`` itself.

An image-text folder (``image_text_folder(path, tokenizer, processor)``) is read here too:
``path/captions.jsonl``, one ``{"image": "img/a.png", "text": "the caption"}`` per line
(`ppdsl.core.media_pairs`), the image relative to ``path``.

Stdlib at import; Pillow is imported only to decode an image (`open_image`). The standard
library cannot decode PNG or JPEG.
"""

from __future__ import annotations

import os
from typing import Any

from .media_pairs import MediaError, Pair, read_pairs

__all__ = ["CAPTIONS", "CHANNEL_MODES", "IMAGE_EXTENSIONS", "DEFAULT_SPLIT", "FolderError", "class_names", "class_root",
           "image_files", "open_image", "read_captions"]

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm")
DEFAULT_SPLIT = "train"
CHANNEL_MODES = {1: "L", 3: "RGB"}  # the model's channels -> the mode images are decoded to
CAPTIONS = "captions.jsonl"  # an image-text folder's index
CAPTIONS_CODE = "E0479"  # check's diagnostic for a folder, index line or image that cannot be read


class FolderError(ValueError):
    """A folder or image that is not what image_folder reads; `path` names it."""

    def __init__(self, path: str, why: str):
        super().__init__(f"{path}: {why}")
        self.path, self.why = path, why


def class_root(path: str, split: str | None) -> str:
    """The folder whose sub-folders are the classes."""
    if split is not None:
        return os.path.join(path, split)
    default = os.path.join(path, DEFAULT_SPLIT)
    return default if os.path.isdir(default) else path


def class_names(root: str) -> list[str]:
    """The sorted names of `root`'s sub-folders, hidden ones left out."""
    try:
        entries = os.listdir(root)
    except OSError as exc:
        raise FolderError(root, exc.strerror or str(exc)) from None
    return sorted(e for e in entries if not e.startswith(".") and os.path.isdir(os.path.join(root, e)))


def image_files(folder: str) -> list[str]:
    """The image files under `folder`, sorted by path (hidden files and folders left out)."""
    out = []
    for top, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        out += [os.path.join(top, f) for f in files if not f.startswith(".") and f.lower().endswith(IMAGE_EXTENSIONS)]
    return sorted(out)


def open_image(path: str, channels: int) -> Any:
    """The decoded image (a PIL image, loaded whole: a truncated file fails here) in the mode of
    `channels` (1: "L", 3: "RGB"). FolderError naming the file where Pillow cannot read it."""
    from PIL import Image, UnidentifiedImageError

    mode = CHANNEL_MODES.get(channels)
    if mode is None:
        raise FolderError(path, f"the model takes {channels} channels; image files give 1 (grey) or 3 (RGB)")
    try:
        with Image.open(path) as img:
            img.load()
            return img.convert(mode)
    except UnidentifiedImageError:
        raise FolderError(path, "not an image Pillow can decode") from None
    except (OSError, ValueError, SyntaxError) as exc:  # truncated or corrupt data, unreadable file
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise FolderError(path, f"cannot decode it: {why}") from None


def read_captions(root: str) -> list[Pair]:
    """Every line of ``root/captions.jsonl`` (`Pair.media`: the image file); MediaError (E0479) for
    a missing or malformed folder, file, line or field, or an image that is not a regular file."""
    return read_pairs(root, CAPTIONS, "image", CAPTIONS_CODE, "image")


def open_captioned(pair: Pair, channels: int) -> Any:
    """`open_image` of a caption's image; MediaError (E0479) naming the index line where Pillow
    cannot read it."""
    try:
        return open_image(pair.media, channels)
    except FolderError as exc:
        raise MediaError(exc.path, f"{exc.why} (line {pair.line} of {CAPTIONS})", code=CAPTIONS_CODE) from None
