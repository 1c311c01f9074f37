"""Models fed images (issue 32, items 2 to 4 for images): a tiny ViTForImageClassification.

Its input kind is decided by its forward's parameters (`ppdsl.core.model_inputs`: `pixel_values`,
no `input_ids`); check's trace measures the positions its blocks see (32 x 32 images in patches
of 8: 16 patches + CLS = 17), which the plan carries as the activation length, so the spec has
no `seq_len` (writing one is E0435; a token model without one is still E0102). The task is image
classification with HF's loss rules; synthetic images are a fixed pattern per class plus noise.
One gloo world of 2 (pp 2) trains two steps against the single-process reference.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from _exec_harness import equivalence_worker  # noqa: E402
from dist_harness import run_distributed  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
VIT = dict(num_hidden_layers=4, hidden_size=32, num_attention_heads=4, intermediate_size=64, image_size=32,
           patch_size=8, num_channels=3, num_labels=4)


def _spec(config: dict[str, Any] = VIT, train: str = "", mesh: str = "pp = 2", cls: str = "ViTForImageClassification") -> str:
    values = ", ".join(f"{k} = {v}" for k, v in config.items())
    return f"""ppspec 1
model m {{
  source = hf("{cls}")
  config {{ {values} }}
}}
mesh {{ {mesh} }}
pipeline {{ style = 1f1b, microbatches = 2 }}
train {{ global_batch = 4, steps = 2, optimizer = adamw(lr = 1e-3), data = synthetic(seed = 0){train} }}
"""


from _spec_text import check_text as _check, plan_text as _plan  # noqa: E402


def test_the_input_kind_is_the_forwards() -> None:
    from ppdsl.core.model_inputs import input_kind, pixel_shape

    assert input_kind(("input_ids", "attention_mask")) == "tokens"
    assert input_kind(("pixel_values", "labels")) == "pixels"
    assert input_kind(("input_features",)) is None
    assert pixel_shape({"image_size": 32}) == (3, 32, 32)
    assert pixel_shape({"image_size": [24, 32], "num_channels": 1}) == (1, 24, 32)
    assert pixel_shape({"vision_config": {"image_size": 32, "num_channels": 3}}) == (3, 32, 32)  # CLIP's classifier
    with pytest.raises(ValueError, match="image_size"):
        pixel_shape({"num_channels": 3})


def test_a_classifier_over_a_vision_sub_config(tmp_path: Path) -> None:
    # CLIP's image classifier: no top-level hidden_size or image_size, its vision_config's (the
    # nested config block); the activation's width is the traced one
    text = _spec({"num_labels": 4}, cls="CLIPForImageClassification").replace(
        "config { num_labels = 4 }", "config {\n    num_labels = 4\n    vision_config { hidden_size = 32, "
        "num_hidden_layers = 4, num_attention_heads = 4, intermediate_size = 64, image_size = 32, patch_size = 8 }\n  }")
    plan = _plan(tmp_path, text)
    own = plan.own_forward
    assert (own.inputs, own.input_shape, own.width, plan.train.seq_len) == ("pixels", (3, 32, 32), 32, 17)
    from ppdsl.runtime.stage.build import activation_shape

    assert tuple(activation_shape(plan)) == (2, 17, 32)


def test_check_and_plan_without_seq_len(tmp_path: Path) -> None:
    from ppdsl.lowering.lower import lower
    from ppdsl.views.report import plan_report

    result = _check(tmp_path, _spec())
    assert result.ok and not result.diagnostics, [f"{d.code} {d.message}" for d in result.diagnostics]
    assert result.spec.train.seq_len == 17  # 16 patches + CLS, traced
    plan = lower(result.spec, 2, result.model_info)
    own = plan.own_forward
    assert (own.inputs, own.input_shape, plan.model.task) == ("pixels", (3, 32, 32), "image_classification")
    assert plan.train.seq_len == 17
    assert plan.stages[0].first == ("vit.embeddings",) and plan.stages[-1].last == ("vit.layernorm", "classifier")
    from ppdsl.runtime.stage.build import activation_shape

    assert tuple(activation_shape(plan)) == (2, 17, 32)
    text = plan_report(plan, result.model_info).render()
    assert "images 3 x 32 x 32" in text and "17 positions" in text


def test_a_written_seq_len_or_token_data_is_refused(tmp_path: Path) -> None:
    result = _check(tmp_path, _spec(train=", seq_len = 17"))
    assert [d.code for d in result.diagnostics if d.is_error] == ["E0435"]
    assert result.diagnostics[0].span.line == 8
    result = _check(tmp_path, _spec(train=', eval { data = text("corpus.txt", tokenizer = "tok") }'))
    assert "E0436" in [d.code for d in result.diagnostics if d.is_error]


def test_a_token_model_without_seq_len_is_still_E0102(tmp_path: Path) -> None:
    # a registered family: resolve asks for it; a class that runs its own forward: check with the model
    tiny = (ROOT / "specs" / "tiny_cpu.ppspec").read_text(encoding="utf-8")
    lines = [line for line in tiny.splitlines() if not line.strip().startswith("seq_len")]
    assert len(lines) < len(tiny.splitlines())
    from ppdsl.dsl.check import check_text

    result = check_text("\n".join(lines) + "\n")
    assert [d.code for d in result.diagnostics if d.is_error] == ["E0102"]
    assert result.diagnostics[0].message == "train has no 'seq_len'"
    decoder = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   max_position_embeddings=64)
    result = _check(tmp_path, _spec(decoder, cls="Olmo2ForCausalLM"))
    errors = [d for d in result.diagnostics if d.is_error]
    assert [d.code for d in errors] == ["E0102"] and errors[0].message == "train has no 'seq_len'"
    assert (errors[0].span.line, errors[0].span.column) == (8, 1)


def test_the_image_classification_loss_is_hfs() -> None:
    from transformers import ViTConfig, ViTForImageClassification

    from ppdsl.core.task_loss import task_loss

    torch.manual_seed(0)
    model = ViTForImageClassification(ViTConfig(**VIT)).eval()
    pixels, labels = torch.randn(3, 3, 32, 32), torch.tensor([0, 3, 1])
    out = model(pixel_values=pixels, labels=labels)
    assert torch.equal(task_loss("image_classification", model.config, out.logits, labels), out.loss)


def test_synthetic_images_are_deterministic_and_learnable(tmp_path: Path) -> None:
    from ppdsl.runtime.data.source import make_data

    plan = _plan(tmp_path, _spec())
    data = make_data(plan)
    a, b = data.batch(3, 0), data.batch(3, 0)
    assert a.pixel_values.shape == (4, 3, 32, 32) and a.pixel_values.dtype == torch.float32
    assert a.labels.shape == (4,) and a.labels.dtype == torch.long
    assert torch.equal(a.pixel_values, b.pixel_values) and torch.equal(a.labels, b.labels)
    assert not torch.equal(a.pixel_values, data.batch(4, 0).pixel_values)
    # the images of one class sit about their pattern: closer to each other than to another class's
    big = data.batch(0, 0)
    for step in range(1, 8):
        more = data.batch(step, 0)
        big = type(big)(torch.cat([big.input_ids, more.input_ids]), torch.cat([big.labels, more.labels]), None, None,
                        pixel_values=torch.cat([big.pixel_values, more.pixel_values]))
    means = {int(y): big.pixel_values[big.labels == y].mean(0) for y in big.labels.unique()}
    assert len(means) >= 2
    ys = sorted(means)
    inside = (big.pixel_values[big.labels == ys[0]] - means[ys[0]]).pow(2).mean()
    across = (means[ys[0]] - means[ys[1]]).pow(2).mean()
    assert across > 2 * inside
    mbs = data.microbatches(0, 0)
    assert [mb.pixel_values.shape[0] for mb in mbs] == [2, 2]


def test_matches_one_process_at_pp2(tmp_path: Path) -> None:
    plan = _plan(tmp_path, _spec())
    (report, _seconds), = run_distributed(equivalence_worker, 2, [plan], timeout=120)[0]
    assert report.ok, report.render()
    assert max(abs(a - b) for a, b in report.losses) <= 1e-6, report.losses


_RULES = "".join(f"  vit.layers[*].{m} : {s}\n" for m, s in (
    ("attention.q_proj", "column"), ("attention.k_proj", "column"), ("attention.v_proj", "column"),
    ("attention.o_proj", "row"), ("mlp.fc1", "column"), ("mlp.fc2", "row"))) + "  classifier : column\n"


def _tp_spec(labels: int) -> str:
    return _spec({**VIT, "num_labels": labels}, mesh="pp = 2, tp = 2").replace(
        "pipeline {", "tensor_parallel {\n" + _RULES + "}\npipeline {")


def test_the_head_rule_holds_for_an_image_classifier(tmp_path: Path) -> None:
    result = _check(tmp_path, _tp_spec(3), world=4)
    errors = [d for d in result.diagnostics if d.is_error]
    assert [d.code for d in errors] == ["E0208"], [f"{d.code} {d.message}" for d in errors]
    assert "num_labels = 3" in errors[0].message and (errors[0].span.line, errors[0].span.column) == (14, 3)
    assert _check(tmp_path, _tp_spec(4), world=4).ok


@pytest.mark.slow
def test_written_rules_match_one_process_at_pp2_tp2(tmp_path: Path) -> None:
    plan = _plan(tmp_path, _tp_spec(4), world=4)
    assert {r.style for r in plan.tp} >= {"column", "row"}
    (report, _seconds), = run_distributed(equivalence_worker, 4, [plan], timeout=240)[0]
    assert report.ok, report.render()
