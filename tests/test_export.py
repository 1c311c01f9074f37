"""Real weights out: a model trained with pp = 2 x tp = 2 (vocabulary padded) exported as an
ordinary directory that ``from_pretrained`` loads and that gives the same outputs.

One 4-process gloo run trains three tiny models for two steps each, a GPT-2 (tied embeddings,
vocabulary 97 split over tp = 2 with pad_to = 64, fused q|k|v), the python-factory decoder and
a BERT classifier, and calls `export_model` at the end as a run does. The parent then checks the directories
against the parallel parameters (bitwise) and against the single-process reference run (logits
within 1e-5), and exercises `ppdsl export RUN_DIR OUT_DIR`. The remaining tests are one process.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

from ppdsl.lowering.plan import Plan, TpReplacement
from ppdsl.runtime.export.write import export_model, gather_full_parameters, write_model_dir
from ppdsl.runtime.export.atomic_dir import ExportError
from ppdsl.runtime.export.publish import cli_export, export, load_exported

from _tiny_models import tiny_plan
from dist_harness import run_distributed

CPU = torch.device("cpu")
STEPS = 2
VOCAB = 97  # odd: tp = 2 needs the padding (pad_to = 64 -> 128 rows, 64 per rank)


def gpt2_plan(pretrained: Path | None = None) -> Plan:
    """`pretrained`: the same model and layout, its weights read from an export."""
    plan = tiny_plan("gpt2", "1f1b", pp=2, tp=2, microbatches=4, num_layers=4, steps=STEPS, optimizer="sgd",
                     config={"vocab_size": VOCAB}, pretrained=pretrained)
    # added by hand: the language has no column(pad_to) (E0107), so a head tied to a padded
    # embedding cannot be written (E0222 without it)
    vocab = (TpReplacement(path="transformer.wte", style="vocab", pad_to=64),
             TpReplacement(path="lm_head", style="column", pad_to=64))
    return attrs.evolve(plan, tp=plan.tp + vocab)


def decoder_plan() -> Plan:
    return tiny_plan("generic", "1f1b", pp=2, tp=2, microbatches=4, num_layers=4, steps=STEPS, optimizer="sgd")


def bert_plan() -> Plan:
    return tiny_plan("bert", "1f1b", pp=2, tp=2, microbatches=4, num_layers=4, steps=STEPS, optimizer="sgd")


def decoder_dp2_zero1_plan() -> Plan:
    """dp = 2 with ZeRO-1: only replica 0 sends its parts, and they hold the stepped values."""
    return tiny_plan("generic", "1f1b", pp=2, tp=1, dp=2, microbatches=4, num_layers=4, steps=STEPS,
                     optimizer="sgd", zero=1)


def gpt2_dp2_zero3_plan() -> Plan:
    """dp = 2 with ZeRO-3 (FSDP2): every dp rank gathers each parameter's shards; wte and its
    tied lm_head on two pipeline ranks."""
    return tiny_plan("gpt2", "1f1b", pp=2, tp=1, dp=2, microbatches=4, num_layers=4, steps=STEPS,
                     optimizer="sgd", zero=3)


PLANS = {"gpt2": gpt2_plan, "decoder": decoder_plan, "bert": bert_plan, "decoder_dp2_zero1": decoder_dp2_zero1_plan,
         "gpt2_dp2_zero3": gpt2_dp2_zero3_plan}


def _export_worker(rank: int, world: int, root: str) -> dict[str, Any]:
    import torch.distributed as dist

    from ppdsl.runtime.parallel.groups import build_process_groups, tie_pp_ranks_of
    from ppdsl.runtime.train.trainer import Trainer

    out: dict[str, Any] = {}
    for name, make in PLANS.items():
        plan = make()
        groups = build_process_groups(plan.mesh, "cpu", tie_pp_ranks_of(plan.schedule.stage_ranks))
        trainer = Trainer(plan, groups, CPU)
        losses = [trainer.step(i)[0] for i in range(STEPS)]
        final = Path(root) / name / "final"
        written = export_model(trainer, final)
        gathered = gather_full_parameters(trainer.stages, groups, dist.new_group(backend="gloo"))
        try:  # occupied now: refused on every rank, before any collective
            export_model(trainer, final)
            refused = False
        except ExportError as exc:
            refused = "not empty" in str(exc)
        reloaded = _reload_sharded(groups, trainer, final) if name == "gpt2" else None
        out[name] = {
            "reloaded": reloaded,
            "losses": losses,
            "written": None if written is None else str(written),
            "refused": refused,
            # numpy: tensors on the result queue would be shared through file descriptors
            "gathered": None if gathered is None else {k: v.numpy() for k, v in gathered.items()},
        }
    return out


def _reload_sharded(groups: Any, trainer: Any, final: Path) -> dict[str, Any]:
    """Load the export back as an ``hf_pretrained`` model with the same pp x tp plan (different
    seed): each rank reads its shards sliced (fused q|k|v, padded vocabulary, lm_head through
    its tie to wte) and must hold exactly the trained shards."""
    from ppdsl.runtime.parallel.parallelize import parallelize
    from ppdsl.runtime.stage.build import build_stages
    from ppdsl.runtime.stage.weights import load_pretrained

    plan = gpt2_plan(pretrained=final)
    (stage,) = build_stages(plan, groups.pp_rank, CPU, 1234)
    parallelize([stage], plan, groups, CPU)
    trained = dict(trainer.stages[0].named_parameters())
    same_after_build = all(torch.equal(p, trained[n]) for n, p in stage.named_parameters())
    with torch.no_grad():
        for p in stage.parameters():
            p.fill_(float("nan"))
    report = load_pretrained(stage, final, tied={"lm_head.weight": "transformer.wte.weight"})
    return {
        "same_after_build": same_after_build,
        "same_after_sliced_load": all(torch.equal(p, trained[n]) for n, p in stage.named_parameters()),
        "sliced": sorted(r.name for r in report.reads if r.sliced),
        "keys": sorted(report.keys),
        "kept": report.kept,
    }


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("runs")
    return root, run_distributed(_export_worker, 4, str(root), timeout=240)


def _reference_model(plan: Plan) -> torch.nn.Module:
    """The single-process reference trained the same STEPS steps (runtime.verify.compare)."""
    from ppdsl.runtime.stage.build import build_reference_model
    from ppdsl.runtime.verify.reference import reference_run

    run = reference_run(plan, STEPS)
    model = build_reference_model(plan.model, CPU, plan.train.seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(run.params[name])
    return model.eval()


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(ids)
    return out.logits if hasattr(out, "logits") else out


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(PLANS))
def test_export_after_parallel_training(exported: tuple[Path, list[dict[str, Any]]], name: str) -> None:
    root, results = exported
    final = root / name / "final"
    assert results[0][name]["written"] == str(final)
    assert all(r[name]["written"] is None for r in results[1:])
    assert all(r[name]["refused"] for r in results)
    assert not [p for p in final.parent.iterdir() if p.name.startswith(".")], "temporary directories left"

    model = load_exported(final).eval()
    gathered = {k: torch.from_numpy(v) for k, v in results[0][name]["gathered"].items()}
    for key, p in model.state_dict().items():  # the parallel model's final parameters, bitwise
        if key in gathered:
            assert torch.equal(p, gathered[key]), key
    assert set(gathered) <= set(model.state_dict())

    plan = PLANS[name]()
    ids = torch.randint(0, plan.model.config_dict["vocab_size"], (3, 16), generator=torch.Generator().manual_seed(1))
    diff = (_logits(model, ids) - _logits(_reference_model(plan), ids)).abs().max().item()
    assert diff <= 1e-5, diff


@pytest.mark.distributed
def test_gpt2_export_is_a_normal_hf_directory(exported: tuple[Path, list[dict[str, Any]]]) -> None:
    from safetensors import safe_open
    from transformers import GPT2LMHeadModel

    root, _ = exported
    final = root / "gpt2" / "final"
    config = json.loads((final / "config.json").read_text())
    assert config["vocab_size"] == VOCAB and config["architectures"] == ["GPT2LMHeadModel"]
    with safe_open(str(final / "model.safetensors"), framework="pt") as fh:
        shapes = {k: tuple(fh.get_slice(k).get_shape()) for k in fh.keys()}
    assert shapes["transformer.wte.weight"] == (VOCAB, 32)  # padding removed
    assert "lm_head.weight" not in shapes  # tied: stored once, as HF stores it
    model = GPT2LMHeadModel.from_pretrained(final)
    assert model.lm_head.weight is model.transformer.wte.weight

    # ppdsl export RUN_DIR OUT_DIR: validated copy, never over a non-empty directory
    out = root / "published"
    assert cli_export(str(root / "gpt2"), str(out)) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in final.iterdir())
    assert torch.equal(GPT2LMHeadModel.from_pretrained(out).transformer.wte.weight, model.transformer.wte.weight)
    assert cli_export(str(root / "gpt2"), str(out)) == 2
    assert cli_export(str(root / "gpt2"), str(out), force=True) == 0
    assert not [p for p in root.iterdir() if p.name.startswith(".")], "temporary directories left"


@pytest.mark.distributed
def test_export_loads_back_into_the_parallel_plan(exported: tuple[Path, list[dict[str, Any]]]) -> None:
    _, results = exported
    for rank, r in enumerate(results):
        back = r["gpt2"]["reloaded"]
        assert back["same_after_build"] and back["same_after_sliced_load"], rank
        assert back["kept"] == [], rank
        if rank < 2:  # pipeline rank 0: embeddings and blocks 0-1
            assert "transformer.wte.weight" in back["sliced"] and "transformer.wpe.weight" in back["keys"]
            assert "transformer.h.0.attn.c_attn.weight" in back["sliced"]
        else:  # pipeline rank 1: blocks 2-3 and the head, read as wte's rows
            assert "lm_head.weight" in back["sliced"] and "transformer.wte.weight" in back["keys"]
            assert "transformer.h.3.mlp.c_proj.weight" in back["sliced"]
            assert "transformer.h.3.mlp.c_proj.bias" not in back["sliced"]  # row-parallel bias: whole


# ---------------------------------------------------------------------------------------------
# One process: writing, validating, refusing
# ---------------------------------------------------------------------------------------------


def _one_process_dir(tmp_path: Path, family: str = "gpt2") -> tuple[Plan, Path]:
    from ppdsl.runtime.stage.build import build_reference_model

    plan = tiny_plan(family, "1f1b", pp=2, num_layers=2)
    model = build_reference_model(plan.model, CPU, 0)
    tensors = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    return plan, write_model_dir(plan.model, tensors, tmp_path / "run" / "final")


def test_python_factory_export_files(tmp_path: Path) -> None:
    plan, final = _one_process_dir(tmp_path, "generic")
    meta = json.loads((final / "ppdsl_model.json").read_text())
    assert meta["factory"] == "ppdsl.models.decoder:build_decoder" and meta["config"] == plan.model.config_dict
    assert sorted(p.name for p in final.iterdir()) == ["model.safetensors", "ppdsl_export.json", "ppdsl_model.json"]
    assert type(load_exported(final)).__name__ == "Decoder"


def test_export_refuses_incomplete_or_missing_models(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    _, final = _one_process_dir(tmp_path)
    (tmp_path / "empty_run").mkdir()
    with pytest.raises(ExportError, match="holds no trained model"):
        export(tmp_path / "empty_run", tmp_path / "o1")
    with pytest.raises(ExportError, match="is not a directory"):
        export(tmp_path / "nope", tmp_path / "o1")
    for out in (final, final.parent, final / "sub"):  # never over (or inside) the run's own model
        with pytest.raises(ExportError, match="overlaps the run's model directory"):
            export(tmp_path / "run", out, force=True)
    assert (tmp_path / "run" / "final" / "config.json").is_file()

    state = load_file(str(final / "model.safetensors"))
    state.pop("transformer.h.1.mlp.c_fc.weight")
    state["transformer.extra"] = torch.zeros(1)
    state["transformer.ln_f.weight"] = torch.zeros(3)
    save_file(state, str(final / "model.safetensors"), metadata={"format": "pt"})
    expected = r"missing 1 tensor.*c_fc.weight.*1 unknown.*extra.*wrong shapes: transformer.ln_f"
    with pytest.raises(ExportError, match=expected):
        export(tmp_path / "run", tmp_path / "o2")
    assert not (tmp_path / "o2").exists()
    assert cli_export(str(tmp_path / "run"), str(tmp_path / "o2")) == 2


def test_destination_rules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plan, final = _one_process_dir(tmp_path)
    (tmp_path / "empty").mkdir()
    assert export(tmp_path / "run", tmp_path / "empty") == tmp_path / "empty"  # an empty directory is fine
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("x")
    with pytest.raises(ExportError, match="not empty"):
        export(tmp_path / "run", busy)
    with pytest.raises(ExportError, match="not an earlier ppdsl export"):  # --force replaces exports only
        export(tmp_path / "run", busy, force=True)
    assert (busy / "keep.txt").read_text() == "x"
    (busy / "keep.txt").unlink()
    export(tmp_path / "run", busy)
    (busy / "config.json").write_text("{}")
    export(tmp_path / "run", busy, force=True)  # an earlier export is replaced
    assert json.loads((busy / "config.json").read_text())["architectures"] == ["GPT2LMHeadModel"]
    assert oct((busy / "model.safetensors").stat().st_mode & 0o777) != oct(0o600)  # ordinary file modes
    (tmp_path / "file").write_text("x")
    with pytest.raises(ExportError, match="not a directory"):
        export(tmp_path / "run", tmp_path / "file")
    with pytest.raises(ExportError, match="not gathered"):
        write_model_dir(plan.model, {}, tmp_path / "half")
    # a failure while writing leaves neither OUT_DIR nor a temporary directory behind, and a
    # forced export that fails keeps the previous one
    import ppdsl.runtime.export.write as export_module

    def crash(module: Any, model: Any, tmp: Path) -> None:
        (tmp / "config.json").write_text("{}")
        raise OSError("disk full")

    monkeypatch.setattr(export_module, "_write_hf", crash)
    from ppdsl.runtime.stage.build import build_reference_model

    model = build_reference_model(plan.model, CPU, 0)
    tensors = {n: p.detach() for n, p in model.named_parameters()}
    with pytest.raises(OSError, match="disk full"):
        write_model_dir(plan.model, tensors, tmp_path / "half")
    with pytest.raises(OSError, match="disk full"):
        write_model_dir(plan.model, tensors, busy, force=True)
    assert not (tmp_path / "half").exists()
    assert json.loads((busy / "config.json").read_text())["architectures"] == ["GPT2LMHeadModel"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_force_never_replaces_a_users_own_model_dir(tmp_path: Path) -> None:
    from ppdsl.runtime.export.atomic_dir import check_final_destination

    _one_process_dir(tmp_path)
    mine = tmp_path / "my_pretrained"  # looks like a model directory, but is not an export
    mine.mkdir()
    for name in ("config.json", "model.safetensors", "README.md"):
        (mine / name).write_text("mine")
    with pytest.raises(ExportError, match="not an earlier ppdsl export"):
        export(tmp_path / "run", mine, force=True)
    assert sorted(p.name for p in mine.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    assert cli_export(str(tmp_path / "run"), str(mine), force=True) == 2
    # a run checks RUN_DIR/final before it trains
    check_final_destination(tmp_path / "run")  # an earlier export: replaced at the end
    check_final_destination(tmp_path / "fresh")
    (tmp_path / "busy" / "final").mkdir(parents=True)
    (tmp_path / "busy" / "final" / "notes.txt").write_text("x")
    with pytest.raises(ExportError, match="train.save_final = false"):
        check_final_destination(tmp_path / "busy")


def test_a_leftover_temporary_export_is_cleaned(tmp_path: Path) -> None:
    plan, final = _one_process_dir(tmp_path)
    stale = tmp_path / "run" / ".final.tmp-dead"
    stale.mkdir()
    (stale / "model.safetensors").write_text("half")
    from ppdsl.runtime.stage.build import build_reference_model

    tensors = {n: p.detach() for n, p in build_reference_model(plan.model, CPU, 0).named_parameters()}
    write_model_dir(plan.model, tensors, final, force=True)
    assert not stale.exists() and (final / "ppdsl_export.json").is_file()
