"""``image_folder(path, processor, split, seed)``: labelled images from a folder of class
sub-folders (`ppdsl.core.image_folder`), decoded with Pillow one batch at a time (never all held
in memory) and turned into the model's ``pixel_values`` by an HF image processor.

The processor: ``processor = "dir"`` loads the ``preprocessor_config.json`` of a local directory
(AutoImageProcessor, local files only, its Pillow backend). Left out, an ``hf_pretrained``
directory's own ``preprocessor_config.json``; else the processor class AutoImageProcessor picks
for the model's config class, built with its defaults but the model's image size (``size`` and,
where the class crops, ``crop_size``). A model with no such class (a python factory, or one
channel) gets a plain resize to the image size, a rescale to [0, 1] and a normalisation with mean
and std 0.5 (ViT's default processor does the same).

Order: the files are indexed once (paths and labels only), and global sample position ``g``
takes file ``perm_e[g % n]`` exactly as the other file sources (`runtime.data.order._Order`), so
``ppdsl verify``'s reference and a resumed run read the same images. A file that cannot be
decoded raises a ValueError naming it (exit 2).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ppdsl.core.image_folder import FolderError, class_names, class_root, image_files, open_image
from ppdsl.lowering.plan import ModelRef
from ppdsl.runtime.data.batch import EVERYTHING, Batch, DataSource, Needs, Task
from ppdsl.runtime.data.order import _Order

__all__ = ["ImageData", "image_processor"]

PROCESSOR_FILE = "preprocessor_config.json"
PLAIN_MEAN = PLAIN_STD = 0.5


@dataclass
class ImageData(DataSource):
    """Images of class sub-folders, labelled by the sorted position of their folder."""

    path: str
    split: str | None
    processor: str | None
    model: ModelRef
    image: tuple[int, ...]  # (C, H, W) the model takes
    num_labels: int
    seed: int
    seq_len: int  # the positions the blocks see (the token placeholder's length)
    batch_size: int
    microbatch_size: int
    dp: int
    needs: Needs = EVERYTHING
    task: Task = "classification"
    _files: Any = field(default=None, repr=False)
    _order: Any = field(default=None, repr=False)
    _process: Any = field(default=None, repr=False)

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.dp

    def files(self) -> list[tuple[str, int]]:
        """(path, label) of every image, indexed on first use; ValueError for a folder check would refuse."""
        if self._files is None:
            root = class_root(self.path, self.split)
            if not os.path.isdir(root):
                raise ValueError(f"image folder {root} does not exist or is not a folder")
            classes = class_names(root)
            if len(classes) != self.num_labels:
                raise ValueError(f"image folder {root} has {len(classes)} class sub-folders, the model "
                                 f"{self.num_labels} labels (num_labels)")
            rows = [(f, label) for label, c in enumerate(classes) for f in image_files(os.path.join(root, c))]
            if len(rows) < self.global_batch:
                raise ValueError(f"image folder {root} holds {len(rows)} images, fewer than one global batch "
                                 f"(global_batch = {self.global_batch})")
            self._files = rows
            self._order = _Order(len(rows), self.seed)
        return self._files

    def count(self) -> int:
        return len(self.files())

    def batch(self, step: int, dp_rank: int, device: torch.device | str = "cpu") -> Batch:
        self.files()
        start = step * self.global_batch + dp_rank * self.batch_size
        _, labels, _, _, pixels = self.read(self._order.items(range(start, start + self.batch_size)))
        return self._assemble(None, labels, None, device, pixels)

    def read(self, items: list[int]) -> tuple[None, torch.Tensor, None, None, torch.Tensor]:
        """Images `items`: no token ids, their labels, no mask, no positions, their pixel values
        (decoded only where the stages take the inputs; zeros of their shape elsewhere)."""
        picked = [self.files()[i] for i in items]
        labels = torch.tensor([label for _, label in picked], dtype=torch.long)
        if not self.needs.inputs:  # labels only: no image is decoded
            return None, labels, None, None, torch.zeros(()).expand(len(picked), *self.image)
        if self._process is None:
            self._process = image_processor(self.processor, self.model, self.image)
        try:
            pixels = self._process([open_image(p, self.image[0]) for p, _ in picked])
        except FolderError as exc:
            raise ValueError(f"image folder {self.path}: image {exc.path}: {exc.why}") from None
        return None, labels, None, None, pixels


def image_processor(directory: str | None, model: ModelRef, image: tuple[int, ...]) -> Callable[[list[Any]], torch.Tensor]:
    """images (PIL) -> float32 ``(n, C, H, W)`` as the module docstring says. ValueError where the
    processor cannot be loaded, or gives images of another shape than the model takes."""
    if directory is None and model.kind == "hf_pretrained" and os.path.isfile(os.path.join(model.target, PROCESSOR_FILE)):
        directory = model.target
    hf = _load(directory) if directory is not None else _default(model, image)
    where = f"the image processor of {directory}" if directory is not None else "the default image processor"

    def process(images: list[Any]) -> torch.Tensor:
        if hf is None:
            pixels = _plain(images, image)
        else:
            pixels = torch.as_tensor(hf(images=images, return_tensors="pt")["pixel_values"]).float()
        if tuple(pixels.shape[1:]) != tuple(image):
            raise ValueError(f"{where} gives images of {' x '.join(map(str, pixels.shape[1:]))}; the model takes "
                             f"{' x '.join(map(str, image))} (num_channels x image_size): set the processor's size "
                             "to the model's image_size, or leave processor out")
        return pixels

    return process


def _backend() -> dict[str, Any]:
    """Pillow processors, without torchvision: `backend` in transformers 5, `use_fast` in 4."""
    from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING_NAMES

    dict_entries = any(isinstance(v, dict) for v in IMAGE_PROCESSOR_MAPPING_NAMES.values())
    return {"backend": "pil"} if dict_entries else {"use_fast": False}


def _load(directory: str) -> Any:
    from transformers import AutoImageProcessor

    if not os.path.isfile(os.path.join(directory, PROCESSOR_FILE)):
        raise ValueError(f"image processor directory {directory} holds no {PROCESSOR_FILE}")
    try:
        return AutoImageProcessor.from_pretrained(directory, local_files_only=True, **_backend())
    except Exception as exc:  # noqa: BLE001 - any failure to load is the user's file: say which
        raise ValueError(f"cannot load the image processor in {directory}: {type(exc).__name__}: {exc}") from None


def _default(model: ModelRef, image: tuple[int, ...]) -> Any:
    """The processor class AutoImageProcessor picks for the model's config class, at the model's
    image size; None where there is none (or the images have one channel)."""
    cls = _processor_class(model)
    if cls is None or image[0] != 3:
        return None
    size = {"height": image[1], "width": image[2]}
    processor = cls(size=size)
    if getattr(processor, "crop_size", None) is not None:
        processor = cls(size=size, crop_size=size)
    return processor


def _processor_class(model: ModelRef) -> type | None:
    """The Pillow-backed class AutoImageProcessor maps the model's type to (by name: looking the
    class up by config class would warn about torchvision)."""
    from transformers.models.auto.image_processing_auto import (
        IMAGE_PROCESSOR_MAPPING_NAMES,
        get_image_processor_class_from_name,
    )

    names = IMAGE_PROCESSOR_MAPPING_NAMES.get(_model_type(model) or "")
    if isinstance(names, dict):  # transformers 5: backend -> class name
        name = names.get("pil")
    elif isinstance(names, (tuple, list)):  # transformers 4: (slow, fast)
        name = names[0] or names[1]
    else:
        name = names
    return get_image_processor_class_from_name(name) if name else None


def _model_type(model: ModelRef) -> str | None:
    if model.kind == "hf":
        import transformers

        config_class = getattr(getattr(transformers, model.target, None), "config_class", None)
        return getattr(config_class, "model_type", None)
    if model.kind == "hf_pretrained":
        try:
            with open(os.path.join(model.target, "config.json"), encoding="utf-8") as f:
                found = json.load(f).get("model_type")
            return found if isinstance(found, str) else None
        except (OSError, ValueError, AttributeError):
            return None
    return None


def _plain(images: list[Any], image: tuple[int, ...]) -> torch.Tensor:
    """Resize (bilinear) to H x W, rescale to [0, 1], normalise with mean and std 0.5."""
    import numpy as np
    from PIL import Image

    c, h, w = image
    arrays = [np.asarray(im.resize((w, h), Image.Resampling.BILINEAR), dtype=np.float32).reshape(h, w, c)
              for im in images]
    pixels = torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2) / 255.0
    return ((pixels - PLAIN_MEAN) / PLAIN_STD).contiguous()
