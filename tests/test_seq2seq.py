"""Encoder-decoder language models (issue 32, items 1 and 3, first slice): BART and T5 run their own
forward on source and target ids.

The input kind is the forward's (`ppdsl.core.model_inputs`: `input_ids` and `decoder_input_ids`:
"seq2seq"); the task is HF's seq2seq loss (`ppdsl.core.task_loss`: cross entropy of the decoder's
logits against the labels, unshifted); the decoder's input is the labels shifted right by the
model's own `prepare_decoder_input_ids_from_labels`. Check's trace takes the encoder's block list
as the blocks: stages cut the encoder, and the decoder runs whole on the last stage, fed the
encoder's output there. T5's blocks pass on the position bias its first block computes: each
stage boundary carries it after the hidden state (`OwnLayout.carried`, `Boundary.tensors`), and its
gradient back to block 0's relative attention bias; under tp where a rank's share keeps its shape
(the feed-forward layers split), not under cp (E0420, at `cp`). Gloo
worlds of 2 and 4 train two steps against the single-process reference.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from _exec_harness import equivalence_worker  # noqa: E402
from dist_harness import run_distributed  # noqa: E402

BART = dict(vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
            dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)  # the harness compares with dropout as written
T5 = dict(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0,
          dropout_rate=0.0)
T5_FFN_RULES = "".join(f"  {stack}.block[*].layer[{i}].DenseReluDense.{m} : {s}\n" for stack, i in (
    ("encoder", 1), ("decoder", 2)) for m, s in (("wi", "column"), ("wo", "row")))
T5_ATTENTION_RULES = "".join(f"  encoder.block[*].layer[0].SelfAttention.{m} : {s}\n" for m, s in (
    ("q", "column"), ("k", "column"), ("v", "column"), ("o", "row")))
# column / row over both stacks, cross-attention included (its k / v read the encoder's output)
BART_RULES = "".join(f"  model.{stack}.layers[*].{m} : {s}\n" for stack in ("encoder", "decoder") for m, s in (
    ("self_attn.q_proj", "column"), ("self_attn.k_proj", "column"), ("self_attn.v_proj", "column"),
    ("self_attn.out_proj", "row"), ("fc1", "column"), ("fc2", "row"))) + "".join(
    f"  model.decoder.layers[*].encoder_attn.{m} : {s}\n" for m, s in (
        ("q_proj", "column"), ("k_proj", "column"), ("v_proj", "column"), ("out_proj", "row")))


def _spec(cls: str = "BartForConditionalGeneration", config: dict[str, Any] = BART, mesh: str = "pp = 2",
          data: str = "synthetic(seed = 0)", rules: str = "") -> str:
    values = ", ".join(f"{k} = {v}" for k, v in config.items())
    tp = f"tensor_parallel {{\n{rules}}}\n" if rules else ""
    return f"""ppspec 1
model m {{
  source = hf("{cls}")
  config {{ {values} }}
}}
mesh {{ {mesh} }}
{tp}pipeline {{ style = 1f1b, microbatches = 2 }}
train {{ global_batch = 4, seq_len = 8, steps = 2, optimizer = sgd(lr = 1e-2), data = {data} }}
"""


from _spec_text import check_text as _check, plan_text as _plan  # noqa: E402


def _errors(tmp_path: Path, text: str, world: int = 2) -> list[Any]:
    return [d for d in _check(tmp_path, text, world).diagnostics if d.is_error]


def test_the_input_kind_and_task_are_the_forwards() -> None:
    from ppdsl.core.model_inputs import input_kind
    from ppdsl.core.task_loss import own_task

    assert input_kind(("input_ids", "attention_mask", "decoder_input_ids")) == "seq2seq"
    assert input_kind(("input_ids", "attention_mask")) == "tokens"
    assert input_kind(("input_features", "decoder_input_ids")) == "speech"  # tests/test_speech.py
    assert own_task("BartForConditionalGeneration", "seq2seq") == "seq2seq_lm"


@pytest.mark.parametrize("cls, config", [("BartForConditionalGeneration", BART), ("T5ForConditionalGeneration", T5)])
def test_the_task_loss_is_hfs_labels_loss(cls: str, config: dict[str, Any]) -> None:
    import transformers

    from ppdsl.core.own_cut import model_inputs
    from ppdsl.core.task_loss import task_loss

    model_cls = getattr(transformers, cls)
    model = model_cls(model_cls.config_class(**config)).eval()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 64, (2, 8), generator=gen)
    labels = torch.randint(3, 64, (2, 8), generator=gen)
    labels[1, 5:] = -100  # padding of the targets: made the pad id in the decoder's input, no loss there
    with torch.no_grad():
        hf = model(input_ids=ids, labels=labels).loss
        logits = model(**model_inputs(model, ids, labels=labels)).logits
    assert torch.allclose(task_loss("seq2seq_lm", model.config, logits, labels), hf, atol=1e-6)


def test_the_encoder_is_cut_and_the_decoder_runs_on_the_last_stage(tmp_path: Path) -> None:
    plan = _plan(tmp_path, _spec())
    assert (plan.model.task, plan.own_forward.inputs, plan.blocks) == ("seq2seq_lm", "seq2seq",
                                                                            "model.encoder.layers")
    assert plan.stages[0].first == ("model.encoder.embed_tokens", "model.encoder.embed_positions",
                                    "model.encoder.layernorm_embedding")
    assert plan.stages[-1].last == ("model.shared", "model.decoder", "lm_head")


def test_synthetic_targets_are_the_sources_reversed(tmp_path: Path) -> None:
    from ppdsl.runtime.data.source import make_data

    batch = make_data(_plan(tmp_path, _spec())).batch(0, 0)
    assert torch.equal(batch.labels, batch.input_ids.flip(-1))


def test_t5s_boundaries_carry_the_position_bias(tmp_path: Path) -> None:
    # seq_len 12, not the trace's length (8): the bias's sequence dimensions follow the spec's
    plan = _plan(tmp_path, _spec("T5ForConditionalGeneration", {**T5, "num_layers": 4}).replace(
        "seq_len = 8", "seq_len = 12"))
    boundary, = plan.boundaries
    # microbatches of 2, 32 wide; output 1 of block 1: the bias of 4 heads over 12 x 12 positions
    assert [(t.name, t.shape, t.output) for t in boundary.tensors] == [
        ("hidden", (2, 12, 32), 0), ("carried", (2, 4, 12, 12), 1)]
    from ppdsl.runtime.stage.build import boundary_shapes

    assert boundary_shapes(plan) == ((2, 12 * 32 + 4 * 12 * 12),)  # one tensor on the wire


def test_pack_and_unpack_a_boundary_keep_values_and_gradients() -> None:
    from ppdsl.core.own_cut import pack_boundary, unpack_boundary

    hidden = torch.randn(2, 3, 4, requires_grad=True)
    bias = torch.randn(1, 2, 3, 3, requires_grad=True)  # broadcast over the batch (no mask): expanded
    wire = pack_boundary(hidden, (bias,))
    assert wire.shape == (2, 12 + 18)
    got_hidden, got_bias = unpack_boundary(wire, [(2, 3, 4), (2, 2, 3, 3)])
    assert torch.equal(got_hidden, hidden) and torch.equal(got_bias, bias.expand(2, 2, 3, 3))
    (got_hidden.sum() + 2 * got_bias.sum()).backward()
    assert torch.equal(hidden.grad, torch.ones_like(hidden)) and torch.equal(bias.grad, torch.full_like(bias, 4.0))
    assert pack_boundary(hidden, ()) is hidden and unpack_boundary(hidden, [(2, 3, 4)]) == [hidden]


def test_what_is_not_built_is_refused_at_its_line(tmp_path: Path) -> None:
    # T5's carried position bias spans the whole sequence: not split by context parallelism, at cp
    text = _spec("T5ForConditionalGeneration", T5, mesh="pp = 2, cp = 2")
    carried = [d for d in _errors(tmp_path, text, world=4) if d.code == "E0420"]
    assert len(carried) == 1 and "output 1 of the block, of shape (4, seq, seq)" in carried[0].message
    assert carried[0].span.line == text.splitlines().index("mesh { pp = 2, cp = 2 }") + 1
    assert carried[0].span.column == len("mesh { pp = 2, ") + 1
    # LongT5's position bias counts blocks of local_radius + 1 positions: 2 at the trace's lengths (8, 7),
    # 4 at seq_len 16, so the boundary the plan would size from the trace is refused at seq_len
    text = _spec("LongT5ForConditionalGeneration", {**T5, "local_radius": 3}).replace("seq_len = 8", "seq_len = 16")
    errors = _errors(tmp_path, text)
    assert [d.code for d in errors] == ["E0420"] and "(4, 4, 4, 12)" in errors[0].message, errors
    assert errors[0].span.line == next(i for i, line in enumerate(text.splitlines(), 1) if "seq_len = 16" in line)
    assert not _errors(tmp_path, _spec("LongT5ForConditionalGeneration", {**T5, "local_radius": 3}))
    # T5's attention under tp: its relative attention bias (an embedding, one column per head) stays whole
    errors = _errors(tmp_path, _spec("T5ForConditionalGeneration", T5, mesh="pp = 2, tp = 2", rules=T5_ATTENTION_RULES),
                     world=4)
    assert {d.code for d in errors} == {"E0220"} and "relative_attention_bias" in errors[0].message
    # T5 without the token its decoder starts from: its own shift cannot run
    no_start = {k: v for k, v in T5.items() if k != "decoder_start_token_id"}
    errors = _errors(tmp_path, _spec("T5ForConditionalGeneration", no_start, mesh="dp = 2"))
    assert [d.code for d in errors] == ["E0439"] and "decoder_start_token_id" in errors[0].hint
    # one sequence per sample is not a pair
    (tmp_path / "corpus.txt").write_text("hello world\n" * 50, encoding="utf-8")
    errors = _errors(tmp_path, _spec(data='text("corpus.txt", tokenizer = "tok")'))
    assert "E0438" in [d.code for d in errors]


@pytest.mark.distributed
@pytest.mark.slow  # pp 2 runs by default with tp 2 and with a split backward below
def test_bart_at_pp2_matches_one_process(tmp_path: Path) -> None:
    plan = _plan(tmp_path, _spec())
    (report, _seconds), = run_distributed(equivalence_worker, 2, [plan], timeout=180)[0]
    assert report.ok, report.render()


@pytest.mark.distributed
def test_bart_with_a_split_backward_matches_one_process(tmp_path: Path) -> None:
    # cross-attention rejoins the input path twice: the weight groups' subgraphs overlap
    plan = _plan(tmp_path, _spec().replace("style = 1f1b", "style = zbh1"))
    (report, _seconds), = run_distributed(equivalence_worker, 2, [plan], timeout=180)[0]
    assert report.ok, report.render()


@pytest.mark.distributed
def test_bart_at_pp2_tp2_matches_one_process(tmp_path: Path) -> None:
    # the layer norms beside fc1 in BART's layers read whole activations: whole gradients, not
    # summed over tp (Plan.tp_partial, from check's dataflow)
    plan = _plan(tmp_path, _spec(mesh="pp = 2, tp = 2", rules=BART_RULES), world=4)
    assert not any("layer_norm" in p for p in plan.tp_partial), plan.tp_partial
    (report, _seconds), = run_distributed(equivalence_worker, 4, [plan], timeout=300)[0]
    assert report.ok, report.render()


@pytest.mark.distributed
def test_t5_at_pp2_tp2_matches_one_process(tmp_path: Path) -> None:
    # the position bias crosses the boundary; its gradient returns to block 0's relative attention
    # bias; the feed-forward layers split over tp leave it whole (check proved it at local shapes)
    plan = _plan(tmp_path, _spec("T5ForConditionalGeneration", {**T5, "num_layers": 4}, mesh="pp = 2, tp = 2",
                                 rules=T5_FFN_RULES), world=4)
    assert len(plan.boundaries[0].tensors) == 2
    (report, _seconds), = run_distributed(equivalence_worker, 4, [plan], timeout=300)[0]
    assert report.ok, report.render()


@pytest.mark.distributed
@pytest.mark.slow  # pp 2 x tp 2 above runs the same boundary
def test_t5_at_pp2_matches_one_process(tmp_path: Path) -> None:
    plan = _plan(tmp_path, _spec("T5ForConditionalGeneration", {**T5, "num_layers": 4}))
    (report, _seconds), = run_distributed(equivalence_worker, 2, [plan], timeout=180)[0]
    assert report.ok, report.render()
