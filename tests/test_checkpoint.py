"""Checkpoints: layout and atomic publishing (no processes), then real runs (gloo, 2 and 4
ranks): resume equals the uninterrupted run bit for bit, a kill during a save leaves the
previous checkpoint, a checkpoint resumes under another mesh (tp, pp, dp with ZeRO-1, schedule
style and chunks) as the uninterrupted run would continue, SIGTERM saves a final checkpoint."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from _run_helpers import HARD_TIMEOUT_S, ROOT, env, full_tensors, losses, run_cmd, snapshot, spec_plan, tiny_cpu_spec
from ppdsl.runtime.checkpoint.store import (
    FORMAT,
    CheckpointMismatch,
    check_compatible,
    complete_checkpoints,
    file_record,
    fingerprint,
    latest_checkpoint,
    resume_decision,
    step_name,
)

TWO_RANKS = ["--set", "mesh.tp=1", "--nproc", "2"]  # pp = 2: fastest to start on 2 cores


def _fake_checkpoint(root: Path, step: int, plan, *, complete: bool = True) -> Path:
    p = root / (step_name(step) if complete else f".{step_name(step)}.tmp-abcd1234")
    p.mkdir(parents=True)
    if complete:
        (p / ".metadata").write_bytes(b"dcp metadata %d" % step)
        (p / "__0_0.distcp").write_bytes(b"tensors" * (step + 1))
        files = {n: file_record(p / n) for n in (".metadata", "__0_0.distcp")}
        meta = {"format": FORMAT, "step": step, "samples": step * plan.train.global_batch,
                "fingerprint": fingerprint(plan), "files": files}
        (p / "meta.json").write_text(json.dumps(meta))
    return p


# ---------------------------------------------------------------------------------------------
# No processes
# ---------------------------------------------------------------------------------------------


def test_only_complete_checkpoints_count(tmp_path: Path) -> None:
    spec = tiny_cpu_spec(tmp_path, "s", steps=6, every=3)
    plan = spec_plan(spec)
    root = tmp_path / "ckpt"
    assert latest_checkpoint(root) is None
    _fake_checkpoint(root, 3, plan)
    _fake_checkpoint(root, 6, plan, complete=False)  # a save killed before publishing
    (root / "step-000009").mkdir()  # a directory without meta.json is not a checkpoint
    (root / "latest").write_text("step-000003\n")
    assert [s for s, _ in complete_checkpoints(root)] == [3]
    assert latest_checkpoint(root)[0] == 3
    _fake_checkpoint(root, 12, plan)  # renamed, but killed before `latest` was updated
    assert latest_checkpoint(root)[0] == 12


def test_resume_decisions(tmp_path: Path) -> None:
    spec = tiny_cpu_spec(tmp_path, "s", steps=6, every=3)
    plan = spec_plan(spec)
    assert resume_decision(plan, resume=False) == (None, [])
    path, notes = resume_decision(plan, resume=True)
    assert path is None and "no complete checkpoint" in notes[0]
    _fake_checkpoint(tmp_path / "ckpt", 3, plan)
    with pytest.raises(ValueError, match="already holds checkpoints.*--resume"):
        resume_decision(plan, resume=False)
    assert resume_decision(plan, resume=True)[0].endswith("step-000003")
    assert resume_decision(plan, resume=False, restarted=True)[0].endswith("step-000003")
    no_ckpt = spec_plan(tiny_cpu_spec(tmp_path, "n", steps=6, every=None))
    with pytest.raises(ValueError, match="--resume needs a checkpoint block"):
        resume_decision(no_ckpt, resume=True)


def test_another_mesh_is_resharded_and_another_global_batch_refused(tmp_path: Path) -> None:
    spec = tiny_cpu_spec(tmp_path, "s", steps=6, every=3)
    saved = spec_plan(spec, 2)
    meta = {"format": FORMAT, "step": 3, "samples": 3 * saved.train.global_batch, "fingerprint": fingerprint(saved)}
    other = spec_plan(spec, 4, ("mesh.tp=1", "mesh.pp=4"))
    notes = check_compatible(meta, other, "ck/step-000003")
    assert "resharding checkpoint step-000003 from mesh dp=1 pp=2 tp=1, 1f1b x 1 chunk(s), zero 0 to mesh dp=1 pp=4 tp=1" in notes[0]
    assert "global batch 8 unchanged" in notes[0]
    assert check_compatible(meta, saved, "ck") == []
    longer = spec_plan(spec, 2, ("mesh.tp=1", "train.steps=9"))
    assert check_compatible(meta, longer, "ck") == []  # more steps: allowed, silently
    bigger = spec_plan(spec, 2, ("mesh.tp=1", "train.global_batch=16"))
    with pytest.raises(CheckpointMismatch, match=r"global batch 8 .*this run has global batch 16.*--set train.global_batch=8"):
        check_compatible(meta, bigger, "ck")
    with pytest.raises(CheckpointMismatch, match=r"per-rank checkpoint \(format 1"):
        check_compatible({**meta, "format": 1}, saved, "ck")
    # how masks are built is no part of the weights: a plan with ppdsl's document masks (packed
    # documents) resumes a checkpoint saved without them, and one saved before the field existed
    import attrs

    masked = attrs.evolve(saved, model=attrs.evolve(saved.model, document_masks=True))
    assert check_compatible(meta, masked, "ck") == []
    older = {**meta, "fingerprint": {**meta["fingerprint"], "model": {
        k: v for k, v in meta["fingerprint"]["model"].items() if k != "document_masks"}}}
    assert check_compatible(older, masked, "ck") == []
    # nor is the family that runs the forward: a checkpoint saved by a family resumes under the own
    # forward once that family is deleted (the parameters keep their HF names); the config decides
    own = attrs.evolve(saved, model=attrs.evolve(saved.model, family="own", dims=()))
    assert check_compatible({**meta, "fingerprint": {**meta["fingerprint"], "model": {
        **meta["fingerprint"]["model"], "family": "qwen2"}}}, own, "ck") == []
    other_config = attrs.evolve(saved, model=attrs.evolve(saved.model, config=(("n_layer", 99),)))
    with pytest.raises(CheckpointMismatch, match=r"\(model differ\)"):
        check_compatible(meta, other_config, "ck")


def test_runs_of_a_shard() -> None:
    from ppdsl.runtime.checkpoint.dcp_boxes import runs

    assert runs([1, 2, 3, 4]) == [(0, 0, 4)]  # a plain split: one box
    assert runs([3, 4, 7, 8, 11, 12]) == [(0, 2, 2), (2, 6, 2), (4, 10, 2)]  # fused q|k|v: one per part
    assert runs([5, 6, 0, 0]) == [(0, 4, 2)]  # the vocabulary padding is no part of the model


# ---------------------------------------------------------------------------------------------
# Real runs
# ---------------------------------------------------------------------------------------------


@pytest.mark.distributed
def test_resume_equals_uninterrupted_and_a_kill_during_save_keeps_the_previous(tmp_path: Path) -> None:
    # rank 1 is killed after writing its part of checkpoint 6, before it is published
    spec = tiny_cpu_spec(tmp_path, "cut", steps=6, every=3, ckpt_dir=tmp_path / "ck")
    out = tmp_path / "out"
    proc, _ = run_cmd(["run", str(spec), *TWO_RANKS, "--out", str(out)], PPDSL_TEST_FAULT="save:6:1")
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "rank 1 was killed by SIGKILL while saving checkpoint step 6" in proc.stderr
    root = tmp_path / "ck"
    assert [s for s, _ in complete_checkpoints(root)] == [3]
    assert (root / "latest").read_text().strip() == "step-000003"
    assert any(p.name.startswith(".step-000006.tmp-") for p in root.iterdir())  # left aside, ignored
    want = losses(out)  # steps 1-6 ran without interruption (the kill came after step 6)
    assert [s for s, _ in want] == [1, 2, 3, 4, 5, 6]
    assert not (out / "final").exists()  # a failed run leaves no final model

    proc, _ = run_cmd(["run", str(spec), *TWO_RANKS, "--out", str(out), "--resume"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout and "step 3" in proc.stdout
    assert losses(out) == want  # bitwise: the floats compare exactly
    assert [s for s, _ in complete_checkpoints(root)] == [3, 6]
    assert not any(".tmp-" in p.name for p in root.iterdir())  # the next save cleaned up
    # a finished run leaves its model in OUT/final, and `ppdsl export` publishes it
    assert f"model: {out / 'final'}" in proc.stdout
    published = tmp_path / "published"
    proc, _ = run_cmd(["export", str(out), str(published)])
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in published.iterdir()) == ["model.safetensors", "ppdsl_export.json", "ppdsl_model.json"]

    # resuming with another global batch is refused before anything starts, and changes nothing
    before = snapshot(root)
    proc, _ = run_cmd(["run", str(spec), *TWO_RANKS, "--set", "train.global_batch=16", "--out", str(out), "--resume"])
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "this run has global batch 16" in proc.stderr
    assert snapshot(root) == before
    # and a fresh start into a dir holding checkpoints is refused too (it would prune them)
    proc, _ = run_cmd(["run", str(spec), *TWO_RANKS, "--out", str(out)])
    assert proc.returncode == 2 and "already holds checkpoints" in proc.stderr
    assert snapshot(root) == before


def _resharding_spec(tmp_path: Path) -> Path:
    """tiny_cpu (pp 2 x tp 2) reading a token file (its global batch does not depend on dp),
    with a padded vocabulary split: 4 steps, a checkpoint every 2."""
    spec = tiny_cpu_spec(tmp_path, "reshard", steps=4, every=2, ckpt_dir=tmp_path / "ck")
    tokens = tmp_path / "tokens.bin"
    ids = (np.arange(8192) * 7 + np.random.default_rng(0).integers(0, 3, 8192)) % 128
    ids.astype(np.uint16).tofile(tokens)
    text = spec.read_text(encoding="utf-8").replace("data = synthetic(seed = 0)", f'data = tokens("{tokens}")')
    text = text.replace("tok_embeddings            : vocab", "tok_embeddings            : vocab(pad_to = 48)")
    spec.write_text(text, encoding="utf-8")
    return spec


# the done-when cases of resharding: each resumes the pp 2 x tp 2 x dp 1 checkpoint of step 2
RESHARDED = {
    "pp4": ["--set", "mesh.tp=1", "--set", "mesh.pp=4"],
    "tp2-dp2-zero1": ["--set", "mesh.pp=1", "--set", "mesh.dp=2", "--set", "train.zero=1"],
    "zbv": ["--set", "pipeline.style=zbv", "--set", "pipeline.chunks=2"],
}


@pytest.mark.distributed
@pytest.mark.parametrize("names", [
    ["tp2-dp2-zero1"],  # pp 2 x tp 2 -> tp 2 x dp 2 with ZeRO-1: every dimension changes
    pytest.param(["pp4", "zbv"], marks=pytest.mark.slow),  # a deeper pipeline; another schedule (about 35 s)
])
def test_resume_under_another_mesh_continues_the_run(tmp_path: Path, names: list[str]) -> None:
    spec = _resharding_spec(tmp_path)
    ref = tmp_path / "ref"
    proc, _ = run_cmd(["run", str(spec), "--nproc", "4", "--out", str(ref)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = dict(losses(ref))
    full = full_tensors(tmp_path / "ck" / step_name(4))
    # dcp_to_torch_save gives whole tensors under the model's names (the vocabulary padding left out)
    assert full["model/tok_embeddings.weight"].shape == (128, 64)
    assert full["model/layers.0.attention.wq.weight"].shape == (64, 64)
    assert full["optim/layers.0.attention.wq.weight/exp_avg"].shape == (64, 64)
    compared = [k for k, t in full.items() if k.startswith(("model/", "optim/")) and t.is_floating_point()]
    for name in names:
        sets = RESHARDED[name]
        ck = tmp_path / f"ck-{name}"
        shutil.copytree(tmp_path / "ck" / step_name(2), ck / step_name(2))
        (ck / "latest").write_text(step_name(2) + "\n")
        out = tmp_path / name
        proc, _ = run_cmd(["run", str(spec), "--nproc", "4", "--out", str(out), "--resume",
                           "--set", f'train.checkpoint.dir="{ck}"', *sets])
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "resharding checkpoint step-000002" in proc.stdout + proc.stderr, name
        got = dict(losses(out))
        assert sorted(got) == [3, 4], name
        for step in (3, 4):  # the next steps' losses are the uninterrupted run's
            assert abs(got[step] - want[step]) <= 1e-6, (name, step, got[step], want[step])
        # parameters and Adam moments after two more steps: equal up to the fp32 summation
        # order a tp / dp change brings; bitwise where only the schedule changed
        resumed = full_tensors(ck / step_name(4))
        for key in compared:
            if name == "zbv":
                assert torch.equal(resumed[key], full[key]), (name, key)
            else:
                torch.testing.assert_close(resumed[key], full[key], rtol=1e-5, atol=1e-6, msg=f"{name}: {key}")


@pytest.mark.distributed
def test_sigterm_saves_a_final_checkpoint(tmp_path: Path) -> None:
    spec = tiny_cpu_spec(tmp_path, "long", steps=200, every=0, ckpt_dir=tmp_path / "ck")
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "ppdsl", "run", str(spec), *TWO_RANKS, "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(), cwd=ROOT)
    try:
        deadline = time.monotonic() + HARD_TIMEOUT_S
        metrics = out / "metrics.jsonl"
        while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended or hung before step 2"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 143, stdout[-2000:] + stderr[-3000:]
    found = complete_checkpoints(tmp_path / "ck")
    assert len(found) == 1, stdout[-2000:] + stderr[-3000:]
    step = found[0][0]
    assert 2 <= step < 200
    assert losses(out)[-1][0] == step  # the checkpoint holds exactly the steps that were logged
    assert "stopped by SIGTERM" in stdout + stderr


@pytest.mark.distributed
def test_save_final_false_leaves_no_model(tmp_path: Path) -> None:
    spec = tiny_cpu_spec(tmp_path, "nofinal", steps=1, every=None)
    out = tmp_path / "out"
    proc, _ = run_cmd(["run", str(spec), *TWO_RANKS, "--out", str(out), "--set", "train.save_final=false"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "metrics.jsonl").is_file() and not (out / "final").exists() and "model:" not in proc.stdout
