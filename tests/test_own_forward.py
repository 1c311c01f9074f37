"""HF classes no family claims run their own forward as pipeline stages (core/families/own/).

A sample of such classes goes through the real front end (spec text without blocks / first /
last -> `ppdsl check`, which traces the layout -> lowering) and trains two steps at pp 2 in a
spawned world of 2 (gloo, CPU) against the single-process reference (runtime.verify): loss
within 1e-6, first-step gradients within 1e-5 (relative). check refuses, before launch and
naming why, the classes the trace cannot cut (shared layers, encoder-decoder) and tp > 1.
The sweep over every class of the installed transformers is benchmarks/own_forward_sweep.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from _exec_harness import equivalence_worker
from dist_harness import run_distributed

pytest.importorskip("transformers")

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
    reports = run_distributed(equivalence_worker, 2, plans, timeout=60 + 30 * len(plans))[0]
    for cls, (report, _seconds) in zip(names, reports):
        assert report.ok, (cls, report.render())
        assert max(abs(a - b) for a, b in report.losses) <= 1e-6, (cls, report.losses)


def test_inferred_layout_is_the_traced_one(tmp_path: Path) -> None:
    result = _check(tmp_path, "StableLmForSequenceClassification", CASES["StableLmForSequenceClassification"])
    p = result.spec.pipeline
    assert (p.blocks, p.first, p.last) == ("model.layers", ("model.embed_tokens",), ("model.norm", "score"))


@pytest.mark.parametrize("cls, config, code", [
    ("AlbertForSequenceClassification",
     dict(vocab_size=128, embedding_size=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
          intermediate_size=64, max_position_embeddings=64), "E0422"),
    ("T5ForConditionalGeneration",
     dict(num_layers=2, num_decoder_layers=2, d_model=32, d_ff=64, num_heads=4, d_kv=8, vocab_size=128), "E0421"),
])
def test_refused_by_check_naming_why(tmp_path: Path, cls: str, config: dict[str, Any], code: str) -> None:
    result = _check(tmp_path, cls, config)
    errors = [d for d in result.diagnostics if d.is_error]
    assert [d.code for d in errors] == [code], [f"{d.code} {d.message}" for d in result.diagnostics]
    assert errors[0].span == result.spec.span("model.source")
    assert cls in errors[0].message


def test_tp_is_refused_by_check(tmp_path: Path) -> None:
    result = _check(tmp_path, "Olmo2ForCausalLM", CASES["Olmo2ForCausalLM"], tp=2)
    codes = [d.code for d in result.diagnostics if d.is_error]
    assert "E0423" in codes, [f"{d.code} {d.message}" for d in result.diagnostics]
    assert next(d for d in result.diagnostics if d.code == "E0423").span == result.spec.span("mesh.tp")


def test_a_written_layout_other_than_the_forward_is_refused(tmp_path: Path) -> None:
    result = _check(tmp_path, "Olmo2ForCausalLM", CASES["Olmo2ForCausalLM"],
                    extra=", first = [model.embed_tokens, model.norm], last = [lm_head] ")
    assert [d.code for d in result.diagnostics if d.is_error] == ["E0402"], \
        [f"{d.code} {d.message}" for d in result.diagnostics]
