"""Faults around checkpoints: damaged checkpoints (no processes: what resume decides; real runs:
damage found by the ranks while loading), rotation, a disk that fills during a save, and kill -9
of the whole job (the launcher and every worker) at random moments, resumed to the end with
the uninterrupted run's losses."""

from __future__ import annotations

import json
import os
import random
import re
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from _run_helpers import HARD_TIMEOUT_S, ROOT, env, losses, process_tree, run_cmd, spec_plan, tiny_cpu_spec
from ppdsl.runtime.checkpoint.store import (
    FORMAT,
    CheckpointMismatch,
    Checkpointer,
    CheckpointUnusable,
    file_record,
    fingerprint,
    problem,
    resume_candidates,
    share_problem,
    step_name,
)

TWO_RANKS = ["--set", "mesh.tp=1", "--nproc", "2"]  # pp = 2: two data files, fastest to start
STEPS = 6


def _fake(root: Path, step: int, plan) -> Path:
    """A checkpoint as a save publishes it: .metadata, two data files, meta.json listing them."""
    p = root / step_name(step)
    p.mkdir(parents=True)
    for name, data in ((".metadata", b"metadata %d" % step), ("__0_0.distcp", b"rank0" * 40), ("__1_0.distcp", b"rank1" * 40)):
        (p / name).write_bytes(data)
    meta = {"format": FORMAT, "step": step, "samples": step * plan.train.global_batch, "fingerprint": fingerprint(plan),
            "files": {n: file_record(p / n) for n in (".metadata", "__0_0.distcp", "__1_0.distcp")}}
    (p / "meta.json").write_text(json.dumps(meta))
    return p


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


# ---------------------------------------------------------------------------------------------
# No processes
# ---------------------------------------------------------------------------------------------


def test_resume_walks_from_the_newest_and_names_what_it_skips(tmp_path: Path) -> None:
    spec = tiny_cpu_spec(tmp_path, "s", steps=STEPS, every=1)
    plan = spec_plan(spec)
    root = tmp_path / "ckpt"
    for s in (1, 2, 3, 4, 5, 6):
        _fake(root, s, plan)
    (root / ".step-000007.tmp-0123abcd").mkdir()  # a save killed before publishing
    (root / "step-000006" / "meta.json").unlink()
    (root / "step-000005" / "meta.json").write_text("{ not json")
    (root / "step-000004" / "__1_0.distcp").write_bytes(b"rank1")  # truncated
    _flip(root / "step-000003" / ".metadata", 2)
    (root / "step-000002" / "__0_0.distcp").unlink()
    (root / "latest").write_bytes(b"\xff\xfegarbage")  # never trusted for more than a hint
    usable, notes = resume_candidates(plan, resume=True)
    assert usable == [str(root / "step-000001")]
    prefix = "ppdsl: note: skipped checkpoint "
    assert all(n.startswith(prefix) for n in notes), notes
    where = [n.removeprefix(prefix).split(": ", 1) for n in notes]
    assert [w[0] for w in where] == [str(root / p) for p in (
        ".step-000007.tmp-0123abcd", "step-000006", "step-000005", "step-000004", "step-000003", "step-000002")]
    whys = [w[1] for w in where]
    assert whys[0] == "incomplete (a save that did not finish)"
    assert whys[1] == "meta.json is missing"
    assert whys[2].startswith("meta.json is unreadable (JSONDecodeError")
    assert whys[3] == "__1_0.distcp is 5 bytes, meta.json records 200 (truncated)"
    assert whys[4] == ".metadata is damaged (its checksum differs from the one meta.json records)"
    assert whys[5] == "__0_0.distcp is missing"
    # the elastic restart path decides alike
    assert resume_candidates(plan, resume=False, restarted=True)[0] == usable


def test_no_intact_checkpoint_is_refused_naming_the_file(tmp_path: Path) -> None:
    spec = tiny_cpu_spec(tmp_path, "s", steps=STEPS, every=1)
    plan = spec_plan(spec)
    root = tmp_path / "ckpt"
    for s in (3, 4):
        _fake(root, s, plan)
        (root / step_name(s) / "__0_0.distcp").write_bytes(b"")
    with pytest.raises(CheckpointUnusable, match=r"no intact checkpoint in .*ckpt \(step-000004: __0_0.distcp is 0 "
                                                 r"bytes, meta.json records 200 \(truncated\); step-000003: .*nothing was changed"):
        resume_candidates(plan, resume=True)
    # a fresh start into it is refused as before (the run would prune them)
    with pytest.raises(ValueError, match="already holds checkpoints"):
        resume_candidates(plan, resume=False)


def test_a_dir_of_another_model_is_refused_not_skipped(tmp_path: Path) -> None:
    spec = tiny_cpu_spec(tmp_path, "s", steps=STEPS, every=1)
    plan = spec_plan(spec)
    other = spec_plan(spec, overrides=("mesh.tp=1", "model.config.dim=32"))
    root = tmp_path / "ckpt"
    _fake(root, 3, other)
    _fake(root, 4, other)
    (root / "step-000004" / "meta.json").unlink()  # damaged: skipped; the next intact one decides
    with pytest.raises(CheckpointMismatch, match="step-000003 was saved by a different plan .model"):
        resume_candidates(plan, resume=True)
    # an older checkpoint of another plan is no fallback for this one
    _fake(root, 5, plan)
    assert resume_candidates(plan, resume=True)[0] == [str(root / "step-000005")]


def test_rotation_keeps_the_newest_intact_checkpoints(tmp_path: Path) -> None:
    spec = tiny_cpu_spec(tmp_path, "s", steps=STEPS, every=1)
    plan = spec_plan(spec)
    root = tmp_path / "ckpt"
    for s in (1, 2, 3, 4):
        _fake(root, s, plan)
    (root / "latest").write_text("step-000004\n")
    for s in (2, 3):  # truncated: rotation counting these would delete the only intact older one
        (root / step_name(s) / "__1_0.distcp").write_bytes(b"x")
    Checkpointer(root, plan, rank=0)._prune(keep_step=4)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000001", "step-000002", "step-000003", "step-000004"]
    _fake(root, 5, plan)
    (root / "latest").write_text("step-000005\n")
    Checkpointer(root, plan, rank=0)._prune(keep_step=5)  # two intact ones newer: the older ones go
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000004", "step-000005"]
    assert problem(root / "step-000004")[0] is None


# ---------------------------------------------------------------------------------------------
# Real runs (gloo, 2 ranks): one uninterrupted run, its checkpoints copied for each case
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The uninterrupted run: STEPS steps, a checkpoint after each (the last two kept)."""
    d = tmp_path_factory.mktemp("base")
    spec = tiny_cpu_spec(d, "base", steps=STEPS, every=1, ckpt_dir=d / "ck")
    proc, _ = run_cmd(["run", str(spec), *TWO_RANKS, "--out", str(d / "out")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"ck": d / "ck", "losses": losses(d / "out"), "out": d / "out"}


def _resume_from_copy(base: dict, tmp_path: Path, damage=None, **extra: str):
    ck = tmp_path / "ck"
    shutil.copytree(base["ck"], ck)
    out = tmp_path / "out"
    shutil.copytree(base["out"], out)
    if damage is not None:
        damage(ck)
    spec = tiny_cpu_spec(tmp_path, "resume", steps=STEPS, every=1, ckpt_dir=ck)
    proc, _ = run_cmd(["run", str(spec), *TWO_RANKS, "--out", str(out), "--resume"], **extra)
    return proc, ck, out


@pytest.mark.distributed
def test_damage_found_by_a_rank_while_loading_is_skipped(base: dict, tmp_path: Path) -> None:
    # a flipped byte inside a tensor's payload: the size is right, only the checksum knows
    # (rank 1 checks __1_0.distcp: file i of the sorted list is rank i % world's)
    proc, ck, out = _resume_from_copy(base, tmp_path, lambda ck: _flip(ck / "step-000006" / "__1_0.distcp", 700_000))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (f"ppdsl: note: skipped checkpoint {ck / 'step-000006'}: __1_0.distcp is damaged (its checksum differs "
            "from the one meta.json records)") in proc.stdout
    assert "resumed from" in proc.stdout and "(step 5)" in proc.stdout
    assert losses(out) == base["losses"]
    assert problem(ck / "step-000006")[0] is None  # step 6 written again


@pytest.mark.slow
@pytest.mark.distributed
def test_every_checkpoint_damaged_is_a_clear_refusal(base: dict, tmp_path: Path) -> None:
    def damage(ck: Path) -> None:
        for s in (5, 6):
            _flip(ck / step_name(s) / "__1_0.distcp", 700_000)

    proc, ck, _ = _resume_from_copy(base, tmp_path, damage)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert (f"ppdsl run: no intact checkpoint in {ck} (step-000006: __1_0.distcp is damaged (its checksum differs from "
            "the one meta.json records); step-000005: __1_0.distcp is damaged") in proc.stderr
    assert proc.stderr.count("no intact checkpoint") == 1  # rank 0 says it
    assert "Traceback" not in proc.stderr


def _tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True)
    if os.geteuid() != 0:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


@pytest.mark.distributed
def test_a_full_disk_during_a_save_keeps_the_previous_checkpoint(base: dict, tmp_path: Path) -> None:
    """A real full file system where one can be mounted (a 4 MiB tmpfs holds one checkpoint of
    2.9 MB, not two); else a file size limit (RLIMIT_FSIZE, EFBIG) in the launcher and workers."""
    disk = tmp_path / "disk"
    mounted = _tmpfs(disk, "4m")
    try:
        ck = disk / "ck"
        ck.mkdir()
        shutil.copytree(base["ck"] / "step-000005", ck / "step-000005")
        (ck / "latest").write_text("step-000005\n")
        out = tmp_path / "out"
        shutil.copytree(base["out"], out)
        spec = tiny_cpu_spec(tmp_path, "full", steps=STEPS, every=1, ckpt_dir=ck)
        cmd = [sys.executable, "-m", "ppdsl", "run", str(spec), *TWO_RANKS, "--out", str(out), "--resume"]

        def limit() -> None:  # a data file is 1.4 MB; Python ignores SIGXFSZ, so writes get EFBIG
            resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))

        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=HARD_TIMEOUT_S, env=env(), cwd=ROOT,
                              preexec_fn=None if mounted else limit)
        assert proc.returncode == 1, proc.stderr[-3000:]
        why = "No space left on device" if mounted else "File too large"
        # the OSError's words and the rank (and the file when the error names one; where torch's
        # writer hid the OSError, the free space on the file system)
        assert re.search(rf"^ppdsl run: checkpoint step-000006 could not be written to {re.escape(str(ck))}: {why} "
                         r"\(.*rank \d\)?\); the previous checkpoint step-000005 is intact$", proc.stderr, re.M), proc.stderr
        assert proc.stderr.count("could not be written") == 1
        assert "Traceback" not in proc.stderr
        assert sorted(p.name for p in ck.iterdir()) == ["latest", "step-000005"]  # the .tmp removed
        assert share_problem(ck / "step-000005", 0, 1)[0] is None  # every file's checksum
    finally:
        if mounted:
            subprocess.run(["umount", str(disk)], check=False)


# ---------------------------------------------------------------------------------------------
# kill -9 of the whole job
# ---------------------------------------------------------------------------------------------


def _run_killed(args: list[str], rng: random.Random, steps: int) -> str:
    """Start ``ppdsl run ARGS`` and kill -9 the launcher and all its workers at a random
    moment: a random delay (0-0.4 s: inside the save, or the next step) after a random step's
    line appears. Returns what happened, for the message of a failing assert."""
    target = rng.randint(1, steps - 1)
    delay = rng.uniform(0.0, 0.4)
    proc = subprocess.Popen([sys.executable, "-m", "ppdsl", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env(), cwd=ROOT, start_new_session=True)
    seen = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(f"step {target}/"):
                seen.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + HARD_TIMEOUT_S
    while not seen.is_set() and proc.poll() is None and time.monotonic() < deadline:
        seen.wait(0.05)
    if proc.poll() is not None:
        return f"finished before step {target} (rc {proc.returncode})"
    time.sleep(delay)
    pids = process_tree(proc.pid)
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=30)
    reader.join(timeout=10)
    return f"killed {len(pids)} processes {delay:.2f} s after step {target}"


def _kill_and_resume(tmp_path: Path, want: list, rng: random.Random, nproc_args: list[str],
                     kills: int) -> tuple[list[str], float]:
    """One job into fresh dirs: `kills` kill -9 moments in a row (each in the run the previous
    one resumed), then ``--resume`` to the end; its losses must be `want`. Returns what each
    kill hit and the largest loss difference."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    spec = tiny_cpu_spec(tmp_path, "job", steps=STEPS, every=1, ckpt_dir=tmp_path / "ck")
    out = tmp_path / "out"
    log = []
    for k in range(kills):
        args = ["run", str(spec), *nproc_args, "--out", str(out), *(["--resume"] if k else [])]
        log.append(_run_killed(args, rng, STEPS))
    proc, elapsed = run_cmd(["run", str(spec), *nproc_args, "--out", str(out), "--resume"])
    assert proc.returncode == 0, (log, proc.stdout[-2000:], proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, (log, proc.stderr[-3000:])
    got = losses(out)
    assert [s for s, _ in got] == [s for s, _ in want], (log, got)
    diff = max(abs(a - b) for (_, a), (_, b) in zip(got, want))
    assert diff <= 1e-6, (log, got, want)
    return log, diff


@pytest.mark.distributed
def test_kill_9_of_the_whole_job_at_random_moments_then_resume(base: dict, tmp_path: Path) -> None:
    # two moments: the first run killed, the run resuming it killed too, then resumed to the end
    log, diff = _kill_and_resume(tmp_path, base["losses"], random.Random(19), TWO_RANKS, kills=2)
    print(log, diff)


@pytest.mark.slow
@pytest.mark.distributed
def test_kill_9_at_20_random_moments_tiny_cpu_world_4(tmp_path: Path) -> None:
    """The issue's criterion: specs/tiny_cpu.ppspec (tp 2 x pp 2) on 4 processes, a checkpoint
    every step; 20 seeded moments, each a fresh job killed once and resumed to the end."""
    four = ["--nproc", "4"]
    spec = tiny_cpu_spec(tmp_path, "ref", steps=STEPS, every=1, ckpt_dir=tmp_path / "ref-ck")
    proc, _ = run_cmd(["run", str(spec), *four, "--out", str(tmp_path / "ref")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = losses(tmp_path / "ref")
    rng = random.Random(2019)
    t0 = time.monotonic()
    for i in range(20):
        log, diff = _kill_and_resume(tmp_path / f"m{i}", want, rng, four, kills=1)
        print(f"moment {i + 1}: {log[0]}; resumed to step {STEPS}, max loss difference {diff:.1e} "
              f"({time.monotonic() - t0:.0f} s)", flush=True)
