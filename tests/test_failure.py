"""Failure behaviour: a killed rank ends the whole job quickly, and the output names it."""

from __future__ import annotations

from pathlib import Path

import pytest

from _run_helpers import run_cmd, tiny_cpu_spec
from ppdsl.runtime.run.launch import torchrun_args

# kill -9 of one rank: its peers see the closed connection at once; torchrun then stops the
# rest. Well under the documented bound (PPDSL_TIMEOUT_S, default 120 s), plus start-up.
KILL_BOUND_S = 30


def test_launcher_flags_stay_with_the_launcher() -> None:
    args = torchrun_args("s.ppspec", ["run", "s.ppspec", "--nproc", "4", "--max-restarts", "2", "--resume"], 4, 2)
    assert args == ["--standalone", "--nproc-per-node=4", "--max-restarts=2", "--module", "ppdsl",
                    "run", "s.ppspec", "--resume"]


def test_resume_without_a_checkpoint_block_is_a_usage_error(tmp_path: Path) -> None:
    spec = tiny_cpu_spec(tmp_path, "plain", steps=2, every=None)
    proc, _ = run_cmd(["run", str(spec), "--nproc", "4", "--resume"], timeout=120)
    assert proc.returncode == 2
    assert "--resume needs a checkpoint block" in proc.stderr


@pytest.mark.distributed
def test_kill_9_of_one_rank_of_4_ends_the_job_and_names_it(tmp_path: Path) -> None:
    spec = tiny_cpu_spec(tmp_path, "kill", steps=6, every=None)
    proc, elapsed = run_cmd(["run", str(spec), "--nproc", "4", "--out", str(tmp_path / "out")],
                            timeout=180, PPDSL_TEST_FAULT="step:3:2")
    assert proc.returncode == 1, proc.stderr[-3000:]
    report = proc.stderr[proc.stderr.index("worker(s) failed"):]
    assert "rank 2 was killed by SIGKILL during step 3" in report.splitlines()[1], report
    # the survivors say what they saw, each naming itself and the step
    assert "stopped at step 3: lost contact with a peer" in proc.stderr
    # the whole job, start-up included (about 20-40 s of it on 2 cores)
    assert elapsed < 60 + KILL_BOUND_S, elapsed
    print(f"job ended {elapsed:.1f} s after start")


@pytest.mark.distributed
def test_max_restarts_resumes_from_the_last_checkpoint(tmp_path: Path) -> None:
    spec = tiny_cpu_spec(tmp_path, "restart", steps=4, every=2, ckpt_dir=tmp_path / "ck")
    out = tmp_path / "out"
    proc, _ = run_cmd(["run", str(spec), "--set", "mesh.tp=1", "--nproc", "2", "--out", str(out),
                       "--max-restarts", "1"], PPDSL_TEST_FAULT="step:3:1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout and "step 2" in proc.stdout
    import json

    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
