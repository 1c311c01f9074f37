"""check of an image folder (`image_folder(...)`, E0450 to E0453): its class sub-folders against
the model's labels, their image files, a bounded sample of them decoded, and the processor
directory. The folder's layout is `ppdsl.core.image_folder`'s, the one the ranks read.

An image-text folder (`image_text_folder(...)`, E0479): its captions.jsonl line by line, every
image it names present and inside the folder, a bounded sample decoded, and the processor
directory as for an image folder. The tokenizer is checked by `data_check` as for every source.

A mixin of `data_check`'s checker: it reads `opts`, `labels`, `roots`, `spec`, and reports through
`err`, `unreadable`, `too_little`, `global_batch`, `_exists` and `_folder`.

Whether the model takes images at all is known from the traced model (dsl/input_check.py, E0418).
"""

from __future__ import annotations

import json
import os

from ppdsl.core.image_folder import (CAPTIONS, IMAGE_EXTENSIONS, FolderError, class_names, class_root, image_files,
                                     open_captioned, open_image, read_captions)
from ppdsl.core.media_pairs import MediaError
from ppdsl.core.locate import outside

from .data_quote import show
from .resolve.located import missing_error, outside_error

SAMPLE_IMAGES = 32  # images decoded at check time, taken in turn from each class
SAMPLE_CAPTIONS = 4096  # captions tokenized at check time (image_text_folder)
PROCESSOR_FILE = "preprocessor_config.json"  # = runtime.data.images.PROCESSOR_FILE
MAX_PROCESSOR_JSON = 1 << 20


class ImageChecks:
    def _image_folder(self, path: str) -> None:
        if "processor" in self.opts and self.opts["processor"] is not None:
            self._processor(self.opts["processor"])
        if not self._folder(path, "image folder", "one sub-folder of images per class"):
            return
        split = self.opts.get("split")
        root = class_root(path, split)
        if not os.path.isdir(root):
            self.out.append(missing_error(self.span("split"), f"image folder '{show(path)}' has no sub-folder '{split}'",
                                          hint="leave split out to read the folder itself (or its train/ sub-folder)"))
            return
        try:
            classes = class_names(root)
        except FolderError as exc:
            self.unreadable("path", f"cannot read image folder '{show(root)}': {exc.why}")
            return
        if not classes:
            self.err("E0450", "path", f"image folder '{show(root)}' holds no class sub-folders",
                     hint="one sub-folder per class, each holding that class's images: "
                          f"{show(root)}/cat/1.png, {show(root)}/dog/1.png, ...")
            return
        if self.labels is not None and len(classes) != self.labels:
            self.err("E0451", "path", f"image folder '{show(root)}' has {len(classes)} class sub-folders "
                     f"({_listed(classes)}), but the model has {self.labels} labels (num_labels)",
                     label=f"{len(classes)} classes",
                     hint=f"set num_labels = {len(classes)} in the model's config, or give one sub-folder per label")
        files = [image_files(os.path.join(root, c)) for c in classes]
        empty = [c for c, f in zip(classes, files) if not f]
        if empty:
            self.err("E0450", "path", f"class sub-folder '{empty[0]}' of '{show(root)}' holds no image files"
                     + (f" (nor do {len(empty) - 1} more)" if len(empty) > 1 else ""),
                     hint=f"each class needs images: files ending in {', '.join(IMAGE_EXTENSIONS[:4])}, ...")
            return
        count = sum(len(f) for f in files)
        gb = self.global_batch()
        if gb is not None and count < gb:
            what = "global_batch" if self.batches == 1 else "eval.batches * global_batch"
            self.too_little(f"image folder '{show(root)}' holds {count} images, fewer than {self.needed()} "
                            f"({what} = {gb})", hint="use more images or a smaller global_batch")
        self._decode(root, files, count)

    def _image_text_folder(self, path: str) -> None:
        if self.opts.get("processor") is not None:
            self._processor(self.opts["processor"])
        if not self._folder(path, "image-text folder", f"{CAPTIONS} and the images it names"):
            return
        try:
            pairs = read_captions(path)
            if self.roots is not None:
                stray = next((p for p in pairs if outside(p.media, (path,))), None)
                if stray is not None:
                    self.out.append(outside_error(self.span("path"), f"'{show(stray.media)}' (line {stray.line} of "
                                                  f"{CAPTIONS})", "the image-text folder"))
                    return
            gb = self.global_batch()
            if gb is not None and len(pairs) < gb:
                what = "global_batch" if self.batches == 1 else "eval.batches * global_batch"
                self.too_little(f"image-text folder '{show(path)}' holds {len(pairs)} captioned images, fewer than "
                                f"{self.needed()} ({what} = {gb})",
                                hint=f"add lines to {CAPTIONS}, or use a smaller global_batch")
            for pair in pairs[:SAMPLE_IMAGES]:
                open_captioned(pair, 3)
            self._caption_ids(path, pairs)
        except MediaError as exc:
            where = show(exc.path) + ("" if exc.line is None else f", line {exc.line}")
            self.err(exc.code, "path", f"image-text folder: {where}: {exc.why}",
                     hint=f'each line of {CAPTIONS}: {{"image": "img/a.png", "text": "the caption"}}, the image '
                          "relative to the folder, a PNG or JPEG Pillow decodes")
        except ImportError:
            self.err("E0452", "path", f"reading the images of '{show(path)}' needs Pillow, which is not installed",
                     hint='pip install "ppdsl[data]" (or pillow)')

    def _caption_ids(self, path: str, pairs: list) -> None:
        """E0479 where the tokenizer pads with the model's image token, or tokenizes one of the
        first `SAMPLE_CAPTIONS` captions into it: the forward would take the id for an image's
        place (the ranks check every caption again when they first read them)."""
        config = self.spec.model.resolved_config or self.spec.model.config
        token = next((config.get(k) for k in ("image_token_id", "image_token_index") if isinstance(config.get(k), int)),
                     None)
        if token is None or self.tokenizer_doc is None:
            return
        try:
            from tokenizers import Tokenizer
        except ImportError:  # checked again when the ranks read the captions
            return

        from ppdsl.core.special_tokens import COMMON_PAD

        tokenizer = Tokenizer.from_str(json.dumps(self.tokenizer_doc))
        pad = next((i for i in map(tokenizer.token_to_id, COMMON_PAD) if i is not None), 0)
        hint = "set image_token_id to an id the tokenizer does not give (or train the tokenizer without it)"
        if pad == token:
            self.err("E0479", "tokenizer", f"the tokenizer pads with id {pad}, the model's image_token_id: the "
                     "padding after a short caption would be taken for an image's place", hint=hint)
            return
        sample = pairs[:SAMPLE_CAPTIONS]
        for pair, encoding in zip(sample, tokenizer.encode_batch([p.text for p in sample], add_special_tokens=True)):
            if token in encoding.ids:
                self.err("E0479", "path", f"image-text folder: {show(os.path.join(path, CAPTIONS))}, line {pair.line}: "
                         f"the caption tokenizes to id {token}, the model's image_token_id (its text would be "
                         "taken for an image's place)", hint=hint)
                return

    def _decode(self, root: str, files: list[list[str]], count: int) -> None:
        """E0452 for the first file of a bounded sample (in turn from each class) Pillow cannot decode."""
        sample = [f[i] for i in range(max(len(f) for f in files)) for f in files if i < len(f)][:SAMPLE_IMAGES]
        try:
            import PIL  # noqa: F401
        except ImportError:
            self.err("E0452", "path", f"reading the images of '{show(root)}' needs Pillow, which is not installed",
                     hint='pip install "ppdsl[data]" (or pillow)')
            return
        for f in sample:
            if self.roots is not None and outside(f, (root,)):
                self.out.append(outside_error(self.span("path"), f"'{show(f)}'", "the image folder"))
                return
            try:
                open_image(f, 3)
            except FolderError as exc:
                checked = "" if len(sample) == count else f" (check decoded {len(sample)} of its {count} images)"
                self.err("E0452", "path", f"'{show(f)}' in image folder '{show(root)}': {exc.why}{checked}",
                         label="not an image", hint="remove the file or replace it with a PNG or JPEG image")
                return

    def _processor(self, path: str) -> None:
        if not self._exists(path, "processor", f"image processor directory '{show(path)}'",
                            "a directory saved by image_processor.save_pretrained(), holding preprocessor_config.json"
                            "; relative paths are relative to the spec's directory"):
            return
        if not os.path.isdir(path):
            self.unreadable("processor", f"image processor '{show(path)}' is not a directory",
                            hint=f"name the directory that holds {PROCESSOR_FILE}, not the file")
            return
        pj = os.path.join(path, PROCESSOR_FILE)
        if self.roots is not None and outside(pj, (path,)):
            self.out.append(outside_error(self.span("processor"), f"'{show(pj)}'", "the image processor directory"))
            return
        hint = "save it with image_processor.save_pretrained(dir) (transformers), or leave processor out"
        if not os.path.isfile(pj):
            self.err("E0453", "processor", f"'{show(path)}' holds no {PROCESSOR_FILE}", hint=hint)
            return
        try:
            if os.path.getsize(pj) > MAX_PROCESSOR_JSON:
                raise ValueError(f"larger than {MAX_PROCESSOR_JSON} bytes")
            with open(pj, "rb") as f:
                doc = json.loads(f.read())
        except (OSError, ValueError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            self.err("E0453", "processor", f"cannot read '{show(pj)}': {why}", hint=hint)
            return
        if not isinstance(doc, dict):
            self.err("E0453", "processor", f"'{show(pj)}' is not a JSON object", hint=hint)
            return
        made, model = _processed_size(doc), self._model_image()
        if made is not None and model is not None and made != model:
            self.err("E0453", "processor", f"the image processor in '{show(path)}' makes images of "
                     f"{made[0]} x {made[1]}, but the model takes {model[0]} x {model[1]} (image_size)",
                     label=f"{made[0]} x {made[1]}",
                     hint=f"set its size (and crop_size, where it crops) to {{\"height\": {model[0]}, \"width\": "
                          f"{model[1]}}}, or leave processor out: the model's default processor at its image size")

    def _model_image(self) -> tuple[int, int] | None:
        """(H, W) of the model's images, where the config check knows says."""
        from ppdsl.core.model_inputs import pixel_shape

        try:
            return pixel_shape(self.spec.model.resolved_config or self.spec.model.config)[1:]
        except ValueError:
            return None


def _processed_size(doc: dict) -> tuple[int, int] | None:
    """(H, W) of what a saved processor makes: its crop where it crops, else its resize to a fixed
    height and width; None where that depends on the image (a shortest edge)."""
    def pair(v: object) -> tuple[int, int] | None:
        if isinstance(v, dict) and isinstance(v.get("height"), int) and isinstance(v.get("width"), int):
            return v["height"], v["width"]
        return None

    if doc.get("do_center_crop") and pair(doc.get("crop_size")) is not None:
        return pair(doc.get("crop_size"))
    return pair(doc.get("size")) if doc.get("do_resize", True) else None


def _listed(names: list[str], most: int = 6) -> str:
    shown = ", ".join(names[:most])
    return shown if len(names) <= most else f"{shown}, ... ({len(names) - most} more)"
