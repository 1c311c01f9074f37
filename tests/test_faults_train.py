"""Faults of training itself: a loss or gradient that is not finite (train.on_nonfinite,
train.max_nonfinite), pre-emption by SIGTERM, a data file changed under a run.

The fp16 loss scaler needs CUDA under `precision = fp16` (the preflight refuses it on CPU);
here the trainer gets the scaler object over fp32 compute, which runs its real path (the loss
scaled, the gradients unscaled, the one world-wide check, the scale halved) but not fp16
autocast's own overflows."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from _run_helpers import HARD_TIMEOUT_S, ROOT, env, full_tensors, losses, run_cmd, spec_plan, tiny_cpu_spec
from dist_harness import run_distributed
from ppdsl.runtime.checkpoint.store import complete_checkpoints

TWO_RANKS = ["--set", "mesh.tp=1", "--nproc", "2"]  # pp = 2


def _wait_for_records(launcher: subprocess.Popen, metrics: Path, n: int) -> None:
    """Until `metrics` holds `n` records; fails if the run ends or hangs first."""
    deadline = time.monotonic() + HARD_TIMEOUT_S
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= n):
        assert launcher.poll() is None and time.monotonic() < deadline, f"the run ended or hung before step {n}"
        time.sleep(0.05)


def _records(out: Path) -> list[dict[str, Any]]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]


def _plan_json(tmp_path: Path, name: str, *sets: str) -> dict[str, Any]:
    return spec_plan(tiny_cpu_spec(tmp_path, name, steps=5, every=None), 2, ["mesh.tp=1", *sets]).to_json()


# ---------------------------------------------------------------------------------------------
# The trainer's step logic, in 2 spawned ranks (pp = 2), with and without the loss scaler
# ---------------------------------------------------------------------------------------------


def _nonfinite_worker(rank: int, world: int, plans: dict[str, dict[str, Any]]) -> dict[str, Any]:
    from ppdsl.lowering.plan import Plan
    from ppdsl.runtime.run.failure import RunFault
    from ppdsl.runtime.parallel.groups import build_process_groups, tie_pp_ranks_of
    from ppdsl.runtime.train.metrics import MetricsLogger
    from ppdsl.runtime.train.optim import LossScaler
    from ppdsl.runtime.train.trainer import Trainer
    from ppdsl.runtime.train.loop import run_steps

    def trainer(key: str, scaled: bool = False) -> Trainer:
        plan = Plan.from_json(plans[key])
        groups = build_process_groups(plan.mesh, "cpu", tie_pp_ranks_of(plan.schedule.stage_ranks))
        t = Trainer(plan, groups, torch.device("cpu"))
        if scaled:
            t.scaler = LossScaler()  # fp16's dynamic loss scaling over fp32 compute
        return t

    def state(t: Trainer) -> list[torch.Tensor]:
        out = [p.detach().clone() for p in t.params]
        for p in t.params:
            out += [v.clone() for v in t.optimizer_state(p).values() if isinstance(v, torch.Tensor)]
        return out

    def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
        return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))

    out: dict[str, Any] = {}
    # the scaler's path against plain fp32: a power-of-two scale is exact, so the updates are
    # bit for bit the same, and both skip the step whose gradient (on rank 1 only) is NaN
    plain, scaled = trainer("skip"), trainer("skip", scaled=True)
    plain.step(0), scaled.step(0)
    out["equal_after_1"] = same(state(plain), state(scaled)) and scaled.scaler.scale == 2.0**16
    before = {"plain": state(plain), "scaled": state(scaled)}
    os.environ["PPDSL_TEST_FAULT"] = "nan:2:1"
    for name, t in (("plain", plain), ("scaled", scaled)):
        loss, norm, skipped = t.step(1)
        out[f"{name}_2"] = dict(skipped=skipped, untouched=same(before[name], state(t)),
                                schedule=t.scheduler.last_epoch)
    del os.environ["PPDSL_TEST_FAULT"]
    out["scale_after_2"] = scaled.scaler.scale
    plain.step(2), scaled.step(2)
    out["moved_after_3"] = not same(before["plain"], state(plain))
    out["equal_after_3"] = same(state(plain), state(scaled))

    # the policy in the loop
    def train(key: str, fault: str, scaled: bool = False) -> dict[str, Any]:
        t = trainer(key, scaled)
        os.environ["PPDSL_TEST_FAULT"] = fault
        logger = MetricsLogger(None, t.plan.train.steps, enabled=rank == 0, stream=io.StringIO())
        try:
            records = run_steps(t, logger)
            result: dict[str, Any] = {"fault": None}
        except RunFault as exc:
            records, result = [], {"fault": str(exc), "agreed": exc.agreed}
        finally:
            del os.environ["PPDSL_TEST_FAULT"]
        result["records"] = [(r.step, r.skipped, r.skipped_steps, r.loss_scale) for r in records]
        result["printed"] = logger.stream.getvalue()
        return result

    out["stop"] = train("stop", "nan:2:1")
    out["gaps"] = train("skip2", "nan:2,4:1", scaled=True)  # (2 in a row: a real run's test below)
    return out


@pytest.mark.distributed
def test_nonfinite_steps_are_skipped_alike_with_and_without_the_loss_scaler(tmp_path: Path) -> None:
    plans = {
        "skip": _plan_json(tmp_path, "skip"),
        "stop": _plan_json(tmp_path, "stop", "train.on_nonfinite=stop"),
        "skip2": _plan_json(tmp_path, "skip2", "train.max_nonfinite=2"),
    }
    results = run_distributed(_nonfinite_worker, 2, plans, timeout=HARD_TIMEOUT_S)
    for rank, r in enumerate(results):
        assert r["equal_after_1"], rank
        for name in ("plain", "scaled"):
            # every rank skips, though only rank 1's gradient was NaN; the LR schedule moved on
            assert r[f"{name}_2"] == dict(skipped=True, untouched=True, schedule=2), (rank, name, r[f"{name}_2"])
        assert r["scale_after_2"] == 2.0**15
        assert r["moved_after_3"] and r["equal_after_3"], rank

        assert r["stop"]["fault"] is not None and r["stop"]["agreed"], rank
        assert r["stop"]["fault"].startswith("stopped at step 2: a gradient was not finite (train.on_nonfinite = stop)")
        assert "the parameters are step 1's" in r["stop"]["fault"]
        assert r["gaps"]["fault"] is None, r["gaps"]  # two skips, never two in a row
    records = results[0]["gaps"]["records"]  # rank 0 logs; a skipped step always
    assert [(s, sk, n) for s, sk, n, _ in records] == [(1, False, 0), (2, True, 1), (3, False, 1), (4, True, 2),
                                                     (5, False, 2)]
    assert [scale for *_, scale in records] == [2.0**16, 2.0**15, 2.0**15, 2.0**14, 2.0**14]
    assert "skipped: not finite (2 so far)" in results[0]["gaps"]["printed"]
    assert "step 2/5" in results[0]["stop"]["printed"]  # the step that stopped the run is logged


# ---------------------------------------------------------------------------------------------
# Real runs: ppdsl run --nproc N
# ---------------------------------------------------------------------------------------------


@pytest.mark.distributed
def test_a_nan_gradient_on_one_rank_of_4_skips_the_step_everywhere(tmp_path: Path) -> None:
    spec = tiny_cpu_spec(tmp_path, "nan", steps=3, every=1, ckpt_dir=tmp_path / "ck")
    out = tmp_path / "out"
    proc, _ = run_cmd(["run", str(spec), "--nproc", "4", "--out", str(out)], PPDSL_TEST_FAULT="nan:3:1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = _records(out)
    assert [(r["step"], r["skipped"], r["skipped_steps"]) for r in records] == [(1, False, 0), (2, False, 0),
                                                                              (3, True, 1)]
    assert "skipped: not finite (1 so far)" in proc.stdout
    # the checkpoints before and after the skipped step hold the same parameters and Adam
    # state, over every rank's shards (rank 1's NaN reached no other rank's update either)
    found = dict(complete_checkpoints(tmp_path / "ck"))
    assert sorted(found) == [2, 3]
    two, three = full_tensors(found[2]), full_tensors(found[3])
    compared = [k for k in two if k.startswith(("model/", "optim/"))]
    assert len(compared) > 50 and any(k.endswith("/exp_avg") for k in compared)
    for key in compared:
        assert torch.equal(two[key], three[key]), key
    assert all(torch.isfinite(three[k]).all() for k in compared if three[k].is_floating_point())
    assert int(two["train/step"]) == 2 and int(three["train/step"]) == 3


@pytest.mark.distributed
def test_nonfinite_steps_in_a_row_stop_the_run_with_one_line(tmp_path: Path) -> None:
    spec = tiny_cpu_spec(tmp_path, "stop", steps=6, every=1, ckpt_dir=tmp_path / "ck")
    out = tmp_path / "out"
    proc, _ = run_cmd(["run", str(spec), *TWO_RANKS, "--out", str(out), "--set", "train.max_nonfinite=2"],
                      PPDSL_TEST_FAULT="nan:2-3:1")
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    ours = [line for line in proc.stderr.splitlines() if line.startswith("ppdsl")]
    assert ours == ["ppdsl run: stopped at step 3: a gradient was not finite for 2 steps in a row "
                    "(train.max_nonfinite = 2); no checkpoint written (the parameters are step 1's, the newest "
                    "checkpoint is step 2's)"], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "worker(s) failed" not in proc.stderr
    assert [s for s, _ in complete_checkpoints(tmp_path / "ck")] == [1, 2]  # nothing of step 3
    assert [(r["step"], r["skipped_steps"]) for r in _records(out)] == [(1, 0), (2, 1), (3, 2)]


@pytest.mark.slow  # three launches (about 60 s on a busy 2-core machine); SIGTERM alone: test_checkpoint
@pytest.mark.distributed
def test_sigterm_to_the_launcher_saves_and_resume_continues_the_uninterrupted_run(tmp_path: Path) -> None:
    steps = 12
    ref = tmp_path / "ref"
    proc, _ = run_cmd(["run", str(tiny_cpu_spec(tmp_path, "ref", steps=steps, every=None)), *TWO_RANKS, "--out", str(ref),
                       "--set", "train.save_final=false"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = dict(losses(ref))

    spec = tiny_cpu_spec(tmp_path, "long", steps=steps, every=0, ckpt_dir=tmp_path / "ck")
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "ppdsl", "run", str(spec), *TWO_RANKS, "--out", str(out), "--set", "train.save_final=false"]
    launcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(), cwd=ROOT)
    try:
        _wait_for_records(launcher, out / "metrics.jsonl", 2)
        launcher.send_signal(signal.SIGTERM)
        stdout, stderr = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert launcher.returncode == 143, stdout[-2000:] + stderr[-3000:]
    found = complete_checkpoints(tmp_path / "ck")
    assert len(found) == 1 and 2 <= found[0][0] < steps, (found, stdout[-2000:])
    stopped = found[0][0]
    assert [s for s, _ in losses(out)] == list(range(1, stopped + 1))  # the checkpoint is the last logged step
    assert f"ppdsl: stopped by SIGTERM after step {stopped}" in stdout

    proc, _ = run_cmd(["run", str(spec), *TWO_RANKS, "--out", str(out), "--set", "train.save_final=false",
                       "--resume"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = losses(out)
    assert [s for s, _ in got] == list(range(1, steps + 1))
    for step, loss in got:
        assert abs(loss - want[step]) <= 1e-6, (step, loss, want[step], stopped)


def _token_file(path: Path, tokens: int = 64_000) -> Path:
    (np.arange(tokens) % 97).astype(np.uint16).tofile(path)
    return path


def _token_spec(tmp_path: Path, name: str, data: Path, steps: int, ckpt: Path | None = None) -> Path:
    spec = tiny_cpu_spec(tmp_path, name, steps=steps, every=None if ckpt is None else 2, ckpt_dir=ckpt)
    text = spec.read_text().replace("data = synthetic(seed = 0)", f'data = tokens("{data}")')
    spec.write_text(text)
    return spec


@pytest.mark.slow  # the check itself runs by default: test_a_watched_token_file_that_shrinks_is_a_run_fault
@pytest.mark.distributed
def test_a_token_file_truncated_mid_run_ends_it_with_a_line_naming_the_file(tmp_path: Path) -> None:
    data = _token_file(tmp_path / "train.bin")
    spec = _token_spec(tmp_path, "tok", data, steps=300)
    out = tmp_path / "out"
    launcher = subprocess.Popen([sys.executable, "-m", "ppdsl", "run", str(spec), *TWO_RANKS, "--out", str(out)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(), cwd=ROOT)
    try:
        _wait_for_records(launcher, out / "metrics.jsonl", 2)
        os.truncate(data, 1000)
        stdout, stderr = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert launcher.returncode == 1, stdout[-2000:] + stderr[-3000:]
    assert f"token file {data} shrank from 128000 to 1000 bytes while the run read it" in stderr, stderr[-3000:]
    assert "SIGBUS" not in stderr.replace("crash the process (SIGBUS)", "") and "Traceback" not in stderr


# ---------------------------------------------------------------------------------------------
# Data files, no processes
# ---------------------------------------------------------------------------------------------


def _token_data(path: Path):
    from ppdsl.runtime.data.files import TokenData

    return TokenData(path=str(path), dtype=None, seed=0, seq_len=32, batch_size=8, microbatch_size=2, dp=1,
                     vocab_size=128)


def test_a_watched_token_file_removed_warns_once_and_reading_goes_on(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    data = _token_data(_token_file(tmp_path / "t.bin"))
    first = data.batch(0, 0).input_ids
    os.unlink(tmp_path / "t.bin")
    assert torch.equal(data.batch(0, 0).input_ids, first)  # the mapping keeps the removed file's data
    data.batch(1, 0)
    err = capsys.readouterr().err
    assert err.count("was removed during the run") == 1 and str(tmp_path / "t.bin") in err


def test_a_watched_token_file_that_shrinks_is_a_run_fault(tmp_path: Path) -> None:
    from ppdsl.runtime.run.failure import RunFault

    path = _token_file(tmp_path / "t.bin")
    data = _token_data(path)
    data.batch(0, 0)
    os.truncate(path, 4096)
    with pytest.raises(RunFault, match=f"token file {path} shrank from 128000 to 4096 bytes") as info:
        data.batch(200, 0)  # would read past the new end: SIGBUS without the check
    assert not info.value.agreed


def test_a_resume_on_changed_data_warns_naming_the_file(tmp_path: Path) -> None:
    from ppdsl.runtime.checkpoint.store import Checkpointer, check_compatible

    path = _token_file(tmp_path / "t.bin")
    plan = spec_plan(_token_spec(tmp_path, "tok", path, steps=4, ckpt=tmp_path / "ck"))
    recorded = Checkpointer(tmp_path / "ck", plan, 0).data_files
    assert set(recorded) == {str(path)} and recorded[str(path)]["size"] == 128_000
    from ppdsl.runtime.checkpoint.store import FORMAT, fingerprint

    meta = {"format": FORMAT, "step": 2, "samples": 2 * plan.train.global_batch, "fingerprint": fingerprint(plan),
            "data_files": recorded}
    assert not [n for n in check_compatible(meta, plan, "ck/step-000002") if "data file" in n]
    _token_file(path, tokens=64_000 + 32)
    notes = check_compatible(meta, plan, "ck/step-000002")
    assert [n for n in notes if "data file" in n] == [
        f"ppdsl: warning: data file {path} changed since the run of checkpoint ck/step-000002 read it "
        "(128000 -> 128064 bytes); the resumed run reads other samples than that run would"]
    _token_file(path)
    path.write_bytes(bytes(reversed(path.read_bytes())))  # the same size, other contents
    assert any("same size, other contents" in n for n in check_compatible(meta, plan, "ck/step-000002"))
    assert not Checkpointer(tmp_path / "ck", plan, 1).data_files  # only rank 0 writes meta.json
