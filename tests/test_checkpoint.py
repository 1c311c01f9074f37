"""Checkpoints: layout and atomic publishing (no processes), then real runs (gloo, 2 ranks):
resume equals the uninterrupted run bit for bit, a kill during a save leaves the previous
checkpoint, another mesh is refused, SIGTERM saves a final checkpoint."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _run_helpers import HARD_TIMEOUT_S, ROOT, env, losses, run_cmd, snapshot, tiny_spec
from ppdsl.runtime.checkpoint import (
    CheckpointMismatch,
    check_compatible,
    complete_checkpoints,
    fingerprint,
    latest_checkpoint,
    resume_decision,
    step_name,
)

TWO_RANKS = ["--set", "mesh.tp=1", "--nproc", "2"]  # pp = 2: fastest to start on 2 cores


def _plan(spec: Path, world: int = 2, overrides: tuple[str, ...] = ("mesh.tp=1",)):
    from ppdsl.dsl.check import check_file
    from ppdsl.lowering.lower import lower

    r = check_file(str(spec), world=world, overrides=list(overrides), model=False)
    assert r.ok, r.diagnostics
    return lower(r.spec, world, r.model_info)


def _fake_checkpoint(root: Path, step: int, plan, *, complete: bool = True) -> Path:
    p = root / (step_name(step) if complete else f".{step_name(step)}.tmp-abcd1234")
    p.mkdir(parents=True)
    if complete:
        (p / "meta.json").write_text(json.dumps({"format": 1, "step": step, "fingerprint": fingerprint(plan)}))
    return p


# ---------------------------------------------------------------------------------------------
# No processes
# ---------------------------------------------------------------------------------------------


def test_only_complete_checkpoints_count(tmp_path: Path) -> None:
    spec = tiny_spec(tmp_path, "s", steps=6, every=3)
    plan = _plan(spec)
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
    spec = tiny_spec(tmp_path, "s", steps=6, every=3)
    plan = _plan(spec)
    assert resume_decision(plan, resume=False) == (None, [])
    path, notes = resume_decision(plan, resume=True)
    assert path is None and "no complete checkpoint" in notes[0]
    _fake_checkpoint(tmp_path / "ckpt", 3, plan)
    with pytest.raises(ValueError, match="already holds checkpoints.*--resume"):
        resume_decision(plan, resume=False)
    assert resume_decision(plan, resume=True)[0].endswith("step-000003")
    assert resume_decision(plan, resume=False, restarted=True)[0].endswith("step-000003")
    no_ckpt = _plan(tiny_spec(tmp_path, "n", steps=6, every=None))
    with pytest.raises(ValueError, match="--resume needs a checkpoint block"):
        resume_decision(no_ckpt, resume=True)


def test_another_mesh_is_refused_by_name(tmp_path: Path) -> None:
    spec = tiny_spec(tmp_path, "s", steps=6, every=3)
    saved = _plan(spec, 2)
    meta = {"format": 1, "step": 3, "fingerprint": fingerprint(saved)}
    other = _plan(spec, 4, ("mesh.tp=1", "mesh.pp=4"))
    with pytest.raises(CheckpointMismatch, match=r"saved with mesh dp=1 pp=2 tp=1, but this run has mesh dp=1 pp=4 tp=1"):
        check_compatible(meta, other, "ck/step-000003")
    assert check_compatible(meta, saved, "ck") == []
    longer = _plan(spec, 2, ("mesh.tp=1", "train.steps=9"))
    assert check_compatible(meta, longer, "ck") == []  # more steps: allowed, silently


# ---------------------------------------------------------------------------------------------
# Real runs
# ---------------------------------------------------------------------------------------------


@pytest.mark.distributed
def test_resume_equals_uninterrupted_and_a_kill_during_save_keeps_the_previous(tmp_path: Path) -> None:
    # rank 1 is killed after writing its part of checkpoint 6, before it is published
    spec = tiny_spec(tmp_path, "cut", steps=6, every=3, ckpt_dir=tmp_path / "ck")
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

    # resuming under another mesh is refused before anything starts, and changes nothing
    before = snapshot(root)
    proc, elapsed = run_cmd(["run", str(spec), "--set", "mesh.tp=2", "--set", "mesh.pp=1", "--nproc", "2",
                             "--out", str(out), "--resume"])
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "saved with mesh dp=1 pp=2 tp=1, but this run has mesh dp=1 pp=1 tp=2" in proc.stderr
    assert snapshot(root) == before
    # and a fresh start into a dir holding checkpoints is refused too (it would prune them)
    proc, _ = run_cmd(["run", str(spec), *TWO_RANKS, "--out", str(out)])
    assert proc.returncode == 2 and "already holds checkpoints" in proc.stderr
    assert snapshot(root) == before


@pytest.mark.distributed
def test_sigterm_saves_a_final_checkpoint(tmp_path: Path) -> None:
    spec = tiny_spec(tmp_path, "long", steps=200, every=0, ckpt_dir=tmp_path / "ck")
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
    spec = tiny_spec(tmp_path, "nofinal", steps=1, every=None)
    out = tmp_path / "out"
    proc, _ = run_cmd(["run", str(spec), *TWO_RANKS, "--out", str(out), "--set", "train.save_final=false"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "metrics.jsonl").is_file() and not (out / "final").exists() and "model:" not in proc.stdout
