"""HF classes no family claims run their own forward as pipeline stages (core/families/own/).

A sample of such classes goes through the real front end (spec text without blocks / first /
last -> `ppdsl check`, which traces the layout -> lowering) and trains two steps at pp 2 in a
spawned world of 2 (gloo, CPU) against the single-process reference (runtime.verify.compare): loss
within 1e-6, first-step gradients within 1e-5 (relative). check refuses, before launch and
naming why, the classes the trace cannot cut (shared layers, encoder-decoder). At pp 2 x tp 2 a
sample with HF's declared plans and with hand-written rules matches one process too.
The sweep over every class of the installed transformers is benchmarks/own_forward_sweep.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from _exec_harness import equivalence_worker
from dist_harness import run_distributed

transformers = pytest.importorskip("transformers")
_HF_MAJOR = int(transformers.__version__.split(".")[0])

_DECODER = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64)
# HF class -> tiny config: none of them is claimed by a registered family
CASES: dict[str, dict[str, Any]] = {
    "Olmo2ForCausalLM": _DECODER,
    # sliding / full layers by config.layer_types[i]: the stages keep the global block indices
    "Gemma3ForCausalLM": {**_DECODER, "head_dim": 8, "sliding_window": 4,
                          "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]},
    "StableLmForCausalLM": _DECODER,
    "CohereForCausalLM": _DECODER,
    "GlmForCausalLM": {**_DECODER, "head_dim": 8, "pad_token_id": 0, "eos_token_id": 1},
    "StableLmForSequenceClassification": {**_DECODER, "num_labels": 3, "pad_token_id": 0},
}


def spec_text(cls: str, config: dict[str, Any], tp: int = 1, extra: str = "", style: str = "1f1b",
              train: str = "") -> str:
    values = ", ".join(f"{k} = {json.dumps(v)}" for k, v in config.items())
    return f"""ppspec 1
model m {{
  source = hf("{cls}")
  config {{ {values} }}
}}
mesh {{ pp = 2, tp = {tp} }}
pipeline {{ style = {style}, microbatches = 2 {extra}}}
train {{ global_batch = 4, seq_len = 16, steps = 2, optimizer = adamw(lr = 1e-3), data = synthetic(seed = 0){train} }}
"""


def _check(tmp_path: Path, cls: str, config: dict[str, Any], **kw: Any) -> Any:
    from ppdsl.dsl.check import check_file

    path = tmp_path / f"{cls}_{len(list(tmp_path.iterdir()))}.ppspec"
    path.write_text(spec_text(cls, config, **kw), encoding="utf-8")
    return check_file(path, world=2 * kw.get("tp", 1))


# a split-backward schedule with activation checkpointing: the blocks recompute inside the own forward
VARIANTS = {"Gemma3ForCausalLM zbh1 + activation checkpointing":
            ("Gemma3ForCausalLM", dict(style="zbh1", train=", activation_checkpointing = true"))}


def _all_match(names: Any, plans: list[Any], world: int) -> None:
    """Run the plans in one spawned world against one process each: verify OK, loss within 1e-6."""
    reports = run_distributed(equivalence_worker, world, plans, timeout=30 * world + 30 * len(plans))[0]
    for name, (report, _seconds) in zip(names, reports):
        assert report.ok, (name, report.render())
        assert max(abs(a - b) for a, b in report.losses) <= 1e-6, (name, report.losses)


def test_sample_matches_one_process_at_pp2(tmp_path: Path) -> None:
    from ppdsl.lowering.lower import lower

    plans, names = [], []
    runs = [(cls, cls, {}) for cls in CASES] + [(name, cls, kw) for name, (cls, kw) in VARIANTS.items()]
    for name, cls, kw in runs:
        result = _check(tmp_path, cls, CASES[cls], **kw)
        assert result.ok and not result.diagnostics, (name, [f"{d.code} {d.message}" for d in result.diagnostics])
        plan = lower(result.spec, 2, result.model_info)
        assert plan.model.family == "own" and plan.own_forward is not None and plan.blocks == "model.layers", plan
        plans.append(plan)
        names.append(name)
    _all_match(names, plans, 2)


def test_inferred_layout_is_the_traced_one(tmp_path: Path) -> None:
    result = _check(tmp_path, "StableLmForSequenceClassification", CASES["StableLmForSequenceClassification"])
    p = result.spec.pipeline
    assert (p.blocks, p.first, p.last) == ("model.layers", ("model.embed_tokens",), ("model.norm", "score"))


@pytest.mark.parametrize("cls, config, code", [
    ("AlbertForSequenceClassification",
     dict(vocab_size=128, embedding_size=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
          intermediate_size=64, max_position_embeddings=64), "E0422"),
    # a speech model on raw audio: input_values, neither token ids, images nor features with a decoder
    ("Wav2Vec2ForCTC",
     dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=32,
          conv_dim=[16, 16], conv_stride=[5, 2], conv_kernel=[10, 3], num_conv_pos_embeddings=16,
          num_conv_pos_embedding_groups=4), "E0421"),
    # the hidden state is changed between the entries of its layer lists (a norm list beside them)
    ("FlaubertForSequenceClassification",
     dict(vocab_size=128, emb_dim=32, n_layers=4, n_heads=4, dropout=0.0, attention_dropout=0.0), "E0420"),
])
def test_refused_by_check_naming_why(tmp_path: Path, cls: str, config: dict[str, Any], code: str) -> None:
    result = _check(tmp_path, cls, config)
    errors = [d for d in result.diagnostics if d.is_error]
    assert [d.code for d in errors] == [code], [f"{d.code} {d.message}" for d in result.diagnostics]
    assert errors[0].span == result.spec.span("model.source")
    assert cls in errors[0].message
    if code == "E0420":
        assert "'transformer.attentions'" in errors[0].message and "hidden state is changed" in errors[0].message


_SPLIT = {  # hand-written rules for classes that declare no plan (StableLM) or read global head counts (XGLM)
    "StableLmForCausalLM": "model.embed_tokens : vocab\n" + "".join(
        f"model.layers[*].{m} : {s}\n" for m, s in (("self_attn.q_proj", "column"), ("self_attn.k_proj", "column"),
                                                 ("self_attn.v_proj", "column"), ("self_attn.o_proj", "row"),
                                                 ("mlp.gate_proj", "column"), ("mlp.up_proj", "column"),
                                                 ("mlp.down_proj", "row"))) + "lm_head : column\n",
    "XGLMForCausalLM": "".join(f"model.layers[*].self_attn.{m} : {s}\n" for m, s in (
        ("q_proj", "column"), ("k_proj", "column"), ("v_proj", "column"), ("out_proj", "row"))),
    "BloomForCausalLM": "".join(f"transformer.h[*].{m} : {s}\n" for m, s in (
        ("self_attention.query_key_value", "column"), ("self_attention.dense", "row"),
        ("mlp.dense_h_to_4h", "column"), ("mlp.dense_4h_to_h", "row"))),
    "MptForCausalLM": "".join(f"transformer.blocks[*].{m} : {s}\n" for m, s in (
        ("attn.Wqkv", "column(fused = 3)"), ("attn.out_proj", "row"), ("ffn.up_proj", "column"),
        ("ffn.down_proj", "row"))),
    "DebertaV2ForSequenceClassification": "".join(
        f"deberta.encoder.layer[*].{m} : {s}\n" for m, s in (
            ("attention.self.query_proj", "column"), ("attention.self.key_proj", "column"),
            ("attention.self.value_proj", "column"), ("attention.self.pos_key_proj", "column"),
            ("attention.self.pos_query_proj", "column"), ("attention.output.dense", "row"),
            ("intermediate.dense", "column"), ("output.dense", "row"))),
    # Wqkv viewed as (..., 3, heads, head_dim) and unbound: three fused parts (dsl/tp_dataflow.py)
    "ModernBertForSequenceClassification": "".join(f"model.layers[*].{m} : {s}\n" for m, s in (
        ("attn.Wqkv", "column(fused = 3)"), ("attn.Wo", "row"), ("mlp.Wi", "column(fused = 2)"), ("mlp.Wo", "row"))),
    "GPT2ForSequenceClassification": "".join(f"transformer.h[*].{m} : {s}\n" for m, s in (
        ("attn.c_attn", "column(fused = 3)"), ("attn.c_proj", "row"), ("mlp.c_fc", "column"), ("mlp.c_proj", "row"))),
    # multi-query: q | k | v of widths 64, 8, 8 here split apart by the forward (dsl/kv_parts.py)
    "GPTBigCodeForCausalLM": "".join(f"transformer.h[*].{m} : {s}\n" for m, s in (
        ("attn.c_attn", "column(fused = 3)"), ("attn.c_proj", "row"), ("mlp.c_fc", "column"), ("mlp.c_proj", "row"))),
}
# relative positions shared by every block: encoder.rel_embeddings is held by every stage
_DEBERTA = dict(vocab_size=128, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, intermediate_size=64,
                max_position_embeddings=64, num_labels=3, relative_attention=True, pos_att_type=["p2c", "c2p"],
                hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
_BIGCODE = dict(vocab_size=128, n_embd=64, n_layer=4, n_head=8, n_positions=64, multi_query=True, resid_pdrop=0.0,
                embd_pdrop=0.0, attn_pdrop=0.0)
_XGLM = dict(vocab_size=128, d_model=32, ffn_dim=64, num_layers=4, attention_heads=4, max_position_embeddings=64,
             dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
# pp 2 x tp 2: HF's declared plans (Olmo2 gathers q / k / v for its full-width q / k norms; Gemma3's
# per-head norms get partial gradients, summed over tp), and hand-written rules: StableLM with a
# vocab-split embedding and head (vocab-parallel loss) and XGLM, whose attention reads its head
# count and width (the generic rule makes them local: core/own_tp.py)
TP_CASES: dict[str, tuple[str, dict[str, Any], str]] = {
    "Olmo2ForCausalLM": ("Olmo2ForCausalLM", CASES["Olmo2ForCausalLM"], "hf_plan = true"),
    "Gemma3ForCausalLM": ("Gemma3ForCausalLM", CASES["Gemma3ForCausalLM"], "hf_plan = true"),
    "StableLmForCausalLM": ("StableLmForCausalLM", CASES["StableLmForCausalLM"], _SPLIT["StableLmForCausalLM"]),
    "XGLMForCausalLM": ("XGLMForCausalLM", _XGLM, _SPLIT["XGLMForCausalLM"]),
    # ALiBi biases built for every head before the blocks: each rank's attention takes its heads'
    # (core/own_tp.py PER_HEAD_INPUTS); BLOOM's are (batch * heads, 1, keys), MPT's (heads, 1, keys)
    "BloomForCausalLM": ("BloomForCausalLM", dict(vocab_size=128, hidden_size=32, n_layer=4, n_head=4,
                                                  hidden_dropout=0.0, attention_dropout=0.0),
                         _SPLIT["BloomForCausalLM"]),
    "MptForCausalLM": ("MptForCausalLM", dict(vocab_size=128, d_model=32, n_layers=4, n_heads=4, expansion_ratio=2),
                       _SPLIT["MptForCausalLM"]),
    # fewer key/value heads than tp: each rank's query heads read one replicated kv head
    # (core/own_tp.column_parts), in a fused multi-query projection and in a separate k / v one
    "GPTBigCodeForCausalLM": ("GPTBigCodeForCausalLM", _BIGCODE, _SPLIT["GPTBigCodeForCausalLM"]),
    # an attention class a family localises by hand (GPT2Attention) runs the generic rule alone in
    # a class no family claims (split_size is a width)
    "GPT2ForSequenceClassification": ("GPT2ForSequenceClassification",
                                      dict(vocab_size=128, n_embd=32, n_layer=4, n_head=4, n_positions=64, num_labels=3,
                                           pad_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
                                      _SPLIT["GPT2ForSequenceClassification"]),
    "ModernBertForSequenceClassification": ("ModernBertForSequenceClassification",
                                            dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                                 num_attention_heads=4, max_position_embeddings=64, num_labels=3,
                                                 pad_token_id=0, embedding_dropout=0.0, attention_dropout=0.0,
                                                 mlp_dropout=0.0),
                                            _SPLIT["ModernBertForSequenceClassification"]),
    # relative positions every stage holds, and an attention naming its head width attention_head_size
    "DebertaV2ForSequenceClassification": ("DebertaV2ForSequenceClassification", _DEBERTA,
                                           _SPLIT["DebertaV2ForSequenceClassification"]),
    "GraniteForCausalLM": ("GraniteForCausalLM", dict(vocab_size=128, hidden_size=32, intermediate_size=64,
                                                      num_hidden_layers=4, num_attention_heads=4,
                                                      num_key_value_heads=1), "hf_plan = true"),
}


def _tp_spec(cls: str, config: dict[str, Any], split: str) -> str:
    # SGD: Adam's first step (about lr * sign(g)) turns rounding-level differences of near-zero
    # gradient entries into visible parameter differences by the second step
    return spec_text(cls, config, tp=2).replace("adamw(lr = 1e-3)", "sgd(lr = 1e-2)").replace(
        "pipeline {", f"tensor_parallel {{\n{split}\n}}\npipeline {{")


def test_tensor_parallel_matches_one_process_at_pp2_tp2(tmp_path: Path) -> None:
    from ppdsl.dsl.check import check_text
    from ppdsl.lowering.lower import lower

    plans = []
    for name, (cls, config, split) in TP_CASES.items():
        result = check_text(_tp_spec(cls, config, split), f"{name}.ppspec", 4, model=True)
        errors = [f"{d.code} {d.message}" for d in result.diagnostics if d.code != "W0223"]
        assert result.ok and not errors, (name, errors)
        plan = lower(result.spec, 4, result.model_info)
        assert (plan.mesh.pp, plan.mesh.tp, plan.model.family) == (2, 2, "own") and plan.tp, plan
        plans.append(plan)
    _all_match(TP_CASES, plans, 4)


# sequence parallelism of the own forward: the blocks on 1/tp of the sequence between their split
# layers (ppdsl.core.sequence_regions), proven on meta by check and run by the stages
SP_CASES = ("Gemma3ForCausalLM", "StableLmForCausalLM", "XGLMForCausalLM", "BloomForCausalLM", "MptForCausalLM",
            "GPT2ForSequenceClassification", "ModernBertForSequenceClassification")


def test_sequence_parallel_matches_one_process_at_pp2_tp2(tmp_path: Path) -> None:
    from ppdsl.dsl.check import check_text
    from ppdsl.lowering.lower import lower

    plans = []
    for name in SP_CASES:
        cls, config, split = TP_CASES[name]
        result = check_text(_tp_spec(cls, config, split + "\nsequence_parallel = true"), f"{name}.ppspec", 4, model=True)
        errors = [f"{d.code} {d.message}" for d in result.diagnostics if d.code != "W0223"]
        assert result.ok and not errors, (name, errors)
        plan = lower(result.spec, 4, result.model_info)
        assert plan.sequence_parallel and plan.model.family == "own", plan
        assert plan.boundaries[0].tensors[0].shape[1] == plan.train.seq_len // 2, plan.boundaries  # 1/tp of the tokens
        plans.append(plan)
    _all_match(SP_CASES, plans, 4)


def test_sequence_parallel_refusals_name_why(tmp_path: Path) -> None:
    """What check refuses of the own forward's sequence parallelism, each at the spec's
    sequence_parallel line: a key/value head replicated over tp (E0423); a column split in a
    gathered module fed something other than the gathered sequence (DeBERTa's relative embeddings:
    its gradient would be one rank's part; E0426); a module left whole that would run on part of the
    sequence (an MLP, E0215); a gathered column (Olmo2's declared q_proj, E0218)."""
    from ppdsl.dsl.check import check_text

    def refused(text: str) -> Any:
        result = check_text(text, "sp.ppspec", 4, model=True)
        (e,) = [d for d in result.diagnostics if d.is_error]
        return e, result.spec

    sp = "\nsequence_parallel = true"
    e, spec = refused(_tp_spec("GPTBigCodeForCausalLM", _BIGCODE, _SPLIT["GPTBigCodeForCausalLM"] + sp))
    assert e.code == "E0423" and "fewer key/value heads" in e.message, e
    assert e.span == spec.span("tensor_parallel.sequence_parallel"), e
    e, spec = refused(_tp_spec("DebertaV2ForSequenceClassification", _DEBERTA,
                               _SPLIT["DebertaV2ForSequenceClassification"] + sp))
    assert e.code == "E0426" and "pos_key_proj" in e.message, e
    assert e.span == spec.span("tensor_parallel.sequence_parallel"), e
    attention_only = "".join(f"model.layers[*].self_attn.{m} : {s}\n" for m, s in (
        ("q_proj", "column"), ("k_proj", "column"), ("v_proj", "column"), ("o_proj", "row")))
    e, _ = refused(_tp_spec("StableLmForCausalLM", CASES["StableLmForCausalLM"], attention_only + sp))
    assert e.code == "E0215" and "'model.layers.0.mlp'" in e.message, e
    e, _ = refused(_tp_spec("Olmo2ForCausalLM", CASES["Olmo2ForCausalLM"], "hf_plan = true" + sp))
    assert e.code == "E0218", e


def test_tp_refusals_name_why(tmp_path: Path) -> None:
    """A fused output split into unequal parts needs its parts named (E0221); a split layer that is
    not a plain one (Gemma3's scaled embedding) would lose its own forward (E0426)."""
    from ppdsl.dsl.check import check_text

    # a module every stage holds stays whole (E0426 at its rule)
    text = _tp_spec("DebertaV2ForSequenceClassification", _DEBERTA,
                    "deberta.encoder.rel_embeddings : vocab\n" + _SPLIT["DebertaV2ForSequenceClassification"])
    result = check_text(text, "deberta.ppspec", 4, model=True)
    (e,) = [d for d in result.diagnostics if d.is_error]
    assert e.code == "E0426" and "held by every stage" in e.message and e.span.line == 8, e
    # a multi-query c_attn split as one tensor would give each rank a mix of q, k and v (E0221)
    text = _tp_spec("GPTBigCodeForCausalLM", _BIGCODE, _SPLIT["GPTBigCodeForCausalLM"].replace("(fused = 3)", ""))
    result = check_text(text, "bigcode.ppspec", 4, model=True)
    (e,) = [d for d in result.diagnostics if d.is_error]
    assert e.code == "E0221" and "widths 64, 8, 8" in e.message and e.hint.endswith("column(fused = 3)"), e
    text = _tp_spec("Gemma3ForCausalLM", CASES["Gemma3ForCausalLM"], "model.embed_tokens : vocab\nlm_head : column")
    result = check_text(text, "gemma3.ppspec", 4, model=True)
    (e,) = [d for d in result.diagnostics if d.is_error]
    assert e.code == "E0426" and "Gemma3TextScaledWordEmbedding" in e.message, e
    assert e.span is not None and (e.span.line, e.span.column) == (8, 1), e.span


def test_shared_relative_positions_are_held_by_every_stage(tmp_path: Path) -> None:
    """DeBERTa-v2's blocks all take encoder.rel_embeddings' weight, computed from no token: every
    stage holds it (the plan says so) and its gradients are summed over the pipeline ranks, here
    at pp 4 where two ranks hold no end of the model."""
    from ppdsl.dsl.check import check_text
    from ppdsl.lowering.lower import lower
    from ppdsl.views.report import plan_report

    text = spec_text("DebertaV2ForSequenceClassification", _DEBERTA).replace("pp = 2", "pp = 4")
    result = check_text(text, "deberta.ppspec", 4, model=True)
    assert result.ok and not [d for d in result.diagnostics if d.is_error], result.diagnostics
    plan = lower(result.spec, 4, result.model_info)
    assert [a.shared for a in plan.stages] == [("deberta.encoder.rel_embeddings",)] * 4
    assert plan.stages[0].first == ("deberta.embeddings",) and plan.stages[-1].last == ("pooler", "classifier")
    assert "on every stage deberta.encoder.rel_embeddings" in plan_report(plan, result.model_info).render()
    _all_match(["DebertaV2 pp 4"], [plan], 4)
    # FSDP2 cannot shard the one module two stages of a rank share (E0427)
    text = spec_text("DebertaV2ForSequenceClassification", _DEBERTA, style="interleaved", extra=", chunks = 2",
                     train=", zero = 3").replace("pp = 2", "dp = 2, pp = 2").replace("global_batch = 4", "global_batch = 8")
    result = check_text(text, "deberta_zero3.ppspec", 4, model=True)
    assert [d.code for d in result.diagnostics if d.is_error] == ["E0427"], result.diagnostics


def test_a_written_layout_other_than_the_forward_is_refused(tmp_path: Path) -> None:
    result = _check(tmp_path, "Olmo2ForCausalLM", CASES["Olmo2ForCausalLM"],
                    extra=", first = [model.embed_tokens, model.norm], last = [lm_head] ")
    assert [d.code for d in result.diagnostics if d.is_error] == ["E0402"], \
        [f"{d.code} {d.message}" for d in result.diagnostics]


# Classes the own forward got right after check learned to prove the cut: HF's `labels=` loss of
@pytest.mark.parametrize("zero", [pytest.param(1, marks=pytest.mark.slow), 3])  # zero 1: test_train_equivalence
def test_data_parallel_and_zero_with_the_own_forward(tmp_path: Path, zero: int) -> None:
    """dp 2 x pp 2 at world 4: gradient averaging, ZeRO-1's owner step and FSDP2's shards go
    through the same machinery as for the families."""
    from ppdsl.dsl.check import check_file
    from ppdsl.lowering.lower import lower

    path = tmp_path / "olmo2.ppspec"
    path.write_text(spec_text("Olmo2ForCausalLM", CASES["Olmo2ForCausalLM"], train=f", zero = {zero}"), encoding="utf-8")
    result = check_file(path, world=4)
    assert result.ok and not result.diagnostics, [f"{d.code} {d.message}" for d in result.diagnostics]
    plan = lower(result.spec, 4, result.model_info)
    assert (plan.mesh.dp, plan.mesh.pp, plan.train.zero) == (2, 2, zero)
    (report, _seconds), = run_distributed(equivalence_worker, 4, [plan], timeout=120)[0]
    assert report.ok, report.render()
    assert max(abs(a - b) for a, b in report.losses) <= 1e-6, report.losses


# Bart's *ForCausalLM does not shift (the reference computes ppdsl's task loss on the logits, as
# the stages do), a MoE decoder built with eager experts (the plan records it), and Blenderbot,
# whose reference forward must run without a cache, as its stages do.
_BART = dict(vocab_size=128, d_model=32, decoder_layers=4, decoder_attention_heads=4, decoder_ffn_dim=64,
             encoder_layers=1, encoder_attention_heads=4, encoder_ffn_dim=64, max_position_embeddings=64,
             dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=0)
FIXED: dict[str, dict[str, Any]] = {
    "BartForCausalLM": _BART,
    "BlenderbotForCausalLM": _BART,
    "Cohere2MoeForCausalLM": {**_DECODER, "head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2,
                              "pad_token_id": 0},
    # Funnel calls its layers with the hidden state as query, key and value: stage 1's first layer
    # gets the received activation in all three
    "FunnelForSequenceClassification": dict(d_model=32, n_head=4, vocab_size=128, pad_token_id=0, hidden_dropout=0.0,
                                            attention_dropout=0.0, activation_dropout=0.0, num_labels=3),
}


# not in 4.x (Cohere2Moe), or its 4.x forward reads a value check's meta trace cannot give (Funnel: E0424)
_FIXED_IN_5 = {"Cohere2MoeForCausalLM", "FunnelForSequenceClassification"}


def test_newly_fixed_sample_matches_one_process_at_pp2(tmp_path: Path) -> None:
    from ppdsl.lowering.lower import lower

    plans = []
    fixed = {cls: config for cls, config in FIXED.items() if _HF_MAJOR >= 5 or cls not in _FIXED_IN_5}
    for cls, config in fixed.items():
        result = _check(tmp_path, cls, config)
        assert result.ok and not result.diagnostics, (cls, [f"{d.code} {d.message}" for d in result.diagnostics])
        plans.append(lower(result.spec, 2, result.model_info))
    assert all(dict(p.model.config)["experts_implementation"] == "eager" for p in plans)  # the own family's build
    _all_match(fixed, plans, 2)


def test_the_reference_loss_is_the_task_loss_on_the_logits(tmp_path: Path) -> None:
    import torch

    from ppdsl.core.task_loss import causal_lm_loss
    from ppdsl.lowering.lower import lower
    from ppdsl.runtime.stage.build import MicroBatch, build_reference_model
    from ppdsl.runtime.verify.reference_loss import reference_loss

    result = _check(tmp_path, "BartForCausalLM", _BART)
    plan = lower(result.spec, 2, result.model_info)
    model = build_reference_model(plan.model, torch.device("cpu"), 0)
    ids = torch.randint(3, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(input_ids=ids, labels=ids, use_cache=False)
        got = reference_loss(plan, model, MicroBatch(ids, ids))
    assert torch.equal(got, causal_lm_loss(out.logits, ids))
    assert not torch.allclose(got, out.loss)  # HF's own loss for this class does not shift the labels


@pytest.mark.parametrize("cls, config, says", [
    # the last stage's logits drop a position: the loss does not fit the labels
    pytest.param("CsmDepthDecoderForCausalLM", {**_DECODER, "head_dim": 8}, "loss does not fit",
                 marks=pytest.mark.skipif(_HF_MAJOR < 5, reason="4.x's CsmConfig builds no depth decoder alone")),
    # the forward reads a module of each block (its attention), also of those another stage holds
    pytest.param("RwkvForCausalLM", dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4),
                 "another stage holds", marks=pytest.mark.slow),  # RWKV's trace: about 35 s
])
def test_a_cut_that_fails_on_meta_is_refused_by_check(tmp_path: Path, cls: str, config: dict[str, Any],
                                                       says: str) -> None:
    result = _check(tmp_path, cls, config)
    errors = [d for d in result.diagnostics if d.is_error]
    assert [d.code for d in errors] == ["E0425"], [f"{d.code} {d.message}" for d in result.diagnostics]
    assert says in errors[0].message and "at block 2" in errors[0].message


@pytest.mark.slow
def test_the_whole_sweep_matches_or_is_refused(tmp_path: Path) -> None:
    """benchmarks/own_forward_sweep.py over every unclaimed class: each matches one process at
    pp 2 or check refuses it (no run-error, no MISMATCH); at least 150 match."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "table.md"
    subprocess.run([sys.executable, str(root / "benchmarks" / "own_forward_sweep.py"), "--per-class", "120",
                    "--out", str(out)], check=True, cwd=root, env={**os.environ, "OMP_NUM_THREADS": "1"})
    rows = [line.split(" | ") for line in out.read_text().splitlines() if line.startswith("| ") and "---" not in line][1:]
    verdicts = {r[0].lstrip("| "): r[2] for r in rows}  # class | config | verdict | why
    bad = {n: v for n, v in verdicts.items() if v in ("MISMATCH", "run-error")}
    assert not bad, bad
    assert sum(v == "match" for v in verdicts.values()) >= 150, verdicts


def test_hf_plan_on_an_own_forward_class_is_read_from_the_built_model(tmp_path: Path) -> None:
    """Olmo2 declares a tp plan (Olmo2Config.base_model_tp_plan): at tp = 2 hf_plan gives its
    rules as HF writes them (q / k / v gathered), the one entry ppdsl has no style for replicated
    (W0223); never that the class declares none (E0223). StableLM declares none: E0223."""
    from ppdsl.dsl.check import check_file

    text = spec_text("Olmo2ForCausalLM", CASES["Olmo2ForCausalLM"]).replace(
        "pipeline {", "tensor_parallel { hf_plan = true }\npipeline {")
    path = tmp_path / "olmo2_hf_plan.ppspec"
    path.write_text(text, encoding="utf-8")
    one = check_file(path, world=2)
    assert one.ok, [f"{d.code} {d.message}" for d in one.diagnostics]
    path.write_text(text.replace("tp = 1", "tp = 2"), encoding="utf-8")
    two = check_file(path, world=4)
    assert two.ok and [d.code for d in two.diagnostics] == ["W0223"], [f"{d.code} {d.message}" for d in two.diagnostics]
    assert "o_proj (rowwise_split_input)" in two.diagnostics[0].message
    rules = {r.text: (r.style, r.gather_output) for r in two.spec.tensor_parallel.rules}
    assert rules["model.layers[*].self_attn.q_proj"] == ("column", True)
    assert rules["model.layers[*].mlp.down_proj"] == ("row", False)
    path.write_text(text.replace("tp = 1", "tp = 2").replace("Olmo2ForCausalLM", "StableLmForCausalLM"), encoding="utf-8")
    assert [d.code for d in check_file(path, world=4).diagnostics if d.is_error] == ["E0223"]
