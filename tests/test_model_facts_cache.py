"""The cache of model facts (dsl/model_facts_cache.py): a warm check says exactly what a cold one
says, without importing torch; any change of what the facts depend on builds them again; a broken
entry or cache folder never breaks check."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from ppdsl import cli  # noqa: E402
from ppdsl.dsl import model_facts_cache as mfc  # noqa: E402
from ppdsl.dsl.check import check_text  # noqa: E402
from ppdsl.dsl.introspect import introspect  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "golden"
SPECS = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "specs").glob("*.ppspec"))
# broken specs whose diagnostics come from the model's facts: tp pairing on the trace, fused parts,
# ties, coverage, family refusals, a root or scalar parameter of a python factory, a failed build
BROKEN = [f"tests/golden/{name}.ppspec" for name in (
    "E0211_fused_parts", "E0212_attention_roles_swapped", "E0215_sequence_parallel_attention_not_split",
    "E0219_column_into_replicate", "E0220_value_whole", "E0221_c_attn_without_fused", "E0222_tied_pad_to_differs",
    "E0402_rule_matches_nothing", "E0404_root_parameter", "E0407_unsplittable_projection",
    "E0409_zero3_scalar_param", "E0422_shared_layers", "E0401_model_cannot_build")]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh, empty cache folder for this test (never the user's or the session's)."""
    folder = tmp_path / "cache"
    monkeypatch.setenv(mfc.ENV_DIR, str(folder))
    monkeypatch.delenv(mfc.ENV_OFF, raising=False)
    monkeypatch.setenv("NO_COLOR", "1")
    return folder


def _entries(cache: Path) -> list[Path]:
    return sorted((cache / mfc.SUBDIR).glob("*.json")) if (cache / mfc.SUBDIR).is_dir() else []


def _check(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = cli.main(["check", *argv])
    out, err = capsys.readouterr()
    return code, err + out


class _Builds:
    """Counts the real builds (introspect calls) of the cache module."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fail: bool = False) -> None:
        self.n = 0
        self.fail = fail
        monkeypatch.setattr(mfc, "introspect", self)

    def __call__(self, *args, **kwargs):
        self.n += 1
        if self.fail:
            raise AssertionError("the warm check built the model")
        return introspect(*args, **kwargs)


# the python factory's and BERT's (about 15 s and 6 s) under `-m slow`: GPT-2's, Blip2's and the broken
# ones cover the cache's paths
@pytest.mark.parametrize("spec", [pytest.param(s, marks=pytest.mark.slow) if Path(s).stem in ("decoder", "bert") else s
                                  for s in SPECS + BROKEN], ids=[Path(s).stem for s in SPECS + BROKEN])
def test_a_warm_check_says_exactly_what_a_cold_one_says(spec: str, cache: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(ROOT)
    cold = _check(capsys, spec)  # builds the model and stores its facts
    # stored unless the build failed (or a factory module this process imported before)
    builds = _Builds(monkeypatch, fail=bool(_entries(cache)))
    warm, warm_json = _check(capsys, spec), _check(capsys, spec, "--format", "json")
    assert warm == cold
    builds.fail = False
    monkeypatch.setenv(mfc.ENV_OFF, "1")
    assert _check(capsys, spec, "--format", "json") == warm_json


def test_every_shipped_spec_and_a_failed_build_is_cached_or_not(cache: Path, capsys, monkeypatch) -> None:
    """hf, hf_pretrained and python sources are stored; a model that cannot be built is not."""
    monkeypatch.chdir(ROOT)
    _check(capsys, "specs/llama.ppspec")
    _check(capsys, "specs/minilm_finetune.ppspec")
    _check(capsys, "specs/blip2.ppspec")  # an own-forward model: its traced layout is stored too
    # Llama and the MiniLM classifier run their own forward at tp 2: the answer of the proof at a
    # rank's local shapes is a second entry of each
    assert len(_entries(cache)) == 5
    code, out = _check(capsys, "tests/golden/E0401_model_cannot_build.ppspec")
    assert code == 2 and "E0401" in out and len(_entries(cache)) == 5


def test_a_warm_check_imports_neither_torch_nor_transformers(cache: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(ROOT)
    _check(capsys, "specs/llama.ppspec")  # fills the cache
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "ppdsl", "check", "specs/llama.ppspec"],
                          cwd=ROOT, capture_output=True, text=True, env=os.environ, timeout=60)
    assert proc.returncode == 0, proc.stderr
    imported = [line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")]
    assert "ppdsl.dsl.model_check" in imported  # the model checks ran
    heavy = [m for m in imported if m.split(".")[0] in ("torch", "transformers", "sympy", "numpy")]
    assert heavy == []


# ---- invalidation -----------------------------------------------------------------------------

GPT2 = """ppspec 1
model gpt2 {{
  source = hf("GPT2LMHeadModel")
  config {{ n_layer = 2, n_embd = 64, n_head = 4, vocab_size = {vocab}, n_positions = 32 }}
}}
mesh {{ tp = 2, pp = 1 }}
tensor_parallel {{
  transformer.wte : vocab
  transformer.h[*].attn.c_attn : column(fused = 3)
  transformer.h[*].attn.c_proj : row
}}
pipeline {{ microbatches = 1 }}
train {{ global_batch = 2, seq_len = 16 }}
"""


def test_a_config_change_builds_again(cache: Path, monkeypatch) -> None:
    builds = _Builds(monkeypatch)
    first = check_text(GPT2.format(vocab=128), model=True)
    check_text(GPT2.format(vocab=128), model=True)
    assert builds.n == 1
    other = check_text(GPT2.format(vocab=130), model=True)
    assert builds.n == 2 and len(_entries(cache)) == 2
    assert first.model_info.modules["transformer.wte"].num_embeddings == 128
    assert other.model_info.modules["transformer.wte"].num_embeddings == 130


@pytest.mark.parametrize("package", ["torch", "transformers"])
def test_a_torch_or_transformers_upgrade_builds_again(package: str, cache: Path, monkeypatch) -> None:
    builds = _Builds(monkeypatch)
    check_text(GPT2.format(vocab=128), model=True)
    real = mfc._dist_version
    monkeypatch.setattr(mfc, "_dist_version", lambda name: "99.0" if name == package else real(name))
    check_text(GPT2.format(vocab=128), model=True)
    assert builds.n == 2 and len(_entries(cache)) == 2


def test_a_new_ppdsl_builds_again(cache: Path, monkeypatch) -> None:
    builds = _Builds(monkeypatch)
    check_text(GPT2.format(vocab=128), model=True)
    monkeypatch.setattr(mfc, "_ppdsl_digest", lambda: "0.2.0+0000")
    check_text(GPT2.format(vocab=128), model=True)
    assert builds.n == 2


FACTORY = '''import torch
from torch import nn
from {helper} import UP


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.up = nn.Linear(dim, UP)
        self.down = nn.Linear(UP, dim)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    def __init__(self, n_layers=2):
        super().__init__()
        self.emb = nn.Embedding({vocab}, 16)
        self.layers = nn.ModuleList(Block(16) for _ in range(n_layers))
        self.head = nn.Linear(16, {vocab})

    def forward(self, ids{extra}):
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def build(n_layers=2):
    return Net(n_layers)
'''

LOCAL = """ppspec 1
model net {{
  source = python("{module}:build")
  config {{ n_layers = 2 }}
}}
mesh {{ tp = 2, pp = 1 }}
tensor_parallel {{
  emb : vocab
  layers[*].up : column
  layers[*].down : row
}}
pipeline {{ microbatches = 1, blocks = layers, first = [emb], last = [head] }}
train {{ global_batch = 2, seq_len = 8 }}
"""


def _local_model(tmp_path: Path, name: str, vocab: int = 64, extra: str = "", up: int = 32) -> Path:
    """A factory module `name` (its vocabulary) and the module it imports (its MLP width)."""
    (tmp_path / f"{name}.py").write_text(FACTORY.format(helper=f"{name}_width", vocab=vocab, extra=extra))
    (tmp_path / f"{name}_width.py").write_text(f"UP = {up}\n")
    spec = tmp_path / f"{name}.ppspec"
    spec.write_text(LOCAL.format(module=name))
    return spec


def _fresh_check(capsys, monkeypatch, spec: Path, name: str) -> tuple[int, str]:
    """As a new process would: the factory's modules imported anew (from source: a rewrite within
    the same second could otherwise meet the old bytecode)."""
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    for mod in (name, f"{name}_width"):
        monkeypatch.delitem(sys.modules, mod, raising=False)
    return _check(capsys, str(spec))


def test_a_changed_local_model_file_builds_again(cache: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    name = f"ppdsl_cachetest_{os.getpid()}_a"
    spec = _local_model(tmp_path, name)
    monkeypatch.syspath_prepend(str(tmp_path))
    builds = _Builds(monkeypatch)
    assert _fresh_check(capsys, monkeypatch, spec, name)[0] == 0
    assert _fresh_check(capsys, monkeypatch, spec, name)[0] == 0
    assert builds.n == 1 and len(_entries(cache)) == 1
    _local_model(tmp_path, name, vocab=63)  # the factory's own file: 63 rows do not split over tp = 2
    code, out = _fresh_check(capsys, monkeypatch, spec, name)
    assert builds.n == 2 and code == 2 and "emb: " in out, out
    _local_model(tmp_path, name, up=33)  # only the module it imports changes: 33 features do not split
    code, out = _fresh_check(capsys, monkeypatch, spec, name)
    assert builds.n == 3 and code == 2 and "E0209" in out and "emb: " not in out, out


def test_a_forward_that_cannot_be_traced_is_cached_too(cache: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    """The trace's failure is a fact of the model (N0219): stored and said again, identically."""
    name = f"ppdsl_cachetest_{os.getpid()}_b"
    spec = _local_model(tmp_path, name, extra=", mask")  # forward needs a second argument
    monkeypatch.syspath_prepend(str(tmp_path))
    builds = _Builds(monkeypatch)
    cold = _fresh_check(capsys, monkeypatch, spec, name)
    warm = _fresh_check(capsys, monkeypatch, spec, name)
    assert builds.n == 1 and "N0219" in cold[1] and warm == cold


def test_a_changed_pretrained_config_builds_again(cache: Path, tmp_path: Path, monkeypatch) -> None:
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4,
              "vocab_size": 128, "n_positions": 32}
    (model_dir / "config.json").write_text(json.dumps(config))
    text = GPT2.format(vocab=128).replace('hf("GPT2LMHeadModel")', f'hf_pretrained("{model_dir}")').replace(
        "config { n_layer = 2, n_embd = 64, n_head = 4, vocab_size = 128, n_positions = 32 }", "")
    builds = _Builds(monkeypatch)
    first = check_text(text, model=True)
    assert check_text(text, model=True).diagnostics == first.diagnostics and builds.n == 1
    (model_dir / "config.json").write_text(json.dumps({**config, "vocab_size": 131}))
    result = check_text(text, model=True)
    assert builds.n == 2 and result.model_info.modules["transformer.wte"].num_embeddings == 131


# ---- robustness -------------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["garbage", "truncated", "edited", "other_key", "wrong_shape", "empty"])
def test_a_broken_entry_is_ignored_and_rebuilt(damage: str, cache: Path, monkeypatch) -> None:
    builds = _Builds(monkeypatch)
    good = check_text(GPT2.format(vocab=128), model=True)
    (entry,) = _entries(cache)
    data = entry.read_text()
    body = json.loads(data)
    broken = {
        "garbage": "",
        "truncated": data[: len(data) // 2],
        "edited": data.replace('\\"total_params\\":', '\\"total_params\\":1', 1),  # the checksum no longer holds
        "other_key": json.dumps({**body, "key": {**body["key"], "target": "X"}}),
        "wrong_shape": json.dumps({**body, "facts": "[1, 2]", "sha256": hashlib.sha256(b"[1, 2]").hexdigest()}),
        "empty": "",
    }[damage]
    assert broken != data
    entry.write_bytes(broken.encode("utf-8", "surrogateescape") if damage != "garbage" else b"\x00\xff{")
    again = check_text(GPT2.format(vocab=128), model=True)
    assert builds.n == 2
    assert again.diagnostics == good.diagnostics and again.model_info == good.model_info
    assert json.loads(entry.read_text()) == body  # written anew


def test_an_unusable_cache_folder_means_no_caching(tmp_path: Path, monkeypatch) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    monkeypatch.setenv(mfc.ENV_DIR, str(blocker))
    builds = _Builds(monkeypatch)
    first = check_text(GPT2.format(vocab=128), model=True)
    assert first.model_info is not None
    assert check_text(GPT2.format(vocab=128), model=True).diagnostics == first.diagnostics
    assert builds.n == 2


def test_the_cache_can_be_turned_off(cache: Path, monkeypatch) -> None:
    monkeypatch.setenv(mfc.ENV_OFF, "1")
    builds = _Builds(monkeypatch)
    check_text(GPT2.format(vocab=128), model=True)
    check_text(GPT2.format(vocab=128), model=True)
    assert builds.n == 2 and _entries(cache) == []


def test_the_default_folder_follows_xdg(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.delenv(mfc.ENV_DIR, raising=False)
    monkeypatch.delenv(mfc.ENV_OFF, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert mfc.cache_dir() == tmp_path / "ppdsl" / mfc.SUBDIR
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert mfc.cache_dir() == tmp_path / ".cache" / "ppdsl" / mfc.SUBDIR


def test_concurrent_writers_never_leave_half_an_entry(cache: Path) -> None:
    info = introspect("hf", "GPT2LMHeadModel", {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 128,
                                                 "n_positions": 32}, dataflow=True)
    key = {"test": "concurrent"}
    seen: list[object] = []

    def write() -> None:
        for _ in range(20):
            assert mfc.store(key, info)

    writers = [threading.Thread(target=write) for _ in range(4)]

    def read() -> None:  # reads for as long as any writer runs, so the reads overlap the writes
        while any(w.is_alive() for w in writers) or not seen:
            seen.append(mfc.load(key))

    reader = threading.Thread(target=read)
    for t in [*writers, reader]:
        t.start()
    for t in [*writers, reader]:
        t.join()
    seen.append(mfc.load(key))  # after the last write the entry is whole
    assert all(s is None or s == info for s in seen) and seen[-1] == info
    assert [p.name for p in (cache / mfc.SUBDIR).iterdir() if p.name.startswith(".")] == []  # no temporary left


def test_values_come_back_exactly() -> None:
    value = {"a": (1, 2.5, None), "id2label": {0: "NEG", 1: "POS"}, "inf": float("inf"), "l": [True, "x", [1]]}
    assert mfc._decode(json.loads(json.dumps(mfc._encode(value)))) == value
    with pytest.raises(mfc._Uncachable):
        mfc._encode({"dtype": object()})


def test_the_order_of_config_keys_does_not_matter() -> None:
    """The language server's config comes back from sorted JSON, check's in the spec's order."""
    a = mfc.facts_key("hf", "GPT2LMHeadModel", {"n_layer": 2, "n_embd": 64, "x": {"b": 1, "a": 2}})
    b = mfc.facts_key("hf", "GPT2LMHeadModel", {"x": {"a": 2, "b": 1}, "n_embd": 64, "n_layer": 2})
    assert a is not None and a == b


def test_old_entries_and_abandoned_temporaries_are_removed(cache: Path, monkeypatch) -> None:
    info = introspect("hf", "GPT2LMHeadModel", {"n_layer": 1, "n_embd": 32, "n_head": 4, "vocab_size": 64,
                                                 "n_positions": 16})
    monkeypatch.setattr(mfc, "MAX_ENTRIES", 3)
    folder = cache / mfc.SUBDIR
    for i in range(5):
        assert mfc.store({"n": i}, info)
        os.utime(mfc._entry_path(folder, {"n": i}), (1000 + i, 1000 + i))
    left = folder / ".tmp-left.json"
    left.write_text("{")
    os.utime(left, (1000, 1000))
    assert mfc.store({"n": 5}, info)
    assert sorted(p.name for p in folder.iterdir()) == sorted(mfc._entry_path(folder, {"n": i}).name for i in (3, 4, 5))
    assert mfc.load({"n": 5}) == info and mfc.load({"n": 0}) is None
