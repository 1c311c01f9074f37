"""AST -> Spec: names, types, defaults, `--set` overrides; every error of a file is collected."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import sympy

from ppdsl.dsl.check import check_text, load_spec, load_text
from ppdsl.dsl.diagnostics import Diagnostic
from ppdsl.dsl.spec import WORLD, Spec

ROOT = Path(__file__).resolve().parent.parent

BASE = """ppspec 1
model tiny {
  source = python("ppdsl.models.decoder:build_decoder")
  config { vocab_size = 128, dim = 64, n_layers = 8, n_heads = 4, max_seq_len = 64 }
}
mesh {
  tp = 2
  pp = 2
}
pipeline {
  style = 1f1b
  microbatches = 4
}
train {
  global_batch = 16
  seq_len = 32
}
"""


def load(text: str = BASE, overrides: tuple[str, ...] = ()) -> tuple[Spec | None, list[Diagnostic]]:
    spec, diags, _ = load_text(text, "r.ppspec", overrides)
    return spec, diags


def ok(text: str = BASE, overrides: tuple[str, ...] = ()) -> Spec:
    spec, diags = load(text, overrides)
    assert spec is not None and not [d for d in diags if d.is_error], diags
    return spec


def codes(text: str, overrides: tuple[str, ...] = ()) -> list[str]:
    return [d.code for d in load(text, overrides)[1] if d.is_error]


def edit(old: str, new: str, text: str = BASE) -> str:
    assert old in text, old
    return text.replace(old, new, 1)


# ---- values and defaults ----------------------------------------------------------------------------


def test_base_values_and_defaults() -> None:
    s = ok()
    assert (s.mesh.tp, s.mesh.pp) == (2, 2)
    assert s.mesh.dp == WORLD / 4
    assert s.pipeline.style == "1f1b" and s.pipeline.chunks == 1 and s.pipeline.microbatches == 4
    assert s.pipeline.microbatch_size == 16 / (WORLD / 4 * 4)
    assert (s.pipeline.blocks, s.pipeline.first, s.pipeline.last) == ("layers", ("tok_embeddings", "pos_embeddings"),
                                                                      ("norm", "output"))
    assert s.pipeline.split is None and s.pipeline.balance == "even"
    t = s.train
    assert (t.global_batch, t.seq_len, t.steps, t.seed, t.zero, t.log_every) == (16, 32, 10, 0, 0, 1)
    assert (t.optimizer.name, t.optimizer.lr, t.optimizer.weight_decay, t.optimizer.betas) == ("adamw", 1e-3, 0.01, (0.9, 0.999))
    assert (t.lr_schedule.name, t.precision, t.grad_clip, t.data.kind, t.checkpoint) == ("constant", "fp32", None, "synthetic", None)
    assert s.model.family == "generic"
    assert s.model.dims == {"layers": 8, "hidden": 64, "heads": 4, "ffn": 256, "vocab": 128, "positions": 64}
    assert s.tensor_parallel.rules == () and s.tensor_parallel.sequence_parallel is False


def test_family_defaults() -> None:
    text = edit('source = python("ppdsl.models.decoder:build_decoder")\n  config { vocab_size = 128, dim = 64, n_layers = 8, n_heads = 4, max_seq_len = 64 }',
                'source = hf("FalconForCausalLM")')
    s = ok(text)
    assert s.model.family == "falcon"
    assert s.pipeline.blocks == "transformer.h" and s.pipeline.last == ("transformer.ln_f", "lm_head")
    # FalconConfig's defaults; ffn_hidden_size = None: 4 * hidden (the family's ffn_per_hidden)
    assert s.model.dims["layers"] == 32 and s.model.dims["vocab"] == 65024 and s.model.dims["ffn"] == 4 * 4544
    # a class no family claims (its own forward): its HF config class's defaults, the layout traced later
    s = ok(edit('FalconForCausalLM', 'GPT2LMHeadModel', text))
    assert s.model.family == "own" and not s.pipeline.blocks
    assert s.model.dims["layers"] == 12 and s.model.dims["vocab"] == 50257 and s.model.dims["positions"] == 1024
    # the config class of the model type the class is named after: LlamaConfig's, not ExaoneConfig's
    # (transformers' auto mapping lists LlamaForCausalLM under "exaone" first)
    s = ok(edit('FalconForCausalLM', 'LlamaForCausalLM', text))
    assert s.model.family == "own" and s.model.dims["vocab"] == 32000 and s.model.dims["positions"] == 2048


def test_hf_pretrained_family_comes_from_config_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GemmaForCausalLM"], "num_hidden_layers": 4}))
    text = edit('python("ppdsl.models.decoder:build_decoder")', f'hf_pretrained("{tmp_path}")')
    s = ok(text)
    assert s.model.family == "gemma"
    assert s.pipeline.blocks == "model.layers" and s.pipeline.first == ("model.embed_tokens",)
    assert s.model.dims["layers"] == 4  # gemma reads num_hidden_layers (config.json) before n_layers (the spec)


def test_hf_pretrained_directory_is_resolved_against_the_spec_dir(tmp_path: Path) -> None:
    model = tmp_path / "models" / "m"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps({"architectures": ["GemmaForCausalLM"], "num_hidden_layers": 4}))
    text = edit('python("ppdsl.models.decoder:build_decoder")', 'hf_pretrained("models/m")')
    spec, diags, _ = load_text(text, str(tmp_path / "s.ppspec"))
    assert spec is not None and not diags, diags
    assert spec.model.source.target == str(model.resolve())  # the plan records the absolute directory
    assert spec.model.family == "gemma"


def test_package_targets_for_model_and_tokenizer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "site" / "ppdsl_fake_weights"
    (root / "model").mkdir(parents=True)
    (root / "__init__.py").write_text("raise RuntimeError('never imported')\n")
    (root / "model" / "config.json").write_text(json.dumps({"architectures": ["BertForSequenceClassification"]}))
    (root / "model" / "model.safetensors").write_bytes(b"")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    text = edit('python("ppdsl.models.decoder:build_decoder")', 'hf_pretrained("package:ppdsl_fake_weights")')
    spec, diags = load(text)
    assert spec is not None and not diags, diags
    assert spec.model.source.target == str((root / "model").resolve()) and spec.model.family == "own"
    text = edit("  seq_len = 32\n", '  seq_len = 32\n  data = jsonl("d.jsonl", tokenizer = "package:ppdsl_fake_weights/model")\n', text)
    spec, diags = load(text)
    assert spec is not None and spec.train.data.options["tokenizer"] == str((root / "model").resolve())
    missing = edit("package:ppdsl_fake_weights/model", "package:ppdsl_absent_pkg", text)
    assert codes(missing) == ["E0410"]
    spec, diags = load(edit("package:ppdsl_fake_weights", "package:ppdsl_absent_pkg", text))
    assert "W0401" in [d.code for d in diags]


def test_hf_pretrained_without_config_json_warns(tmp_path: Path) -> None:
    spec, diags = load(edit('python("ppdsl.models.decoder:build_decoder")', f'hf_pretrained("{tmp_path}")'))
    assert spec is not None
    assert [d.code for d in diags] == ["W0401"]


def test_train_calls_and_options() -> None:
    text = edit("  seq_len = 32\n", "  seq_len = 32\n  optimizer = adamw(3e-4, 0.1, [0.9, 0.95])\n"
                "  lr_schedule = cosine(warmup = 10, min_lr = 3e-5)\n  precision = bf16\n  grad_clip = 1.0\n"
                "  data = synthetic(seed = 7)\n  checkpoint { dir = \"ckpt\", every = 5 }\n  activation_checkpointing = true\n"
                "  steps = 2 * 50\n  zero = 1\n  log_every = 5\n")
    t = ok(text).train
    assert (t.optimizer.lr, t.optimizer.weight_decay, t.optimizer.betas) == (3e-4, 0.1, (0.9, 0.95))
    assert (t.lr_schedule.name, t.lr_schedule.warmup, t.lr_schedule.min_lr) == ("cosine", 10, 3e-5)
    assert (t.precision, t.grad_clip, t.data.options["seed"], t.activation_checkpointing) == ("bf16", 1.0, 7, True)
    assert (t.checkpoint.dir, t.checkpoint.every, t.steps, t.zero, t.log_every) == ("ckpt", 5, 100, 1, 5)
    assert ok(edit("  seq_len = 32\n", "  seq_len = 32\n  optimizer = sgd\n")).train.optimizer.name == "sgd"


def test_tensor_parallel_rules() -> None:
    text = edit("pipeline {", "tensor_parallel {\n  tok_embeddings : vocab(pad_to = 64)\n  layers[*].attention.wq : column(3, true)\n"
                "  layers[0:4].attention.wo : row\n  sequence_parallel = true\n}\npipeline {")
    tp = ok(text).tensor_parallel
    assert [(r.text, r.style, r.fused, r.gather_output, r.pad_to) for r in tp.rules] == [
        ("tok_embeddings", "vocab", 1, False, 64), ("layers[*].attention.wq", "column", 3, True, None),
        ("layers[0:4].attention.wo", "row", 1, False, None)]
    assert tp.sequence_parallel is True
    assert tp.rules[2].pattern[0].index.kind == "range" and tp.rules[2].span.line == 13


def test_split_ranges_use_expressions() -> None:
    s = ok(edit("  microbatches = 4\n", "  microbatches = 4\n  split = [0:layers / 2, layers / 2:layers]\n"))
    assert s.pipeline.split == ((0, 4), (4, 8))
    assert ok(edit("  microbatches = 4\n", "  microbatches = 4\n  split = auto\n")).pipeline.split is None


def test_style_as_a_string_and_word() -> None:
    assert ok(edit("style = 1f1b", 'style = "zbv"')).pipeline.style == "zbv"
    assert ok(edit("style = 1f1b", "style = interleaved")).pipeline.style == "interleaved"


# ---- names ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "expr, value",
    [("world / (tp * pp)", WORLD / 4), ("world / (mesh.tp * mesh.pp)", WORLD / 4), ("global_batch / 8", 2),
     ("train.global_batch // 3", 5), ("layers - 6", 2), ("vocab / 64", 2), ("n_heads - 2", 2), ("config.dim / 32", 2),
     ("model.n_layers / 4", 2), ("seq_len / 16", 2), ("microbatches - 2", 2), ("2 ** 3 - 6", 2), ("-(-2)", 2)],
)
def test_names_in_expressions(expr: str, value: object) -> None:
    s = ok(edit("  pp = 2\n", f"  pp = 2\n  dp = {expr}\n"))
    assert sympy.simplify(s.mesh.dp - value) == 0


def test_config_arithmetic() -> None:
    s = ok(edit("n_heads = 4", "n_heads = dim / 16, head_dim = dim // n_heads"))
    assert s.model.config["n_heads"] == 4 and s.model.config["head_dim"] == 16


def test_names_may_refer_in_any_order() -> None:
    s = ok(edit("  microbatches = 4\n", "  microbatches = global_batch / (dp * microbatch_size)\n  microbatch_size = 4\n"))
    assert s.pipeline.microbatches == 16 / (WORLD / 4 * 4)


@pytest.mark.parametrize(
    "old, new, code, message",
    [
        ("  pp = 2\n", "  pp = 2\n  dp = wrld\n", "E0105", "unknown name 'wrld'"),
        ("  tp = 2\n  pp = 2\n", "  tp = pp\n  pp = tp\n", "E0105", "'mesh.tp' is defined in terms of itself"),
        ("n_heads = 4", "n_heads = tp", "E0105", "unknown name 'tp' in config"),
        ("n_heads = 4", "n_heads = n_heads", "E0105", "'n_heads' is defined in terms of itself"),
        ("  global_batch = 16\n", '  global_batch = "16"\n', "E0103", "a string cannot be used in arithmetic"),
        ("  seq_len = 32\n", "  seq_len = world\n", "E0103", "train.seq_len cannot depend on the world size"),
        ("  seq_len = 32\n", "  seq_len = 0\n", "E0103", "train.seq_len must be at least 1"),
        ("  seq_len = 32\n", "  seq_len = 33 / 2\n", "E0103", "train.seq_len must be a whole number"),
        ("  tp = 2\n", "  tp = 2 / 0\n", "E0103", "division by zero"),
        ("  tp = 2\n", "  tp = (0 - 8) ** 0.5\n", "E0103", "this power is not a finite real number"),
        ("  tp = 2\n", "  tp = 0 ** -1\n", "E0103", "this power is not a finite real number"),
        ("  tp = 2\n", "  tp = 2 ** 65\n", "E0103", "exponent too large"),
        ("  tp = 2\n", "  tp = 2 ** 64 ** 64\n", "E0103", "exponent too large"),
        ("  tp = 2\n", "  tp = (3 ** 64) ** 64\n", "E0103", "number too large"),
        ("  tp = 2\n", "  tp = 1 < 2\n", "E0103", "mesh.tp must be a number"),
        ("  tp = 2\n", "  tp = true\n", "E0103", "mesh.tp must be a number"),
        ("  tp = 2\n", "  tp = not 1\n", "E0103", "expected a condition such as `a % b == 0`"),
        ("  tp = 2\n", "  tp = (1 < 2) + 1\n", "E0103", "a condition cannot be used as a number"),
        ("style = 1f1b", "style = 1f1c", "E0107", "unknown style '1f1c'"),
        ("style = 1f1b", "style = 3", "E0107", "unknown style '3'"),
        ("  seq_len = 32\n", "  seq_len = 32\n  optimizer = adamw(lr = 1, lr = 2)\n", "E0104", "option 'lr' is given twice"),
        ("  seq_len = 32\n", "  seq_len = 32\n  optimizer = adamw(1, 2, [1, 1], 1, 5)\n", "E0103", "adamw(...) takes at most 4 values"),
        ("  seq_len = 32\n", "  seq_len = 32\n  optimizer = adamw(betas = [1])\n", "E0103", "betas must be a list of two numbers, e.g. [0.9, 0.95]"),
        ("  seq_len = 32\n", "  seq_len = 32\n  lr_schedule = cosine(warmup = 10 / 3)\n", "E0103", "warmup must be a whole number"),
        ("  seq_len = 32\n", "  seq_len = 32\n  grad_clip = 0\n", "E0103", "grad_clip must be positive (or none)"),
        ("  seq_len = 32\n", "  seq_len = 32\n  checkpoint { every = 2 }\n", "E0102", "train.checkpoint has no 'dir'"),
        ("  seq_len = 32\n", "  seq_len = 32\n  checkpoint = 2\n", "E0103", "'checkpoint' is a block: write `checkpoint { ... }`"),
        ("  tp = 2\n", "  tp { }\n", "E0103", "'tp' is a value: write `tp = ...`"),
        ("  microbatches = 4\n", "  microbatches = 4\n  split = [0:2, 2]\n", "E0103", "each split entry is a range start:stop"),
        ("  microbatches = 4\n", "  microbatches = 4\n  split = [0:world, 2:4]\n", "E0103", "split ranges must be whole numbers"),
        ("  microbatches = 4\n", "  microbatches = 4\n  blocks = 3\n", "E0103", "blocks must be a module path such as transformer.h"),
        ("  microbatches = 4\n", "  microbatches = 4\n  first = [1]\n", "E0103", "first lists module paths: [transformer.wte, transformer.wpe]"),
        ('python("ppdsl.models.decoder:build_decoder")', 'python("no_colon")', "E0103", "python source 'no_colon' is not of the form 'pkg.module:callable'"),
        ('python("ppdsl.models.decoder:build_decoder")', 'hf("not a class")', "E0103", "'not a class' is not a transformers class name"),
        ('python("ppdsl.models.decoder:build_decoder")', 'hf(1)', "E0103", "hf(...) takes one string"),
        ('python("ppdsl.models.decoder:build_decoder")', 'torch("x")', "E0103", 'source must be hf("Class"), hf_pretrained("dir") or python("pkg.module:factory")'),
        ("n_heads = 4", "n_heads = hf(1)", "E0103", "a call 'hf(...)' is not a config value"),
        ("pipeline {", "tensor_parallel {\n  x : column(fused = 0)\n}\npipeline {", "E0103", "fused must be at least 1"),
        ("pipeline {", "tensor_parallel {\n  x : vocab(pad_to = 0)\n}\npipeline {", "E0103", "pad_to must be at least 1"),
        ("pipeline {", "tensor_parallel {\n  x : row(3)\n}\npipeline {", "E0103", "row(...) takes at most 0 values"),
        ("pipeline {", "tensor_parallel {\n  x : column(gather_output = 1)\n}\npipeline {", "E0103", "gather_output must be true or false"),
        ("pipeline {", "require tp + 1\npipeline {", "E0103", "require needs a condition such as `n_embd % (tp * 64) == 0`"),
        ("  tp = 2\n", "  tp = 2\n  tq = 2\n", "E0101", "unknown key 'tq' in mesh"),
        ("max_seq_len = 64 }", "max_seq_len = 64\n    require n_heads > 0 }", "E0101", "config holds `key = value` entries and `key { ... }` blocks only"),
        ("mesh {", "mesh x {", "E0100", "block 'mesh' takes no name"),
        ("ppspec 1\n", "", "E0106", "the spec does not start with its language version"),
    ],
)
def test_errors(old: str, new: str, code: str, message: str) -> None:
    spec, diags = load(edit(old, new))
    assert spec is None
    found = [(d.code, d.message) for d in diags if d.is_error]
    assert (code, message) in found, found


def test_every_independent_error_is_reported() -> None:
    text = edit("  tp = 2\n", "  tq = 2\n")  # E0101
    text = edit("style = 1f1b", "style = 1f1c", text)  # E0107
    text = edit("  seq_len = 32\n", '  seq_len = "x"\n', text)  # E0103
    spec, diags = load(text)
    assert spec is None
    assert sorted((d.code, d.span.line) for d in diags) == [("E0101", 7), ("E0103", 16), ("E0107", 11)]


def test_spans_of_values() -> None:
    s = ok()
    assert (s.spans["mesh.tp"].line, s.spans["mesh.tp"].column) == (7, 3)
    assert s.span("mesh.dp") == s.spans["mesh"]  # not given: its block
    assert s.span("nothing.at.all") is None
    assert (s.span("model.config.dim").line, s.span("model.config.dim").column) == (4, 30)


# ---- --set overrides ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override, get, expected",
    [
        ("mesh.tp=4", lambda s: s.mesh.tp, 4),
        ("mesh.dp=2", lambda s: s.mesh.dp, 2),
        ("pipeline.style=interleaved", lambda s: s.pipeline.style, "interleaved"),
        ("pipeline.style=zbv", lambda s: s.pipeline.style, "zbv"),
        ("pipeline.chunks=2", lambda s: s.pipeline.chunks, 2),
        ("pipeline.microbatches=8", lambda s: s.pipeline.microbatches, 8),
        ("pipeline.microbatches=2 * pp", lambda s: s.pipeline.microbatches, 4),
        ("train.global_batch=64", lambda s: s.train.global_batch, 64),
        ("train.global_batch=8 * dp", lambda s: s.train.global_batch, 2 * WORLD),
        ("model.config.n_layers=16", lambda s: s.model.dims["layers"], 16),
        ("model.config.n_kv_heads=2", lambda s: s.model.dims["kv_heads"], 2),  # a key the file lacks: added
        ("train.optimizer=sgd(lr = 0.1)", lambda s: (s.train.optimizer.name, s.train.optimizer.lr), ("sgd", 0.1)),
        ("tensor_parallel.sequence_parallel=true", lambda s: s.tensor_parallel.sequence_parallel, True),  # new block
        ('train.checkpoint.dir="ckpt"', lambda s: s.train.checkpoint.dir, "ckpt"),  # new nested block
        ("pipeline.split=[0:4, 4:8]", lambda s: s.pipeline.split, ((0, 4), (4, 8))),
        ("mesh.tp = 4 ", lambda s: s.mesh.tp, 4),
    ],
)
def test_overrides(override: str, get, expected: object) -> None:
    s = ok(overrides=(override,))
    assert get(s) == expected


def test_overrides_apply_in_order_and_replace() -> None:
    s = ok(overrides=("mesh.tp=4", "mesh.tp=8"))
    assert s.mesh.tp == 8
    s = ok(overrides=("pipeline.style=interleaved", "pipeline.chunks=2"))
    assert (s.pipeline.style, s.pipeline.chunks) == ("interleaved", 2)


def test_override_creates_a_missing_block() -> None:
    text = edit("mesh {\n  tp = 2\n  pp = 2\n}\n", "")
    assert ok(text).mesh.tp == 1
    s = ok(text, ("mesh.tp=2", "mesh.pp=2"))
    assert (s.mesh.tp, s.mesh.pp) == (2, 2)


@pytest.mark.parametrize(
    "override, message",
    [
        ("mesh.tp", "cannot read --set 'mesh.tp'"),
        ("mesh.tp:4", "cannot read --set 'mesh.tp:4'"),
        ("tp=4", "cannot read --set 'tp=4'"),
        ("mesh.tp=", "cannot read --set 'mesh.tp='"),
        ("=4", "cannot read --set '=4'"),
        ("mesh..tp=4", "cannot read --set 'mesh..tp=4'"),
        ("mesh.t-p=4", "cannot read --set 'mesh.t-p=4'"),
        ("1mesh.tp=4", "cannot read --set '1mesh.tp=4'"),
        ("mesh.tp=4\nmesh.pp=2", "cannot read --set 'mesh.tp=4\nmesh.pp=2'"),
        ("mesh.tp=(4", "cannot read the value of --set 'mesh.tp=(4'"),
        ("mesh.tp=4 4", "cannot read the value of --set 'mesh.tp=4 4'"),
        ("mesh.tp={", "cannot read the value of --set 'mesh.tp={'"),
        ("mesh.tp=4 } evil { x = 1", "cannot read the value of --set 'mesh.tp=4 } evil { x = 1'"),
        ("mesh.tp=4, pp=2", "--set 'mesh.tp=4, pp=2' sets more than one value"),
        ("mesh.tp=4; pp=2", "--set 'mesh.tp=4; pp=2' sets more than one value"),
    ],
)
def test_bad_overrides(override: str, message: str) -> None:
    spec, diags = load(overrides=(override,))
    assert spec is None
    (d,) = diags
    assert (d.code, d.message, d.span) == ("E0005", message, None)


def test_override_diagnostics_point_into_the_option() -> None:
    spec, diags = load(overrides=("pipeline.style=foo",))
    (d,) = diags
    assert d.code == "E0107"
    assert d.span.file == "--set pipeline.style=foo"
    assert (d.span.line, d.span.column, d.span.end_column) == (1, 22, 25)  # 'foo' in `--set pipeline.style=foo`
    spec, diags = load(overrides=("mesh.tq=2",))
    (d,) = diags
    assert (d.code, d.message, d.span.column) == ("E0101", "unknown key 'tq' in mesh", 12)
    r = check_text(BASE, "r.ppspec", overrides=("train.zero=2",))
    (d,) = r.diagnostics
    assert d.code == "E0315" and d.span.file == "--set train.zero=2" and d.span.column == 13


def test_override_of_a_shipped_spec_changes_the_verdict() -> None:
    spec, diags, _ = load_spec(ROOT / "specs" / "gpt2.ppspec", ["mesh.tp=5"])
    assert spec is not None and spec.mesh.tp == 5
    r = check_text((ROOT / "specs" / "gpt2.ppspec").read_text(), "gpt2.ppspec", world=10, overrides=("mesh.tp=5",))
    assert "E0204" in {d.code for d in r.diagnostics}


def test_override_of_gpt2_config_and_pipeline() -> None:
    path = ROOT / "specs" / "gpt2.ppspec"
    spec, diags, _ = load_spec(path, ["model.config.n_layer=24", "pipeline.style=1f1b", "pipeline.chunks=1",
                                      "pipeline.microbatches=4", "train.global_batch=8 * dp"])
    assert spec is not None and not diags
    assert spec.model.config["n_layer"] == 24 and spec.model.dims["layers"] == 24
    assert (spec.pipeline.style, spec.pipeline.chunks, spec.pipeline.microbatches) == ("1f1b", 1, 4)
    assert spec.train.global_batch == 2 * WORLD


# ---- the locate pass ------------------------------------------------------------------------------

LOCATED = BASE.replace("  microbatches = 4\n", '  microbatches = 4\n  profile = "/etc/profile.json"\n').replace(
    "  seq_len = 32\n", '  seq_len = 32\n  data = text("corpus.txt", tokenizer = "package:ppdsl_no_such_package")\n'
                        '  eval { data = tokens("../held_out.bin") }\n')


def test_locate_looks_up_every_path_the_spec_names(tmp_path: Path) -> None:
    from ppdsl.dsl.parse import parse
    from ppdsl.dsl.resolve.located import locate

    doc = parse(LOCATED, str(tmp_path / "r.ppspec"))
    located = locate(doc, tmp_path, (str(tmp_path),))
    found = {LOCATED.splitlines()[s.line - 1][s.column - 1:s.end_column - 1]: f for s, f in located.paths.items()}
    assert set(found) == {'"/etc/profile.json"', '"corpus.txt"', '"package:ppdsl_no_such_package"', '"../held_out.bin"'}
    assert found['"corpus.txt"'].path == str(tmp_path / "corpus.txt") and found['"corpus.txt"'].problem is None
    assert found['"package:ppdsl_no_such_package"'].problem.code == "E0410"
    assert found['"/etc/profile.json"'].problem.code == found['"../held_out.bin"'].problem.code == "E0419"
    assert sorted(d.code for d in located.diagnostics) == ["E0410", "E0419", "E0419"]


def test_resolve_reads_paths_from_the_locate_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """resolve itself touches no file: the paths of the spec are what the locate pass found."""
    from ppdsl.dsl.resolve import driver
    from ppdsl.dsl.resolve.located import FoundPath, Located

    text = BASE.replace("  seq_len = 32\n", '  seq_len = 32\n  data = tokens("train.bin")\n')

    def fake_locate(doc, base_dir, roots):  # type: ignore[no-untyped-def]
        v = next(e for b in doc.items if getattr(b, "kind", "") == "train" for e in b.entries
                 if getattr(e, "key", "") == "data").value.args[0]
        return Located({}, {v.span: FoundPath("/found/by/locate.bin", None)})

    monkeypatch.setattr(driver, "locate", fake_locate)
    spec, diags = load(text)
    assert spec is not None and spec.train.data.options["path"] == "/found/by/locate.bin", diags
