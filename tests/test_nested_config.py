"""Nested config blocks (issue 32, item 6): `config { text_config { ... } }`, at any depth.

The parse, resolve, `--set`, plan and cache-key tests are pure Python; the build tests read the
config classes of the installed transformers (configs only: no model is built, except the one
`ppdsl check` run)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ppdsl.core.config_tree import FrozenDict, deep_merge, frozen, leaves, thawed
from ppdsl.dsl import ast
from ppdsl.dsl.check import check_text
from ppdsl.dsl.model_facts_cache import facts_key
from ppdsl.dsl.parse import parse
from ppdsl.lowering.lower import lower
from ppdsl.lowering.plan import Plan

ROOT = Path(__file__).resolve().parent.parent
HAVE_HF = importlib.util.find_spec("torch") is not None and importlib.util.find_spec("transformers") is not None
needs_hf = pytest.mark.skipif(not HAVE_HF, reason="needs torch and transformers")

BLIP2 = """ppspec 1
model blip2 {
  source = hf("Blip2ForConditionalGeneration")
  config {
    num_query_tokens = 4
    text_config {
      vocab_size = 128, hidden_size = 64, word_embed_proj_dim = 64, ffn_dim = 128
      num_hidden_layers = 2, num_attention_heads = 4, max_position_embeddings = 64
    }
    vision_config { hidden_size = 32, intermediate_size = 64, num_hidden_layers = 1, num_attention_heads = 4 }
    qformer_config { hidden_size = 32, intermediate_size = 64, num_hidden_layers = 1, encoder_hidden_size = 32 }
  }
}
train { global_batch = 4, seq_len = 16 }
"""


def _spec(config: str, source: str = 'hf("GPT2LMHeadModel")') -> str:
    return f"ppspec 1\nmodel m {{\n  source = {source}\n  config {{\n{config}\n  }}\n}}\ntrain {{ global_batch = 4, seq_len = 16 }}\n"


def _codes(result) -> list[tuple[str, int, int]]:
    return [(d.code, d.span.line, d.span.column) for d in result.diagnostics if d.is_error]


# ---- parse ----------------------------------------------------------------------------------


def test_nested_blocks_parse_with_positions_at_any_depth() -> None:
    doc = parse("model m {\n  config {\n    a { b { c = 1 }\n      d = 2 }\n  }\n}\n", "f")
    config = doc.items[0].entries[0]
    a = config.entries[0]
    assert isinstance(a, ast.Block) and a.kind == "a" and (a.kind_span.line, a.kind_span.column) == (3, 5)
    assert (a.span.end_line, a.span.end_column) == (4, 14)
    b, d = a.entries
    assert isinstance(b, ast.Block) and (b.kind_span.line, b.kind_span.column) == (3, 9)
    c = b.entries[0]
    assert isinstance(c, ast.Assign) and c.key == "c" and (c.key_span.line, c.key_span.column) == (3, 13)
    assert isinstance(d, ast.Assign) and (d.span.line, d.span.column) == (4, 7)


# ---- resolve ----------------------------------------------------------------------------------


def test_resolve_gives_nested_dicts_and_a_span_per_key() -> None:
    r = check_text(BLIP2, "s.ppspec")
    assert r.ok, r.diagnostics
    cfg = r.spec.model.config
    assert cfg["num_query_tokens"] == 4
    assert cfg["text_config"]["num_hidden_layers"] == 2 and cfg["vision_config"]["hidden_size"] == 32
    spans = r.spec.spans
    assert (spans["model.config.text_config"].line, spans["model.config.text_config"].column) == (6, 5)
    at = spans["model.config.text_config.num_hidden_layers"]
    assert (at.line, at.column) == (8, 7)
    assert r.spec.model.resolved_config["text_config"]["ffn_dim"] == 128


def test_values_in_a_block_refer_to_its_own_keys() -> None:
    r = check_text(_spec("    n_layer = 2\n    a { h = 64, heads = 4, head_dim = h / heads\n      b { x = 2 * 3 } }"))
    assert r.ok, r.diagnostics
    assert r.spec.model.config["a"] == {"h": 64, "heads": 4, "head_dim": 16, "b": {"x": 6}}


@pytest.mark.parametrize("config, code, line, column, message", [
    ("    a { x = n_layer }", "E0105", 5, 13, "unknown name 'n_layer' in config block 'a'"),
    ("    a { x = y, y = x }", "E0105", 5, 13, "is defined in terms of itself"),
    ("    a { x = 1 }\n    a { x = 2 }", "E0104", 6, 5, "config key 'a' is given twice"),
    ("    a = 1\n    a { x = 2 }", "E0104", 6, 5, "config key 'a' is given twice"),
    ("    a { x = 1, x = 2 }", "E0104", 5, 16, "config key 'a.x' is given twice"),
    ("    a lbl { x = 1 }", "E0101", 5, 5, "config block 'a' takes no name"),
    ("    a { require 1 > 0 }", "E0101", 5, 9, "config block 'a' holds `key = value` entries and `key { ... }` blocks only"),
    ("    a { b { x = f(1) } }", "E0103", 5, 17, "a call 'f(...)' is not a config value"),
])
def test_malformed_nested_blocks_are_diagnostics(config: str, code: str, line: int, column: int, message: str) -> None:
    r = check_text(_spec(config))
    found = [d for d in r.diagnostics if d.code == code]
    assert found and (found[0].span.line, found[0].span.column) == (line, column), r.diagnostics
    assert message in found[0].message


def test_config_domain_reads_nested_values() -> None:
    r = check_text(_spec("    text_config { vocab_size = 0\n      vision { drop_path_rate = 2.0 } }"))
    found = {(d.code, d.span.line, d.span.column, d.message.split(" ")[0]) for d in r.diagnostics if d.is_error}
    assert found == {("E0432", 5, 19, "text_config.vocab_size"), ("E0432", 6, 16, "text_config.vision.drop_path_rate")}


# ---- --set --------------------------------------------------------------------------------------


def test_set_reaches_a_nested_key_and_adds_missing_blocks() -> None:
    r = check_text(BLIP2, "s.ppspec", overrides=["model.config.text_config.num_hidden_layers=8",
                                                  "model.config.text_config.extra { }".replace(" { }", "=1"),
                                                  "model.config.vision_config.sub.deep=3"])
    assert r.ok, r.diagnostics
    text = r.spec.model.config["text_config"]
    assert text["num_hidden_layers"] == 8 and text["hidden_size"] == 64 and text["extra"] == 1
    assert r.spec.model.config["vision_config"]["sub"] == {"deep": 3}
    assert r.spec.model.config["vision_config"]["hidden_size"] == 32


def test_set_diagnostics_point_into_the_option() -> None:
    option = "model.config.vision_config.attention_dropout=1.5"
    r = check_text(BLIP2, "s.ppspec", overrides=[option])
    d, = [d for d in r.diagnostics if d.is_error]
    assert d.code == "E0432" and d.span.file == f"--set {option}"
    assert d.span.column == len("--set model.config.vision_config.") + 1


# ---- the plan and the facts cache -----------------------------------------------------------------


def test_the_plan_holds_nested_blocks_hashable_and_round_trips() -> None:
    # a family's class: lowered without the model (the own forward's would need check's trace)
    r = check_text(_spec("    num_hidden_layers = 2, hidden_size = 64, num_attention_heads = 4\n"
                         "    task_specific_params { s { x = [1, 2] } }", 'hf("FalconForCausalLM")'), world=1)
    assert r.ok, r.diagnostics
    plan = lower(r.spec, 1)
    block = plan.model.config_dict["task_specific_params"]
    assert isinstance(block, FrozenDict) and block == {"s": {"x": (1, 2)}}
    hash(plan)
    again = Plan.from_json(json.loads(plan.dumps()))
    assert again == plan and hash(again) == hash(plan)
    assert thawed(again.model.config_dict["task_specific_params"]) == {"s": {"x": [1, 2]}}
    with pytest.raises(TypeError):
        block["s"] = 1  # type: ignore[index]


def test_the_facts_cache_key_holds_nested_values() -> None:
    key = lambda config: json.dumps(facts_key("hf", "Blip2ForConditionalGeneration", config), sort_keys=True)  # noqa: E731
    a = key({"text_config": {"num_hidden_layers": 2, "hidden_size": 64}})
    assert a == key({"text_config": {"hidden_size": 64, "num_hidden_layers": 2}})  # order changes nothing
    assert a != key({"text_config": {"num_hidden_layers": 3, "hidden_size": 64}})
    assert a != key({"vision_config": {"num_hidden_layers": 2, "hidden_size": 64}})


def test_config_tree_helpers() -> None:
    assert deep_merge({"a": {"x": 1, "y": 2}, "b": 1}, {"a": {"y": 3}, "c": 2}) == {"a": {"x": 1, "y": 3}, "b": 1, "c": 2}
    assert list(leaves({"a": {"x": 1, "b": {"y": 2}}, "z": 3})) == [(("a", "x"), 1), (("a", "b", "y"), 2), (("z",), 3)]
    assert frozen({"a": [1, {"b": [2]}]}) == {"a": (1, {"b": (2,)})}


# ---- the LSP ----------------------------------------------------------------------------------------


def test_completion_lists_the_sub_config_keys() -> None:
    from ppdsl.lsp.features import config_keys_at

    built = {"num_query_tokens": 32, "text_config": {"hidden_size": 64, "rope": {"theta": 1.0}}}
    assert config_keys_at(built, ("model", "config")) is built
    assert set(config_keys_at(built, ("model", "config", "text_config"))) == {"hidden_size", "rope"}
    assert config_keys_at(built, ("model", "config", "text_config", "rope")) == {"theta": 1.0}
    assert config_keys_at(built, ("model", "config", "num_query_tokens")) == {}


def test_completion_inside_a_nested_block() -> None:
    pytest.importorskip("lsprotocol")
    from ppdsl.lsp.features import completions
    from ppdsl.lsp.model_view import ModelView

    view = ModelView(None, None, "Blip2ForConditionalGeneration", {},  # type: ignore[arg-type]
                     {"num_query_tokens": 32, "text_config": {"hidden_size": 64, "ffn_dim": 3}}, Path("x"), {})
    text = ('ppspec 1\nmodel m {\n  source = hf("Blip2ForConditionalGeneration")\n  config {\n'
            '    text_config {\n      \n    }\n    \n  }\n}\n')
    _, inner = completions(text, 5, 6, view)
    assert [(i.label, i.insert_text) for i in inner] == [("hidden_size", "hidden_size = "), ("ffn_dim", "ffn_dim = ")]
    _, outer = completions(text, 7, 4, view)
    assert ("text_config", "text_config { }") in [(i.label, i.insert_text) for i in outer]


# ---- building the config (transformers) ---------------------------------------------------------


def _hf_config(target: str, config: dict):
    from ppdsl.core import build

    cls = getattr(__import__("transformers"), target)
    flat, blocks = build._nested(config)
    build._check_config_keys(cls.config_class, config, cls)
    return cls.config_class(**flat, **build._with_blocks(cls.config_class, build._default_config(cls.config_class), blocks))


@needs_hf
def test_a_nested_block_updates_the_sub_config_and_keeps_the_class_defaults() -> None:
    cfg = _hf_config("LlavaForConditionalGeneration",
                     {"text_config": {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4},
                      "vision_config": {"num_hidden_layers": 3}})
    assert cfg.text_config.num_hidden_layers == 2 and cfg.text_config.hidden_size == 64
    assert cfg.text_config.head_dim == 16  # derived again from the values given, not LLaMA's 128
    assert cfg.text_config.intermediate_size == 11008  # LlamaConfig's default, kept
    # LLaVA's own vision tower (a CLIP of 336 px, 1024 wide), not CLIPVisionConfig's defaults
    assert cfg.vision_config.num_hidden_layers == 3
    assert (cfg.vision_config.image_size, cfg.vision_config.hidden_size) == (336, 1024)


@needs_hf
def test_blip2_sub_configs_and_a_model_type_that_changes_the_class() -> None:
    cfg = _hf_config("Blip2ForConditionalGeneration",
                     {"num_query_tokens": 4, "text_config": {"model_type": "llama", "hidden_size": 64,
                                                             "num_attention_heads": 4},
                      "qformer_config": {"num_hidden_layers": 1}})
    assert type(cfg.text_config).__name__ == "LlamaConfig" and cfg.text_config.hidden_size == 64
    assert cfg.qformer_config.num_hidden_layers == 1 and cfg.num_query_tokens == 4


@needs_hf
def test_a_dict_valued_key_takes_a_block_too() -> None:
    cfg = _hf_config("LlamaForCausalLM", {"num_hidden_layers": 1, "rope_parameters": {"rope_theta": 500.0}})
    assert cfg.rope_parameters["rope_theta"] == 500.0 and cfg.rope_parameters["rope_type"] == "default"


@needs_hf
@pytest.mark.parametrize("config, code, key, message", [
    ({"text_config": {"num_hiden_layers": 2}}, "E0401", ("text_config", "num_hiden_layers"),
     "unknown config key 'num_hiden_layers' for OPTConfig (in text_config); did you mean 'num_hidden_layers'?"),
    ({"text_confg": {"num_hidden_layers": 2}}, "E0401", ("text_confg",), "did you mean 'text_config'?"),
    ({"num_query_tokens": {"x": 1}}, "E0434", ("num_query_tokens",), "is not a sub-config of Blip2Config"),
    ({"text_config": {"model_type": "lama"}}, "E0401", ("text_config", "model_type"), "did you mean 'llama'?"),
])
def test_build_errors_name_the_nested_key(config: dict, code: str, key: tuple, message: str) -> None:
    from ppdsl.core.build import ModelLoadError

    with pytest.raises(ModelLoadError) as exc:
        _hf_config("Blip2ForConditionalGeneration", config)
    assert (exc.value.code, exc.value.key) == (code, key) and message in str(exc.value)


@needs_hf
def test_hf_pretrained_nested_block_keeps_the_files_values(tmp_path: Path) -> None:
    from transformers import LlavaConfig

    from ppdsl.core.build import _build_hf_pretrained, quiet_transformers

    with quiet_transformers():
        LlavaConfig(text_config={"model_type": "llama", "num_hidden_layers": 1, "hidden_size": 32,
                                 "intermediate_size": 64, "num_attention_heads": 4, "vocab_size": 64},
                    vision_config={"num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64,
                                   "num_attention_heads": 4, "image_size": 28, "patch_size": 14},
                    architectures=["LlavaForConditionalGeneration"]).save_pretrained(tmp_path)
    _, cfg = _build_hf_pretrained(str(tmp_path), {"text_config": {"num_hidden_layers": 2}}, "meta")
    assert cfg["text_config"]["num_hidden_layers"] == 2
    assert cfg["text_config"]["hidden_size"] == 32 and cfg["text_config"]["vocab_size"] == 64  # the file's
    assert cfg["vision_config"]["image_size"] == 28


@needs_hf
def test_check_with_nested_blocks_prints_no_traceback(tmp_path: Path) -> None:
    spec = tmp_path / "blip2.ppspec"
    spec.write_text(BLIP2)
    env = {**os.environ, "PPDSL_NO_CACHE": "1", "OMP_NUM_THREADS": "1"}
    for extra in ([], ["--set", "model.config.text_config.num_hidden_layers=3"],
                  ["--set", "model.config.text_config.num_hiden_layers=3"]):
        out = subprocess.run([sys.executable, "-m", "ppdsl", "check", str(spec), *extra], capture_output=True,
                             text=True, env=env, cwd=ROOT, timeout=300)
        assert "Traceback" not in out.stdout + out.stderr, out.stderr
        assert out.returncode in (0, 2), out.stderr
    assert "did you mean 'num_hidden_layers'" in out.stdout + out.stderr
