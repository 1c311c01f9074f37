"""Check == run at the config written (issue 31): a forward that fails on meta on a shape is E0428
at the config key behind it; a failure of the meta device alone stays note N0219; a config key the
modeling code reads (Qwen2's head_dim) is known. Fast: meta builds of tiny models only."""

from __future__ import annotations

import attrs
import pytest

from ppdsl.dsl.forward_check import meta_failure, meta_only

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from ppdsl.core.build import ModelLoadError, build_model, modeling_config_reads  # noqa: E402
from ppdsl.dsl.check import check_text, load_text  # noqa: E402
from ppdsl.dsl.introspect import introspect  # noqa: E402
from ppdsl.dsl.model_check import check_model  # noqa: E402
from ppdsl.dsl.tp_dataflow import replays_on_cpu  # noqa: E402

_LLAMA_RULES = """\
  model.layers[*].self_attn.q_proj : column
  model.layers[*].self_attn.k_proj : column
  model.layers[*].self_attn.v_proj : column
  model.layers[*].self_attn.o_proj : row
  model.layers[*].mlp.gate_proj : column
  model.layers[*].mlp.up_proj : column
  model.layers[*].mlp.down_proj : row"""
_GPTJ_RULES = """\
  transformer.h[*].attn.q_proj : column
  transformer.h[*].attn.k_proj : column
  transformer.h[*].attn.v_proj : column
  transformer.h[*].attn.out_proj : row
  transformer.h[*].mlp.fc_in : column
  transformer.h[*].mlp.fc_out : row"""
_DECODER = "vocab_size = 128, intermediate_size = 64, num_hidden_layers = 4, max_position_embeddings = 64"
# name -> (class, config lines, rules)
_MODELS = {
    "gptj": ("GPTJForCausalLM", ["vocab_size = 128, n_embd = 32, n_layer = 4, n_positions = 64", "n_head = 4",
                                 "rotary_dim = 4"], _GPTJ_RULES),
    "qwen2": ("Qwen2ForCausalLM", [_DECODER, "hidden_size = 32", "num_attention_heads = 4",
                                   "num_key_value_heads = 2"], _LLAMA_RULES),
    "llama": ("LlamaForCausalLM", [_DECODER, "hidden_size = 32", "num_attention_heads = 4",
                                   "num_key_value_heads = 2"], _LLAMA_RULES),
    # a family's class (its own stages, no own-forward proof)
    "gemma": ("GemmaForCausalLM", [_DECODER, "hidden_size = 32", "num_attention_heads = 4",
                                   "num_key_value_heads = 2", "head_dim = 8"], _LLAMA_RULES),
}


def _spec(name: str, **change: object) -> str:
    """A tiny decoder at pp 2 x tp 2 (one config key a line), with `change`'s values written over."""
    cls, lines, rules = _MODELS[name]
    lines = list(lines)
    for key, value in change.items():
        at = next((i for i, line in enumerate(lines) if line.startswith(f"{key} =")), None)
        if at is None:
            lines.append(f"{key} = {value}")
        else:
            lines[at] = f"{key} = {value}"
    config = "\n".join(f"    {line}" for line in lines)
    return (f'ppspec 1\nmodel {name} {{\n  source = hf("{cls}")\n  config {{\n{config}\n  }}\n}}\n'
            f"mesh {{ tp = 2, pp = 2 }}\ntensor_parallel {{\n{rules}\n}}\n"
            "pipeline { style = 1f1b, microbatches = 4 }\ntrain { global_batch = 4, seq_len = 16 }\n")


def _line_of(text: str, start: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if line.strip().startswith(start))


def test_the_unchanged_decoders_check_ok() -> None:
    for name in _MODELS:
        result = check_text(_spec(name), world=4, model=True)
        assert result.ok and not result.diagnostics, (name, result.diagnostics)


@pytest.mark.parametrize(("name", "change", "key", "rule"), [
    ("gptj", {"rotary_dim": 7}, "rotary_dim", "the rotary dimension must be even and at most head_dim = 8"),
    ("qwen2", {"hidden_size": 64, "num_attention_heads": 12}, "num_attention_heads",
     "the attention heads must divide the hidden size"),
    ("llama", {"num_key_value_heads": 12}, "num_key_value_heads", "key/value heads must divide the attention heads"),
], ids=["gptj_rotary_dim_7", "qwen2_12_heads_over_64", "llama_12_kv_heads_over_4"])
def test_a_forward_that_fails_on_a_shape_is_refused_at_its_config_key(name: str, change: dict, key: str,
                                                                       rule: str) -> None:
    text = _spec(name, **change)
    result = check_text(text, world=4, model=True)
    assert not result.ok
    codes = [d.code for d in result.diagnostics]
    assert codes == ["E0428"], result.diagnostics  # no N0219 beside it: the forward is not "untraceable"
    d = result.diagnostics[0]
    assert d.span.line == _line_of(text, f"{key} =") and rule in d.message, d
    assert "forward fails on meta (RuntimeError: " in d.message, d.message


def test_the_rules_are_judged_only_when_the_forward_fails() -> None:
    """6 heads over a hidden size of 64 breaks 'heads divide hidden', but Qwen2 runs it: heads of
    10 features (q_proj 64 -> 60). Accepted."""
    result = check_text(_spec("qwen2", hidden_size=64, num_attention_heads=6), world=4, model=True)
    assert result.ok and not result.diagnostics, result.diagnostics


def test_a_failure_no_rule_explains_points_at_the_source() -> None:
    text = _spec("gemma")  # a family's class: the own forward's proof runs the forward itself (E0426)
    spec, diags, _ = load_text(text, "<t>")
    assert spec is not None, diags
    info = introspect("hf", "GemmaForCausalLM", dict(spec.model.config), dataflow=True)
    broken = attrs.evolve(info, dataflow=None,
                          dataflow_error="RuntimeError: mat1 and mat2 shapes cannot be multiplied (8x32 and 33x64)")
    found = [d for d in check_model(spec, broken) if d.code in ("E0428", "N0219")]
    assert [d.code for d in found] == ["E0428"], found
    assert found[0].span.line == _line_of(text, "source =") and "mat1 and mat2" in found[0].message
    # the same failure of the meta device alone: the note, which says what is not proven
    meta = attrs.evolve(broken, dataflow_error="NotImplementedError: Could not run 'aten::foo' with arguments "
                                               "from the 'Meta' backend")
    found = [d for d in check_model(spec, meta) if d.code in ("E0428", "N0219")]
    assert [d.code for d in found] == ["N0219"] and "pairing" in found[0].message


def test_a_meta_kernel_stricter_than_the_cpu_one_stays_a_note() -> None:
    """torch's _grouped_mm on meta takes bf16 only; Mixtral's experts call it in float32, which the
    cpu runs: the failed call is run again on cpu, so this is N0219, not E0428."""
    text = _spec("llama").replace("LlamaForCausalLM", "MixtralForCausalLM").replace(
        "num_key_value_heads = 2", "num_key_value_heads = 2\n    num_local_experts = 4, num_experts_per_tok = 2")
    text = "\n".join(line for line in text.splitlines() if "mlp." not in line) + "\n"
    result = check_text(text, world=4, model=True)
    assert result.ok, result.diagnostics
    assert all(d.code != "E0428" for d in result.diagnostics), result.diagnostics


def test_replaying_a_failed_call_on_cpu() -> None:
    def meta_kernel_only_fails(x: torch.Tensor) -> torch.Tensor:
        if x.is_meta:
            raise RuntimeError("Expected inputs of BF16 type")
        return x * 2

    x = torch.empty(4, 8, device="meta")
    assert replays_on_cpu(meta_kernel_only_fails, (x,), {})
    assert not replays_on_cpu(torch.matmul, (x, torch.empty(9, 2, device="meta")), {})  # a shape: fails on cpu too
    assert not replays_on_cpu(torch.matmul, (torch.zeros(4, 8), torch.zeros(9, 2)), {})  # nothing on meta


def test_meta_only_failures_by_their_text() -> None:
    assert meta_only("NotImplementedError: Could not run 'aten::nonzero' with arguments from the 'Meta' backend")
    assert meta_only("RuntimeError: Tensor.item() cannot be called on meta tensors")
    assert meta_only("MetaOnlyFailure: RuntimeError: Expected inputs of BF16 type (on meta; the same _grouped_mm "
                     "runs on cpu)")
    assert not meta_only("RuntimeError: The size of tensor a (7) must match the size of tensor b (8) at non-singleton "
                         "dimension 3")
    assert not meta_only("RuntimeError: Attempting to broadcast a dimension of length 8 at -1!")
    assert meta_failure("MetaOnlyFailure: RuntimeError: x") == "RuntimeError: x"


def test_a_python_factory_forward_is_not_what_runs() -> None:
    """ppdsl runs a factory's modules in order: a failure of its forward stays the note."""
    from ppdsl.dsl.forward_check import forward_refused

    spec, diags, _ = load_text(_spec("gptj"), "<t>")
    assert spec is not None, diags
    info = introspect("hf", "GPTJForCausalLM", dict(spec.model.config))
    info = attrs.evolve(info, dataflow=None, dataflow_error="RuntimeError: The size of tensor a (7) must match")
    assert forward_refused(spec, info)
    python = attrs.evolve(spec, model=attrs.evolve(spec.model, source=attrs.evolve(spec.model.source, kind="python")))
    assert not forward_refused(python, info)


# ---- a config key the modeling code reads is known ------------------------------------------


def test_head_dim_read_by_qwen2s_modeling_code_is_a_known_key() -> None:
    import transformers

    assert "head_dim" not in transformers.Qwen2Config.__init__.__code__.co_varnames
    assert "head_dim" in modeling_config_reads(transformers.Qwen2Config)
    model = build_model("hf", "Qwen2ForCausalLM", {"hidden_size": 64, "num_attention_heads": 4,
                                                   "num_key_value_heads": 2, "head_dim": 32, "num_hidden_layers": 1,
                                                   "vocab_size": 128, "intermediate_size": 64})
    assert tuple(model.model.layers[0].self_attn.q_proj.weight.shape) == (128, 64)


def test_a_keyword_the_config_moves_into_rope_parameters_is_known_where_the_model_reads_it() -> None:
    """transformers 5 takes partial_rotary_factor out of the keywords into rope_parameters, where
    Phi's modeling code reads it; BERT's reads no rotary fraction, so the key stays unknown there."""
    import transformers

    if not hasattr(transformers.PhiConfig(), "rope_parameters"):
        pytest.skip("this transformers keeps partial_rotary_factor a config attribute")
    model = build_model("hf", "PhiForCausalLM", {"hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 1,
                                                 "vocab_size": 128, "intermediate_size": 64,
                                                 "partial_rotary_factor": 0.25})
    assert model.config.rope_parameters["partial_rotary_factor"] == 0.25
    assert model.model.layers[0].self_attn.rotary_ndims == 2
    with pytest.raises(ModelLoadError, match="unknown config key 'partial_rotary_factor' for BertConfig"):
        build_model("hf", "BertForMaskedLM", {"hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 1,
                                              "partial_rotary_factor": 0.25})


@pytest.mark.parametrize("name", ["qwen2", "llama"])
def test_a_decoder_that_sets_head_dim_checks_ok(name: str) -> None:
    """Heads of 32 features over a hidden size of 64 (q_proj 64 -> 128), split over tp = 2."""
    result = check_text(_spec(name, hidden_size=64, head_dim=32), world=4, model=True)
    assert result.ok and not result.diagnostics, result.diagnostics


def test_a_typo_still_gets_did_you_mean() -> None:
    with pytest.raises(ModelLoadError, match="unknown config key 'head_dm' for Qwen2Config; did you mean 'head_dim'"):
        build_model("hf", "Qwen2ForCausalLM", {"head_dm": 32})
    result = check_text(_spec("qwen2", hidden_sise=64), world=4, model=True)
    assert [d.code for d in result.diagnostics] == ["E0401"]
    assert "did you mean 'hidden_size'" in result.diagnostics[0].message
