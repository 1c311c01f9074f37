"""Image-text models (issue 32, items 2, 3 and 6 for image-text): LLaVA on images and token ids.

The input kind is the forward's (`ppdsl.core.model_inputs`: `input_ids` and `pixel_values`:
"image_text"). Check's trace runs the image path on meta: the blocks are the language model's
layers (the list that runs last, fed the embeddings with the image's features merged in); the
vision tower and projector run in the first stage, and a later stage's forward skips the image
path. The image tokens per sample are what the model's own get_image_features yields for one
image of the vision sub-config's size (LLaVA's default strategy drops CLS: (32 / 8)^2 = 16;
"full" keeps it: 17). The loss is the causal LM's on the text, -100 at the image tokens, equal
to HF's labels= loss. A gloo world of 2 (pp 2) trains two steps against the single-process reference;
with `hf_plan = true` the language model's sub-config's plan splits its layers (pp 2 x tp 2: slow).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from _exec_harness import equivalence_worker  # noqa: E402
from dist_harness import run_distributed  # noqa: E402

VISION = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4, image_size=32,
              patch_size=8, attention_dropout=0.0)
SHAPES = Path(__file__).resolve().parents[1] / "specs" / "data" / "shapes"  # images + captions.jsonl
CAPTIONS_TOKENIZER = SHAPES.parent / "captions_tokenizer"
TEXT = dict(num_hidden_layers=4, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=128, max_position_embeddings=64)


def _block(values: dict[str, Any]) -> str:
    return ", ".join(f"{k} = {v!r}".replace("'", '"') for k, v in values.items())


def _spec(mesh: str = "pp = 2", seq_len: int = 24, top: str = "image_token_id = 127", vision: dict[str, Any] = VISION,
          text: dict[str, Any] = TEXT, data: str = "synthetic(seed = 0)") -> str:
    return f"""ppspec 1
model llava {{
  source = hf("LlavaForConditionalGeneration")
  config {{
    {top}
    vision_config {{ {_block(vision)} }}
    text_config {{ {_block(text)} }}
  }}
}}
mesh {{ {mesh} }}
pipeline {{ style = 1f1b, microbatches = 2 }}
train {{
  seq_len = {seq_len}
  global_batch = 4
  steps = 2
  optimizer = sgd(lr = 1e-2)
  data = {data}
}}
"""


def _check(text: str, world: int = 2) -> Any:
    from ppdsl.dsl.check import check_text

    from _front_end import SPEC_FILE

    return check_text(text, SPEC_FILE, world=world, model=True)


def _plan(text: str, world: int = 2) -> Any:
    from _front_end import lower_text

    assert not _check(text, world).diagnostics  # no warning either: not W0437, the vision tower runs
    return lower_text(text, world)


def _line_of(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if needle in line)


def _llava(vision: dict[str, Any] = VISION, **top: Any) -> Any:
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    config = LlavaConfig(vision_config={"model_type": "clip_vision_model", **vision},
                         text_config={"model_type": "llama", **TEXT}, image_token_id=127, **top)
    return LlavaForConditionalGeneration(config)


def test_the_input_kind_is_the_forwards() -> None:
    from ppdsl.core.model_inputs import input_kind
    from ppdsl.core.task_loss import own_task

    assert input_kind(("input_ids", "pixel_values", "attention_mask")) == "image_text"
    assert input_kind(("input_ids", "attention_mask")) == "tokens"
    assert input_kind(("pixel_values",)) == "pixels"
    assert own_task("LlavaForConditionalGeneration", "image_text") == "causal_lm"


def test_the_vision_tower_runs_in_the_first_stage() -> None:
    plan = _plan(_spec())
    own = plan.own_forward
    assert (plan.model.task, own.inputs, tuple(own.input_shape)) == ("causal_lm", "image_text", (3, 32, 32, 16, 127))
    assert plan.blocks == "model.language_model.layers"
    assert set(plan.stages[0].first) == {"model.language_model.embed_tokens", "model.vision_tower",
                                         "model.multi_modal_projector"}
    assert plan.stages[-1].last == ("model.language_model.norm", "lm_head")


def test_the_blocks_are_the_language_models_when_the_vision_tower_is_deeper() -> None:
    plan = _plan(_spec(vision={**VISION, "num_hidden_layers": 6}))
    assert plan.blocks == "model.language_model.layers"


@pytest.mark.parametrize("strategy, tokens", [("default", 16), ("full", 17)])
def test_the_image_tokens_are_the_models_features_per_image(strategy: str, tokens: int) -> None:
    from ppdsl.dsl.own_layout import trace_layout

    with torch.device("meta"):
        model = _llava(vision_feature_select_strategy=strategy)
    layout = trace_layout(model, model.config.to_dict())
    assert layout.ok, layout.reason
    assert tuple(layout.input_shape) == (3, 32, 32, tokens, 127)


def test_refusals_at_their_line() -> None:
    text = _spec(seq_len=16, top="image_token_id = 300")
    errors = {d.code: d for d in _check(text).diagnostics if d.is_error}
    assert set(errors) == {"E0475", "E0477"}, [f"{d.code} {d.message}" for d in errors.values()]
    assert errors["E0475"].span.line == _line_of(text, "seq_len = 16") and "16 image tokens" in errors["E0475"].message
    assert "more than 16" in errors["E0475"].hint
    assert errors["E0477"].span.line == _line_of(text, "image_token_id = 300") and "128" in errors["E0477"].message
    text = _spec(data='tokens("train.bin")')
    errors = [d for d in _check(text).diagnostics if d.code == "E0476"]
    assert errors and errors[0].span.line == _line_of(text, "data = tokens")


def test_seq_len_is_held_against_the_language_models_positions() -> None:
    """A composite config's top level has no positions: E0216 reads text_config's (64), with or
    without the model built."""
    from ppdsl.dsl.check import check_text

    from _front_end import SPEC_FILE

    text = _spec(seq_len=65)
    for model in (False, True):
        errors = [d for d in check_text(text, SPEC_FILE, world=2, model=model).diagnostics if d.is_error]
        assert [d.code for d in errors] == ["E0216"], [f"{d.code} {d.message}" for d in errors]
        assert errors[0].span.line == _line_of(text, "seq_len = 65") and "64 positions" in errors[0].message


def test_synthetic_text_follows_the_image_and_the_loss_is_hfs() -> None:
    from ppdsl.core.own_cut import model_inputs
    from ppdsl.core.task_loss import task_loss
    from ppdsl.runtime.data.source import make_data

    batch = make_data(_plan(_spec())).batch(0, 0)
    ids, labels = batch.input_ids, batch.labels
    assert batch.pixel_values.shape == (4, 3, 32, 32)
    assert (ids[:, :16] == 127).all() and (labels[:, :16] == -100).all()
    assert torch.equal(labels[:, 16:], ids[:, 16:]) and not (ids[:, 16:] == 127).any()
    model = _llava().eval()
    with torch.no_grad():
        hf = model(input_ids=ids, pixel_values=batch.pixel_values, labels=labels).loss
        logits = model(**model_inputs(model, ids, pixel_values=batch.pixel_values)).logits
    assert torch.allclose(task_loss("causal_lm", model.config, logits, labels), hf, atol=1e-6)
    # the text is the image's class's: one class, one text
    classes = {}
    for image, text in zip(batch.pixel_values, ids[:, 16:]):
        classes.setdefault(tuple(text.tolist()), []).append(image)
    assert len(classes) <= 4


def _folder(path: Path | str = SHAPES, **kw: Any) -> str:
    return _spec(data=f'image_text_folder("{path}", tokenizer = "{CAPTIONS_TOKENIZER}")', **kw)


def test_held_out_captioned_images_are_evaluated_and_never_trained_on() -> None:
    from ppdsl.runtime.data.source import make_data

    text = _folder().replace("  data = image_text_folder", "  eval { data = holdout(0.25) }\n  data = image_text_folder")
    plan = _plan(text)
    train, held = make_data(plan), make_data(plan, data=plan.train.eval.data)
    train._ready(), held._ready()
    n = train.parts[0].count()
    trained, evaluated = set(train._orders[0](range(2 * n))), set(held._orders[0](range(n)))
    assert len(evaluated) == n // 4 and not trained & evaluated and len(trained | evaluated) == n
    # the held-out rows are the part's own, images decoded, as the folder reads them alone
    batch = held.batch(0, 0)
    picked = [held._orders[0]([k])[0] for _, k in held.positions(0, 0)]
    alone = train.parts[0].read(picked)
    assert torch.equal(batch.input_ids, alone[0]) and torch.equal(batch.labels, alone[1])
    assert torch.equal(batch.pixel_values, alone[4]) and batch.pixel_values.abs().sum() > 0
    # captioned images are held out of, not mixed
    mixed = _folder().replace(f'data = image_text_folder("{SHAPES}", tokenizer = "{CAPTIONS_TOKENIZER}")',
                              f'data = mix(image_text_folder("{SHAPES}", tokenizer = "{CAPTIONS_TOKENIZER}"), '
                              f'image_text_folder("{SHAPES}", tokenizer = "{CAPTIONS_TOKENIZER}"))')
    assert "E0454" in [d.code for d in _check(mixed).diagnostics]


def test_captioned_images_are_the_placeholders_then_the_caption_and_the_loss_is_hfs() -> None:
    from ppdsl.core.own_cut import model_inputs
    from ppdsl.core.task_loss import task_loss
    from ppdsl.runtime.data.source import make_data

    batch = make_data(_plan(_folder())).batch(0, 0)
    ids, labels, pixels = batch.input_ids, batch.labels, batch.pixel_values
    assert pixels.shape == (4, 3, 32, 32) and pixels.abs().sum() > 0  # decoded by LLaVA's default processor (CLIP's)
    assert (ids[:, :16] == 127).all() and (labels[:, :16] == -100).all()
    vocab = ["<s>", "<pad>", "</s>", "<unk>", "a", "across", "blue", "board", "checker", "down", "green", "red",
             "running", "stripes"]
    captions = {"a red checker board", "green stripes across", "blue stripes running down"}
    for row, row_labels in zip(ids, labels):
        words = [vocab[i] for i in row[16:].tolist()]
        end = words.index("</s>")
        assert words[0] == "<s>" and " ".join(words[1:end]) in captions
        assert set(words[end + 1:]) <= {"<pad>"} and (row_labels[16 + end + 1:] == -100).all()
        assert torch.equal(row_labels[16:17 + end], row[16:17 + end])
    model = _llava().eval()
    with torch.no_grad():
        hf = model(input_ids=ids, pixel_values=pixels, labels=labels).loss
        logits = model(**model_inputs(model, ids, pixel_values=pixels)).logits
    assert torch.allclose(task_loss("causal_lm", model.config, logits, labels), hf, atol=1e-6)


def test_image_text_folder_refusals_at_their_line(tmp_path: Path) -> None:
    import shutil

    folder = tmp_path / "captioned"
    (folder / "img").mkdir(parents=True)
    shutil.copy(SHAPES / "train" / "checker" / "000.png", folder / "img" / "a.png")
    (folder / "img" / "b.png").write_bytes(b"not a png")
    cases = {
        '{"image": "img/a.png", "text": "a red checker board"}\n{"image": "img/a.png"}\n': ("line 2", "no 'text' field"),
        '{"image": "img/missing.png", "text": "a"}\n': ("line 1", "img/missing.png does not exist"),
        '{"image": "img/a.png", "text": "a"}\n' * 3 + '{"image": "img/b.png", "text": "a"}\n':
            ("b.png", "line 4 of captions.jsonl"),
    }
    for lines, (where, why) in cases.items():
        (folder / "captions.jsonl").write_text(lines)
        text = _folder(folder)
        errors = [d for d in _check(text).diagnostics if d.is_error]
        assert [d.code for d in errors] == ["E0479"], [f"{d.code} {d.message}" for d in errors]
        assert where in errors[0].message and why in errors[0].message, errors[0].message
        assert errors[0].span.line == _line_of(text, "data = image_text_folder")
    llama = """ppspec 1
model m {
  source = hf("LlamaForCausalLM")
  config { hidden_size = 32, intermediate_size = 64, num_hidden_layers = 2, num_attention_heads = 4, vocab_size = 128 }
}
train { seq_len = 16, global_batch = 4, data = image_text_folder("%s", tokenizer = "%s") }
""" % (SHAPES, CAPTIONS_TOKENIZER)
    errors = [d for d in _check(llama, world=1).diagnostics if d.is_error]
    assert [d.code for d in errors] == ["E0480"], [f"{d.code} {d.message}" for d in errors]
    assert errors[0].span.line == _line_of(llama, "image_text_folder") and "LlamaForCausalLM" in errors[0].message


@pytest.mark.distributed
@pytest.mark.parametrize("data", ["synthetic", "image_text_folder"])
def test_llava_at_pp2_matches_one_process(data: str) -> None:
    plan = _plan(_spec() if data == "synthetic" else _folder())
    (report, _seconds), = run_distributed(equivalence_worker, 2, [plan], timeout=180)[0]
    assert report.ok, report.render()


def test_hf_plan_splits_the_language_models_layers() -> None:
    text = _spec(mesh="pp = 2, tp = 2").replace("pipeline {", "tensor_parallel { hf_plan = true }\npipeline {")
    plan = _plan(text, world=4)
    split = {r.path: r.style for r in plan.tp}
    assert split["model.language_model.layers.0.self_attn.q_proj"] == "column"
    assert split["model.language_model.layers.3.mlp.down_proj"] == "row"
    assert split["model.language_model.embed_tokens"] == "vocab" and split["lm_head"] == "column"
    assert not [p for p in split if "vision_tower" in p or "projector" in p]


@pytest.mark.slow
@pytest.mark.distributed
def test_llava_at_pp2_tp2_with_hf_plan_matches_one_process() -> None:
    text = _spec(mesh="pp = 2, tp = 2").replace("pipeline {", "tensor_parallel { hf_plan = true }\npipeline {")
    (report, _seconds), = run_distributed(equivalence_worker, 4, [_plan(text, world=4)], timeout=300)[0]
    assert report.ok, report.render()


def test_an_image_path_that_does_not_trace_runs_on_tokens_and_says_why() -> None:
    # a feature layer the 2-layer vision tower does not have: the image path fails on meta; the
    # model still runs its language model on the token ids (check's probes and proofs too)
    text = _spec(mesh="dp = 2", top="image_token_id = 127, vision_feature_layer = 5")
    diagnostics = _check(text).diagnostics
    assert [d.code for d in diagnostics] == ["W0437"], [f"{d.code} {d.message}" for d in diagnostics]
    assert "its image path cannot run" in diagnostics[0].message and "(tokens" in diagnostics[0].message
    from _front_end import lower_text

    assert lower_text(text, 2).own_forward.inputs == "tokens"


BLIP2 = (SHAPES.parents[1] / "blip2.ppspec").read_text(encoding="utf-8").replace("steps = 40", "steps = 3")


def test_blip2_runs_its_q_former_and_query_tokens_in_the_first_stage() -> None:
    """Blip2's forward takes decoder_input_ids too (for its encoder-decoder text models): with
    pixel_values and input_ids it is an image-text model. Its root's query_tokens, which the
    Q-Former reads, are read before the blocks only: the first stage holds them."""
    result = _check(BLIP2)
    assert not result.diagnostics, [f"{d.code} {d.message}" for d in result.diagnostics]
    layout = result.model_info.own_layout
    assert layout.inputs == "image_text" and layout.input_shape[3] == 4  # num_query_tokens
    assert layout.blocks == "language_model.model.decoder.layers" and layout.above_late == ()
    assert {"vision_model", "qformer", "language_projection"} <= set(layout.first)
    from _front_end import lower_text

    plan = lower_text(BLIP2, 2)
    assert plan.stages[0].first[:3] == ("vision_model", "qformer", "language_projection")


def test_a_root_parameter_read_after_the_blocks_is_found_by_the_trace() -> None:
    from torch import nn
    from transformers import LlamaConfig, LlamaForCausalLM

    from ppdsl.dsl.own_layout import trace_layout

    config = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4, vocab_size=128)
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**config))
        model.scale = nn.Parameter(torch.ones(1))
    forward = model.forward

    def scaled(input_ids: Any = None, **kwargs: Any) -> Any:
        out = forward(input_ids=input_ids, **kwargs)
        out.logits = out.logits * model.scale
        return out

    model.forward = scaled
    assert trace_layout(model, config).above_late == ("scale",)


@pytest.mark.distributed
def test_blip2_at_pp2_matches_one_process() -> None:
    """With its sub-configs' dropouts (the Q-Former's 0.1) off for the comparison, as verify does."""
    from ppdsl.runtime.verify.randomness import without_randomness

    result = _check(BLIP2)
    plan, notes = without_randomness(_plan(BLIP2), dict(result.model_info.config))
    assert notes and "qformer_config.hidden_dropout_prob" in notes[0]
    (report, _seconds), = run_distributed(equivalence_worker, 2, [plan], timeout=180)[0]
    assert report.ok, report.render()


@pytest.mark.parametrize("token, where", [(1, "pads with id 1"), (4, "line 1: the caption tokenizes to id 4")])
def test_an_image_token_the_captions_or_padding_hold_is_refused_by_check(token: int, where: str) -> None:
    errors = [d for d in _check(_folder(top=f"image_token_id = {token}")).diagnostics if d.is_error]
    assert [d.code for d in errors] == ["E0479"] and where in errors[0].message, [d.message for d in errors]
