"""Model introspection on the meta device (ppdsl.dsl.introspect)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from ppdsl.core.build import ModelLoadError, build_model  # noqa: E402
from ppdsl.dsl.introspect import ModelInfo, block_paths, introspect, params_under  # noqa: E402

GPT2_SMALL_PARAMS = 124_439_808  # wte tied to lm_head, counted once


@pytest.fixture(scope="module")
def gpt2() -> ModelInfo:
    return introspect("hf", "GPT2LMHeadModel", {"n_layer": 12, "n_embd": 768, "n_head": 12})


# ---- GPT-2 ----------------------------------------------------------------------------------


def test_gpt2_conv1d_shapes(gpt2: ModelInfo) -> None:
    c_attn = gpt2.modules["transformer.h.0.attn.c_attn"]
    assert (c_attn.type_name, c_attn.kind) == ("Conv1D", "conv1d")
    assert (c_attn.in_features, c_attn.out_features, c_attn.has_bias) == (768, 2304, True)
    c_proj = gpt2.modules["transformer.h.11.mlp.c_proj"]
    assert (c_proj.in_features, c_proj.out_features) == (3072, 768)


def test_gpt2_embeddings_and_norms(gpt2: ModelInfo) -> None:
    wte = gpt2.modules["transformer.wte"]
    assert (wte.kind, wte.num_embeddings, wte.embedding_dim) == ("embedding", 50257, 768)
    assert gpt2.modules["transformer.ln_f"].kind == "norm"
    assert gpt2.modules["transformer.h"].kind == "container"
    assert gpt2.modules["transformer.h.3"].type_name == "GPT2Block"
    assert gpt2.modules[""].children == ("transformer", "lm_head")


def test_gpt2_tied_counted_once(gpt2: ModelInfo) -> None:
    assert gpt2.tied == (("transformer.wte.weight", "lm_head.weight"),)
    assert gpt2.total_params == GPT2_SMALL_PARAMS
    assert sum(m.num_params for m in gpt2.modules.values()) == GPT2_SMALL_PARAMS
    lm_head = gpt2.modules["lm_head"]
    assert (lm_head.kind, lm_head.out_features, lm_head.num_params) == ("linear", 50257, 0)
    assert gpt2.modules["transformer.wte"].param_bytes == 50257 * 768 * 4


def test_gpt2_config_and_helpers(gpt2: ModelInfo) -> None:
    assert gpt2.class_name == "GPT2LMHeadModel"
    assert gpt2.config["n_embd"] == 768
    assert gpt2.config["hidden_size"] == 768  # attribute-map alias added
    assert gpt2.config["model_type"] == "gpt2"
    blocks = block_paths(gpt2, "transformer.h")
    assert blocks == [f"transformer.h.{i}" for i in range(12)]
    per_block = params_under(gpt2, "transformer.h.0")
    assert per_block == 7_087_872
    assert params_under(gpt2, "transformer.h") == 12 * per_block
    assert params_under(gpt2, "") == GPT2_SMALL_PARAMS
    assert params_under(gpt2, "lm_head") == 0


def test_block_paths_errors(gpt2: ModelInfo) -> None:
    with pytest.raises(ValueError, match="GPT2Block"):
        block_paths(gpt2, "transformer.h.0")
    with pytest.raises(KeyError, match="did you mean 'transformer.h'"):
        block_paths(gpt2, "transformer.hh")
    with pytest.raises(KeyError):
        params_under(gpt2, "nope")


def test_gpt2_is_fast_after_import(gpt2: ModelInfo) -> None:
    import time

    start = time.perf_counter()
    introspect("hf", "GPT2LMHeadModel", {})
    assert time.perf_counter() - start < 1.0


def test_build_model_is_on_meta() -> None:
    model = build_model("hf", "GPT2LMHeadModel", {"n_layer": 2})
    assert all(p.is_meta for p in model.parameters())
    assert model.lm_head.weight is model.transformer.wte.weight
    assert model.config._attn_implementation == "eager"


# ---- BERT, Llama ----------------------------------------------------------------------------


def test_bert_classifier_labels() -> None:
    info = introspect("hf", "BertForSequenceClassification", {"num_labels": 3})
    classifier = info.modules["classifier"]
    assert (classifier.kind, classifier.in_features, classifier.out_features) == ("linear", 768, 3)
    query = info.modules["bert.encoder.layer.11.attention.self.query"]
    assert (query.in_features, query.out_features) == (768, 768)
    assert block_paths(info, "bert.encoder.layer")[-1] == "bert.encoder.layer.11"
    assert len(info.config["id2label"]) == 3  # type: ignore[arg-type]


def test_llama_gqa_kv_projection() -> None:
    config = {
        "num_hidden_layers": 2,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "vocab_size": 1000,
    }
    info = introspect("hf", "LlamaForCausalLM", config)
    head_dim = 256 // 8
    assert info.modules["model.layers.0.self_attn.q_proj"].out_features == 256
    assert info.modules["model.layers.0.self_attn.k_proj"].out_features == 2 * head_dim
    assert info.modules["model.layers.1.self_attn.v_proj"].out_features == 2 * head_dim
    assert info.modules["model.norm"].kind == "norm"
    assert info.modules["model.rotary_emb"].num_params == 0
    assert info.tied == ()
    assert info.config["num_key_value_heads"] == 2
    assert info.config["head_dim"] == head_dim


# ---- hf_pretrained --------------------------------------------------------------------------


def _write_gpt2_dir(path: Path) -> Path:
    config = {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "n_layer": 2,
        "n_embd": 64,
        "n_head": 4,
        "n_positions": 32,
        "vocab_size": 100,
    }
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_hf_pretrained_local_dir(tmp_path: Path) -> None:
    model_dir = _write_gpt2_dir(tmp_path / "tiny-gpt2")
    info = introspect("hf_pretrained", str(model_dir), {})
    assert info.class_name == "GPT2LMHeadModel"
    assert block_paths(info, "transformer.h") == ["transformer.h.0", "transformer.h.1"]
    assert info.modules["transformer.wte"].num_embeddings == 100

    overridden = introspect("hf_pretrained", str(model_dir), {"n_layer": 3})
    assert len(block_paths(overridden, "transformer.h")) == 3


def test_hf_pretrained_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not a local directory"):
        introspect("hf_pretrained", str(tmp_path / "missing"), {})
    with pytest.raises(ModelLoadError, match="has no config.json"):
        introspect("hf_pretrained", str(tmp_path), {})
    model_dir = _write_gpt2_dir(tmp_path / "tiny-gpt2")
    with pytest.raises(ModelLoadError, match="did you mean 'n_layer'"):
        introspect("hf_pretrained", str(model_dir), {"n_layers": 3})


# ---- python factories -----------------------------------------------------------------------


def test_python_factory_decoder() -> None:
    info = introspect(
        "python", "ppdsl.models.decoder:build_decoder", {"n_layers": 3, "dim": 32, "n_heads": 4}
    )
    assert info.class_name == "Decoder"
    assert info.config == {}
    assert block_paths(info, "layers") == ["layers.0", "layers.1", "layers.2"]
    wq = info.modules["layers.0.attention.wq"]
    assert (wq.kind, wq.in_features, wq.out_features, wq.has_bias) == ("linear", 32, 32, False)
    assert info.modules["layers.2.feed_forward.w1"].out_features == 128
    assert info.modules["tok_embeddings"].num_embeddings == 512
    assert info.modules["norm"].kind == "norm"
    assert info.total_params == sum(m.num_params for m in info.modules.values())


def test_python_factory_builds_on_meta() -> None:
    model = build_model("python", "ppdsl.models.decoder:build_decoder", {"n_layers": 1})
    assert all(p.is_meta for p in model.parameters())


# ---- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "target", "config", "message"),
    [
        ("hf", "GPT2LMHeadModle", {}, "no class 'GPT2LMHeadModle'; did you mean 'GPT2LMHeadModel'"),
        ("hf", "BertTokenizer", {}, "not a model class"),
        ("hf", "AutoModelForCausalLM", {}, "name a concrete model class"),
        (
            "hf",
            "GPT2LMHeadModel",
            {"n_layers": 3},
            r"unknown config key 'n_layers' for GPT2Config; did you mean 'n_layer'\?",
        ),
        ("hf", "GPT2LMHeadModel", {"n_embd": 100}, "cannot build GPT2LMHeadModel"),
        ("python", "ppdsl.models.decoder", {}, "must look like 'pkg.module:callable'"),
        ("python", "ppdsl_no_such_pkg.models:build", {}, "cannot import 'ppdsl_no_such_pkg.models'"),
        ("python", "ppdsl.models.decoder:build_decodr", {}, "did you mean 'build_decoder'"),
        (
            "python",
            "ppdsl.models.decoder:build_decoder",
            {"n_layer": 2},
            "unknown argument 'n_layer'.*did you mean 'n_layers'",
        ),
        ("python", "ppdsl.models.decoder:build_decoder", {"dim": 66}, "raised ValueError"),
        ("python", "ppdsl.models.decoder:INIT_STD", {}, "not callable"),
        ("pytorch", "x", {}, "unknown model source kind"),
    ],
)
def test_load_errors(kind: str, target: str, config: dict[str, object], message: str) -> None:
    with pytest.raises(ModelLoadError, match=message):
        introspect(kind, target, config)


def test_python_factory_module_that_fails_to_import(tmp_path: Path) -> None:
    (tmp_path / "ppdsl_broken_factory.py").write_text("import torch\nraise RuntimeError('boom')\n")
    with pytest.raises(ModelLoadError, match="cannot import 'ppdsl_broken_factory'.*boom"):
        introspect("python", "ppdsl_broken_factory:build", {}, search_paths=[str(tmp_path)])
    assert str(tmp_path) not in sys.path


def test_python_factory_from_search_path(tmp_path: Path) -> None:
    (tmp_path / "ppdsl_user_factory.py").write_text(
        textwrap.dedent(
            """
            import torch

            def build(width: int = 4):
                return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, 2))

            def not_a_module():
                return 42
            """
        )
    )
    info = introspect("python", "ppdsl_user_factory:build", {"width": 8}, search_paths=[str(tmp_path)])
    assert block_paths(info, "") == ["0", "1"]
    assert info.modules["1"].out_features == 2
    with pytest.raises(ModelLoadError, match="returned a int"):
        introspect("python", "ppdsl_user_factory:not_a_module", {}, search_paths=[str(tmp_path)])


def test_import_is_torch_free() -> None:
    code = (
        "import sys, ppdsl.dsl.introspect\n"
        "heavy = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
