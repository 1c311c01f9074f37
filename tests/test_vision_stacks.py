"""Vision stacks whose width changes between blocks (issue 32, item 1, last-but-one bullet; items 2
and 8 for vision): Swin's stages (patch merging halves the patch grid and doubles the width) and
ConvNext's (each stage a feature map of its own channels and size).

Check's meta trace records the hidden state entering each block (`OwnLayout.block_shapes`), the
cut is proved at every block where those shapes change (dsl/own_cut_proof.py), lowering records
what each stage boundary carries (`Plan.boundaries`, lowering/boundaries.py) and the executor's
receive buffers take those shapes (one pool per shape). A CNN whose config says no image size
takes `image_size` written in the model's config. One gloo world of 2 (pp 2, ConvNext) trains two
steps against one process; Swin at dp 2 x pp 2 (the issue's Done-when, `specs/swin.ppspec`) is
slow.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

from _exec_harness import equivalence_worker  # noqa: E402
from dist_harness import run_distributed  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONVNEXT = dict(image_size=32, num_channels=3, hidden_sizes=[8, 16, 32, 64], depths=[1, 1, 1, 1], num_labels=4)


def _spec(cls: str, config: dict[str, Any], pipeline: str = "style = 1f1b, microbatches = 2") -> str:
    values = ", ".join(f"{k} = {v}" for k, v in config.items())
    return f"""ppspec 1
model m {{
  source = hf("{cls}")
  config {{ {values} }}
}}
mesh {{ pp = 2 }}
pipeline {{ {pipeline} }}
train {{ global_batch = 4, steps = 2, optimizer = adamw(lr = 1e-3), data = synthetic(seed = 0) }}
"""


from _spec_text import check_text as _check, plan_text as _plan  # noqa: E402


def _shapes(plan: Any) -> list[tuple[int, ...]]:
    assert all(len(b.tensors) == 1 and b.tensors[0].name == "hidden" for b in plan.boundaries)
    return [b.tensors[0].shape for b in plan.boundaries]


def test_each_boundary_carries_what_the_model_sends_there(tmp_path: Path) -> None:
    from ppdsl.lowering.plan import Plan
    from ppdsl.runtime.stage.build import boundary_shapes

    # interleaved over 4 blocks: 4 virtual stages, 3 boundaries of 3 shapes (microbatch 2)
    plan = _plan(tmp_path, _spec("ConvNextForImageClassification", CONVNEXT,
                                 "style = interleaved, chunks = 2, microbatches = 2"))
    assert _shapes(plan) == [(2, 8, 8, 8), (2, 16, 4, 4), (2, 32, 2, 2)]
    assert [b.stage for b in plan.boundaries] == [0, 1, 2]
    assert Plan.from_json(plan.to_json()) == plan  # plain frozen data, as `ppdsl plan --format json` prints it
    assert boundary_shapes(plan) == tuple(_shapes(plan))  # the runtime reads them, never re-derives


def test_swin_without_a_layout_and_the_plan_prints_its_boundary(tmp_path: Path) -> None:
    from ppdsl.views.report import plan_report

    text = (ROOT / "specs" / "swin.ppspec").read_text(encoding="utf-8")
    plan = _plan(tmp_path, text)
    assert plan.blocks == "swin.encoder.layers"
    assert _shapes(plan) == [(4, 64, 32)]  # 16 x 16 patches of 16 merged into 8 x 8 of 32
    report = plan_report(plan).render()
    assert "stage boundaries (one microbatch, sent on; its gradient comes back): 0->1 hidden (4, 64, 32)" in report
    # p2p per step: 2 microbatches of 4 x 64 x 32 fp32 = 64 KiB each way
    assert "64.0KiB" in report


def test_a_uniform_stack_keeps_one_shape(tmp_path: Path) -> None:
    vit = dict(num_hidden_layers=4, hidden_size=32, num_attention_heads=4, intermediate_size=64, image_size=32,
               patch_size=8, num_channels=3, num_labels=4)
    plan = _plan(tmp_path, _spec("ViTForImageClassification", vit))
    assert _shapes(plan) == [(2, 17, 32)]


def test_buffers_counted_per_boundary_shape() -> None:
    from ppdsl.core.schedules import generate
    from ppdsl.core.schedules.messages import message_steps
    from ppdsl.runtime.pipeline.recv_buffers import buffers_in_use

    schedule = generate("interleaved", 2, 4, 2)
    steps = message_steps(schedule, 1)
    total = buffers_in_use(steps, schedule.split_backward)
    acts = buffers_in_use(steps, schedule.split_backward, held=lambda m: m.kind == "act")
    grads = buffers_in_use(steps, schedule.split_backward, held=lambda m: m.kind == "grad")
    assert 0 < acts <= total and 0 < grads <= total and total <= acts + grads


def test_a_cnn_takes_the_image_size_written_in_its_config(tmp_path: Path) -> None:
    resnet = dict(embedding_size=8, hidden_sizes=[8, 16, 32, 64], depths=[1, 1, 1, 1], num_labels=4)
    refused = _check(tmp_path, _spec("ResNetForImageClassification", resnet))
    errors = [d for d in refused.diagnostics if d.is_error]
    assert [d.code for d in errors] == ["E0421"] and "config { image_size = 224 }" in errors[0].message
    plan = _plan(tmp_path, _spec("ResNetForImageClassification", {"image_size": 32, **resnet}))
    assert plan.own_forward.input_shape == (3, 32, 32)
    assert len(plan.boundaries) == 1


def test_convnext_matches_one_process_at_pp2(tmp_path: Path) -> None:
    plan = _plan(tmp_path, _spec("ConvNextForImageClassification", CONVNEXT))
    (report, _seconds), = run_distributed(equivalence_worker, 2, [plan], timeout=120)[0]
    assert report.ok, report.render()


@pytest.mark.slow
def test_swin_verifies_at_dp2_pp2(tmp_path: Path) -> None:
    plan = _plan(tmp_path, (ROOT / "specs" / "swin.ppspec").read_text(encoding="utf-8"), world=4)
    (report, _seconds), = run_distributed(equivalence_worker, 4, [plan], timeout=300)[0]
    assert report.ok, report.render()


def test_a_bf16_boundary_reaches_the_next_stage_as_bf16(tmp_path: Path) -> None:
    """Swin's blocks pass bf16 under bf16 autocast (its patch embedding's output is bf16): the
    next stage must compute on bf16 as one process does, not on the wire's fp32 (it differed by
    2.6e-5 in the loss and wholly in some gradients before the wire named the sent dtype)."""
    from ppdsl import cli

    path = tmp_path / "swin_bf16.ppspec"
    path.write_text((ROOT / "specs" / "swin.ppspec").read_text(encoding="utf-8"), encoding="utf-8")
    code = cli.main(["verify", str(path), "--world", "2", "--steps", "2", "--set", "train.precision=bf16"])
    assert code == 0


def test_checkpointed_blocks_keep_their_traced_inputs(tmp_path: Path) -> None:
    from ppdsl.lowering.rank_memory import _block_inputs

    text = _spec("ConvNextForImageClassification", CONVNEXT).replace("data = synthetic(seed = 0)",
                                                                     "data = synthetic(seed = 0), activation_checkpointing = true")
    result = _check(tmp_path, text)
    assert result.ok, [f"{d.code} {d.message}" for d in result.diagnostics]
    from ppdsl.lowering.lower import lower

    plan = lower(result.spec, 2, result.model_info)
    # the feature maps entering blocks 2 and 3: 16 x 4 x 4 and 32 x 2 x 2 values per sample
    assert _block_inputs(result.model_info, plan.stages[1]) == 16 * 4 * 4 + 32 * 2 * 2
    assert plan.memory is not None and all(a > 0 for a in plan.memory.activations)
