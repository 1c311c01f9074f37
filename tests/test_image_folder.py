"""`image_folder(path, processor, split, seed)` (issue 32, item 4 for images): labelled images
from a folder of class sub-folders, decoded with Pillow per batch and made `pixel_values` by the
model's HF image processor, in the file sources' order; check's diagnostics of bad folders
(E0410, E0436, E0450 to E0453) at line and column; a run that meets an undecodable image past
check's sample stops with exit status 2 naming it; pp 2 equals one process.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("PIL")

import torch  # noqa: E402
from PIL import Image  # noqa: E402

from _exec_harness import equivalence_worker  # noqa: E402
from _run_helpers import run_cmd  # noqa: E402
from dist_harness import run_distributed  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SHAPES = ROOT / "specs" / "data" / "shapes"
CLASSES = ["checker", "horizontal", "vertical"]
VIT = ("num_hidden_layers = 2, hidden_size = 32, num_attention_heads = 4, intermediate_size = 64, "
       "image_size = 32, patch_size = 8, num_channels = 3")


def _spec(data: str, labels: int = 3, pp: int = 2, batch: int = 4, steps: int = 2, cls: str = "ViTForImageClassification",
          config: str = VIT, extra: str = "") -> str:
    return f"""ppspec 1
model m {{
  source = hf("{cls}")
  config {{ {config}, num_labels = {labels} }}
}}
mesh {{ pp = {pp} }}
pipeline {{ style = 1f1b, microbatches = 2 }}
train {{
  global_batch = {batch}
  steps = {steps}{extra}
  data = {data}
}}
"""


def _check(tmp_path: Path, text: str, model: bool = False, world: int | None = 2) -> Any:
    from ppdsl.dsl.check import check_file

    path = tmp_path / "spec.ppspec"
    path.write_text(text, encoding="utf-8")
    return check_file(path, world=world, model=model)


def _plan(tmp_path: Path, text: str, world: int = 2) -> Any:
    from ppdsl.lowering.lower import lower

    r = _check(tmp_path, text, model=True, world=world)
    assert r.ok, [f"{d.code} {d.message}" for d in r.diagnostics]
    return lower(r.spec, world, r.model_info)


def _folder(root: Path, counts: dict[str, int], size: int = 8) -> Path:
    for k, (name, n) in enumerate(counts.items()):
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            Image.new("RGB", (size, size), (40 * k, 255 - 40 * k, 10 * i % 256)).save(root / name / f"{i:03d}.png")
    return root


def _errors(r: Any) -> list[tuple[str, str, int, int]]:
    return [(d.code, d.message, d.span.line, d.span.column) for d in r.diagnostics if d.is_error]


# ---- the source --------------------------------------------------------------------------------


def test_labels_are_the_sorted_class_folders_and_pixels_the_processors(tmp_path: Path) -> None:
    from transformers.models.vit.image_processing_pil_vit import ViTImageProcessorPil

    from ppdsl.runtime.data.source import make_data

    plan = _plan(tmp_path, _spec(f'image_folder("{SHAPES}")'))
    data = make_data(plan)
    files = data.files()
    assert len(files) == 3 * 24  # train/ is taken when split is left out
    assert all(Path(p).parent.name == CLASSES[label] and Path(p).parts[-3] == "train" for p, label in files)
    batch = data.batch(0, 0)
    assert batch.pixel_values.shape == (4, 3, 32, 32) and batch.pixel_values.dtype == torch.float32
    assert batch.labels.shape == (4,) and batch.labels.dtype == torch.long
    # the same images as the file sources' order picks, through ViT's own processor at the model's size
    from ppdsl.runtime.data.order import _Order

    picked = [files[i] for i in _Order(len(files), 0).items(range(4))]
    assert batch.labels.tolist() == [label for _, label in picked]
    hf = ViTImageProcessorPil(size={"height": 32, "width": 32})
    expected = hf(images=[Image.open(p).convert("RGB") for p, _ in picked], return_tensors="pt")["pixel_values"]
    assert torch.allclose(batch.pixel_values, expected)
    assert [mb.pixel_values.shape[0] for mb in data.microbatches(0, 0)] == [2, 2]
    # the validation split by name
    plan = _plan(tmp_path, _spec(f'image_folder("{SHAPES}", split = "validation")'))
    assert len(make_data(plan).files()) == 3 * 8


def test_the_order_is_a_function_of_seed_step_and_replica(tmp_path: Path) -> None:
    from ppdsl.runtime.data.source import make_data

    plan = _plan(tmp_path, _spec(f'image_folder("{SHAPES}", seed = 3)', batch=8))
    a, b = make_data(plan), make_data(plan)
    for step in (0, 5, 9):  # 9: the second epoch (72 images, 8 a step)
        x, y = a.batch(step, 0), b.batch(step, 0)
        assert torch.equal(x.pixel_values, y.pixel_values) and torch.equal(x.labels, y.labels)
    assert not torch.equal(a.batch(0, 0).pixel_values, a.batch(1, 0).pixel_values)
    # an epoch reads every image once
    seen = [p for step in range(9) for p, _ in (a.files()[i] for i in a._order.items(range(step * 8, step * 8 + 8)))]
    assert sorted(seen) == sorted(p for p, _ in a.files())
    # two replicas read the two halves of one replica's batch; another seed reads others
    from dataclasses import replace

    half = replace(a, batch_size=4, microbatch_size=2, dp=2, _files=None, _order=None, _process=None)
    whole = a.batch(2, 0)
    parts = [half.batch(2, r) for r in (0, 1)]
    assert torch.equal(torch.cat([p.pixel_values for p in parts]), whole.pixel_values)
    other = replace(a, seed=4, _files=None, _order=None, _process=None)
    assert not torch.equal(other.batch(0, 0).labels, a.batch(0, 0).labels) or \
        not torch.equal(other.batch(0, 0).pixel_values, a.batch(0, 0).pixel_values)


def test_held_out_images_are_evaluated_and_never_trained_on(tmp_path: Path) -> None:
    from ppdsl.runtime.data.source import make_data

    text = _spec(f'image_folder("{SHAPES}")', extra="\n  eval { data = holdout(0.25) }")
    plan = _plan(tmp_path, text)
    train, held = make_data(plan), make_data(plan, data=plan.train.eval.data)
    train._ready()
    batch = held.batch(0, 0)
    assert batch.pixel_values.shape == (4, 3, 32, 32) and batch.labels.shape == (4,)
    n = train.parts[0].count()
    trained, evaluated = set(train._orders[0](range(2 * n))), set(held._orders[0](range(n)))
    assert len(evaluated) == n // 4 and not trained & evaluated and len(trained | evaluated) == n
    # the rows are the held-out files, decoded as the part reads them
    files = train.parts[0].files()
    picked = [held._orders[0]([k])[0] for _, k in held.positions(0, 0)]
    assert batch.labels.tolist() == [files[i][1] for i in picked]
    # images cannot be mixed, and synthetic images cannot be held out
    r = _check(tmp_path, _spec(f'mix(image_folder("{SHAPES}"), image_folder("{SHAPES}"))'), model=True)
    assert "E0454" in [d.code for d in r.diagnostics]
    r = _check(tmp_path, _spec("synthetic(seed = 1)", extra="\n  eval { data = holdout(0.25) }"), model=True)
    assert [d.code for d in r.diagnostics if d.is_error] == ["E0456"]


def test_a_processor_directory_is_used_and_its_shape_checked(tmp_path: Path) -> None:
    from transformers.models.vit.image_processing_pil_vit import ViTImageProcessorPil

    from ppdsl.runtime.data.source import make_data

    folder = _folder(tmp_path / "imgs", {"a": 2, "b": 2, "c": 2}, size=20)
    proc = tmp_path / "proc"
    ViTImageProcessorPil(size={"height": 32, "width": 32}, image_mean=[0, 0, 0], image_std=[1, 1, 1]).save_pretrained(proc)
    plan = _plan(tmp_path, _spec(f'image_folder("{folder}", processor = "{proc}")'))
    pixels = make_data(plan).batch(0, 0).pixel_values
    assert pixels.shape == (4, 3, 32, 32) and pixels.min() >= 0  # mean 0, std 1: only rescaled to [0, 1]
    cfg = json.loads((proc / "preprocessor_config.json").read_text())
    (proc / "preprocessor_config.json").write_text(json.dumps({**cfg, "size": {"height": 16, "width": 16}}))
    with pytest.raises(ValueError, match=r"gives images of 3 x 16 x 16; the model takes 3 x 32 x 32"):
        make_data(plan).batch(0, 0)


def test_a_pretrained_directory_brings_its_processor(tmp_path: Path) -> None:
    from transformers import ViTConfig, ViTForImageClassification
    from transformers.models.vit.image_processing_pil_vit import ViTImageProcessorPil

    from ppdsl.runtime.data.source import make_data

    pretrained = tmp_path / "vit"
    ViTForImageClassification(ViTConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64,
                                        image_size=32, patch_size=8, num_labels=3)).save_pretrained(pretrained)
    ViTImageProcessorPil(size={"height": 32, "width": 32}, image_mean=[0, 0, 0], image_std=[1, 1, 1]).save_pretrained(pretrained)
    text = _spec(f'image_folder("{SHAPES}")').replace('hf("ViTForImageClassification")', f'hf_pretrained("{pretrained}")')
    text = text.replace(f"config {{ {VIT}, num_labels = 3 }}", "")
    pixels = make_data(_plan(tmp_path, text)).batch(0, 0).pixel_values
    assert pixels.shape == (4, 3, 32, 32) and pixels.min() >= 0  # its processor's mean 0, std 1, not ViT's 0.5


def test_the_default_processor_is_the_model_types_at_its_image_size() -> None:
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    from ppdsl.lowering.plan import ModelRef
    from ppdsl.runtime.data.images import image_processor

    images = [Image.new("RGB", (50, 30), (200, 10, 10)), Image.new("RGB", (20, 70), (10, 10, 200))]
    clip = image_processor(None, ModelRef("hf", "CLIPForImageClassification", (), "own"), (3, 24, 40))
    size = {"height": 24, "width": 40}  # CLIP crops: its crop_size too
    expected = CLIPImageProcessorPil(size=size, crop_size=size)(images=images, return_tensors="pt")["pixel_values"]
    assert torch.equal(clip(images), expected) and expected.shape == (2, 3, 24, 40)
    plain = image_processor(None, ModelRef("python", "pkg.mod:build", (), "generic"), (1, 16, 16))
    grey = plain([im.convert("L") for im in images])
    assert grey.shape == (2, 1, 16, 16) and -1 <= float(grey.min()) and float(grey.max()) <= 1


def test_a_checkpoint_knows_the_folder_and_a_resume_warns_when_it_changed(tmp_path: Path) -> None:
    from ppdsl.runtime.data.identity import changed_data_files, data_file_identities

    folder = _folder(tmp_path / "imgs", {"a": 2, "b": 2, "c": 2})
    plan = _plan(tmp_path, _spec(f'image_folder("{folder}")'))
    saved = data_file_identities(plan)
    assert saved == {str(folder): {"size": saved[str(folder)]["size"], "files": 6,
                                   "sha256_listing": saved[str(folder)]["sha256_listing"]}}
    assert changed_data_files(saved, "ckpt") == []
    (folder / ".hidden").mkdir()
    (folder / ".hidden" / "x.png").write_bytes(b"not read")  # hidden: not data, not a change
    assert changed_data_files(saved, "ckpt") == []
    _folder(folder, {"b": 3})  # one more image in class b
    (warning,) = changed_data_files(saved, "ckpt")
    assert str(folder) in warning and "changed since the run of checkpoint ckpt" in warning


# ---- check -------------------------------------------------------------------------------------


def test_check_accepts_the_shipped_folder_with_and_without_the_model(tmp_path: Path) -> None:
    from ppdsl.dsl.check import check_file

    assert check_file(ROOT / "specs" / "vit_images.ppspec", model=False).ok  # --no-model: inside the spec's folder
    r = _check(tmp_path, _spec(f'image_folder("{SHAPES}", split = "validation")'), model=True)
    assert r.ok, _errors(r)


@pytest.mark.parametrize("case, code, words", [
    ("missing", "E0410", "image folder"),
    ("a_file", "E0411", "is not a folder"),
    ("no_classes", "E0450", "holds no class sub-folders"),
    ("empty_class", "E0450", "class sub-folder 'b'"),
    ("two_classes", "E0451", "has 2 class sub-folders (a, b), but the model has 3 labels"),
    ("broken", "E0452", "b/001.png"),
    ("too_few", "E0414", "holds 3 images, fewer than one global batch"),
    ("no_split", "E0410", "has no sub-folder 'test'"),
    ("processor", "E0453", "holds no preprocessor_config.json"),
    ("processor_size", "E0453", "makes images of 16 x 24, but the model takes 32 x 32 (image_size)"),
])
def test_bad_folders_are_diagnostics_at_the_data_call(tmp_path: Path, case: str, code: str, words: str) -> None:
    root = tmp_path / "imgs"
    option, split, processor = '"imgs"', "", ""
    if case == "a_file":
        root.write_text("not a folder")
    elif case == "no_classes":
        root.mkdir()
        (root / "README").write_text("no classes here")
    elif case == "empty_class":
        _folder(root, {"a": 2, "c": 2})
        (root / "b").mkdir()
        (root / "b" / "notes.txt").write_text("not an image file")
    elif case == "two_classes":
        _folder(root, {"a": 2, "b": 2})
    elif case == "broken":
        _folder(root, {"a": 2, "b": 2, "c": 2})
        (root / "b" / "001.png").write_bytes(b"\x89PNG\r\n\x1a\n then nothing a decoder can read")
    elif case == "too_few":
        _folder(root, {"a": 1, "b": 1, "c": 1})
    elif case in ("no_split", "processor", "processor_size"):
        _folder(root, {"a": 2, "b": 2, "c": 2})
        if case == "no_split":
            split = ', split = "test"'
        else:
            (tmp_path / "proc").mkdir()
            processor = ', processor = "proc"'
        if case == "processor_size":
            from transformers.models.vit.image_processing_pil_vit import ViTImageProcessorPil

            ViTImageProcessorPil(size={"height": 16, "width": 24}).save_pretrained(tmp_path / "proc")
    data = f"image_folder({option}{split}{processor})"
    r = _check(tmp_path, _spec(data))
    found = _errors(r)
    assert [c for c, *_ in found] == [code], found
    _, message, line, column = found[0]
    assert words in message
    text = _spec(data).splitlines()[line - 1]
    assert line == 11 and column > text.index("image_folder(")  # at the option (path, split or processor)


def test_image_data_on_a_token_model_or_of_other_channels_is_E0436(tmp_path: Path) -> None:
    bert = "num_hidden_layers = 2, hidden_size = 32, num_attention_heads = 2, intermediate_size = 64"
    r = _check(tmp_path, _spec(f'image_folder("{SHAPES}")', labels=3, pp=1, cls="BertForSequenceClassification",
                               config=bert, extra="\n  seq_len = 16"), model=True, world=1)
    assert [(c, line) for c, _, line, _ in _errors(r)] == [("E0436", 12)]
    assert "takes token ids" in _errors(r)[0][1]
    # and images of channels that image files do not have
    r = _check(tmp_path, _spec(f'image_folder("{SHAPES}")', config=VIT.replace("num_channels = 3", "num_channels = 4")),
               model=True)
    assert [(c, line) for c, _, line, _ in _errors(r)] == [("E0436", 11)]
    assert "image files give 1 (grey) or 3 (RGB) channels, not 4" in _errors(r)[0][1]


# ---- run ---------------------------------------------------------------------------------------


def test_an_undecodable_image_past_the_sample_stops_the_run_with_exit_2(tmp_path: Path) -> None:
    from ppdsl.dsl.data_check_images import SAMPLE_IMAGES

    per_class = SAMPLE_IMAGES  # each class's later half lies past check's sample
    root = _folder(tmp_path / "imgs", {"a": per_class, "b": per_class, "c": per_class})
    bad = root / "c" / f"{per_class - 1:03d}.png"
    bad.write_bytes(b"GIF89a but truncated")
    spec = tmp_path / "spec.ppspec"
    spec.write_text(_spec('image_folder("imgs")', pp=1, batch=16, steps=6).replace(
        "pipeline { style = 1f1b, microbatches = 2 }", "pipeline { microbatches = 1 }"), encoding="utf-8")
    assert _check(tmp_path, spec.read_text(), world=1).ok
    proc, _ = run_cmd(["run", str(spec), "--nproc", "1", "--out", str(tmp_path / "run")], timeout=240)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert str(bad) in proc.stderr and "Traceback" not in proc.stderr


def test_matches_one_process_at_pp2(tmp_path: Path) -> None:
    plan = _plan(tmp_path, _spec(f'image_folder("{SHAPES}")'))
    # and training on the images a holdout keeps (the last stage reads labels only)
    kept = _plan(tmp_path, _spec(f'image_folder("{SHAPES}")', extra="\n  eval { data = holdout(0.25) }"))
    for report, _seconds in run_distributed(equivalence_worker, 2, [plan, kept], timeout=120)[0]:
        assert report.ok, report.render()
        assert max(abs(a - b) for a, b in report.losses) <= 1e-6, report.losses
