"""Elastic resume: a job restarted at another world size (torchrun's elastic range, or `--resume`
with another `--nproc`) re-checks the spec for the new world (dp follows it, tp and pp stay),
reshards the newest checkpoint and keeps the global batch, saying so in one line; a spec whose
global batch would change with the world is refused before launch.

The two-launcher test is the real thing: two `ppdsl run --nnodes 1:2 --nproc 2` on localhost
(c10d rendezvous), one of them killed with its workers once a checkpoint exists; the survivor's
agent re-rendezvouses alone and the job finishes on 2 processes. It waits for torchrun's
rendezvous timeouts (about 30 s), so it is marked slow; the same resume path runs by default
through `--resume --nproc 2` on a checkpoint of `--nproc 4`."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _run_helpers import ROOT, env, free_port, losses, process_tree, run_cmd, spec_plan, tiny_cpu_spec
from ppdsl import cli
from ppdsl.runtime.checkpoint.store import (
    FORMAT,
    CheckpointMismatch,
    check_compatible,
    complete_checkpoints,
    fingerprint,
    resumed_line,
    step_name,
)

PP2 = ("--set", "mesh.tp=1")  # tiny_cpu as a 2-stage pipeline: dp = world / 2 (worlds 2 and 4)


def _meta(plan, step: int, *, recorded: bool = True) -> dict:
    """meta.json as Checkpointer.save writes it (`recorded`: with the world and microbatching;
    without: a format-2 checkpoint of an earlier ppdsl, where they are derived)."""
    meta = {"format": FORMAT, "step": step, "samples": step * plan.train.global_batch, "fingerprint": fingerprint(plan)}
    if recorded:
        meta |= {"world": plan.mesh.world, "global_batch": plan.train.global_batch,
                 "microbatch_size": plan.train.microbatch_size}
    return meta


# ---------------------------------------------------------------------------------------------
# No processes
# ---------------------------------------------------------------------------------------------


def test_the_resumed_line_says_what_changed_at_another_world(tmp_path: Path) -> None:
    spec = tiny_cpu_spec(tmp_path, "s", steps=6, every=3)
    four, two = spec_plan(spec, 4), spec_plan(spec, 2)
    want = ("ppdsl: resumed step 3 from ck/step-000003 on world 2 (was 4): dp 2 -> 1, microbatch size 1 -> 2, "
            "global batch 8 kept; continuing at step 4")
    for recorded in (True, False):  # an older format-2 meta.json: derived from the fingerprint
        meta = _meta(four, 3, recorded=recorded)
        assert resumed_line(meta, two, "ck/step-000003") == want
        # only dp changed: no resharding note (the line says it), the RNG caveat stays
        notes = check_compatible(meta, two, "ck/step-000003")
        assert len(notes) == 1 and "RNG states are per rank" in notes[0], notes
    assert resumed_line(_meta(two, 3), two, "ck/step-000003") == \
        "ppdsl: resumed from ck/step-000003 (step 3); continuing at step 4"
    # growing back, with the accumulation given instead of the microbatch count
    grown = spec_plan(spec, 4, ("mesh.tp=1", "pipeline.microbatches=2"))
    assert resumed_line(_meta(two, 3), grown, "ck") == ("ppdsl: resumed step 3 from ck on world 4 (was 2): dp 1 -> 2, "
                                                         "microbatches 4 -> 2, global batch 8 kept; continuing at step 4")


def test_a_global_batch_that_follows_the_world_cannot_resume_at_another(tmp_path: Path) -> None:
    spec = tiny_cpu_spec(tmp_path, "s", steps=6, every=3)
    spec.write_text(spec.read_text().replace("global_batch = 8", "global_batch = 4 * dp"))
    meta = _meta(spec_plan(spec, 4), 3)
    with pytest.raises(CheckpointMismatch, match=r"saved at world 4, this run has world 2: the spec's global batch "
                                                 r"depends on the world.*--set train.global_batch=8"):
        check_compatible(meta, spec_plan(spec, 2), "ck")


def test_an_elastic_range_is_refused_before_launch_when_the_global_batch_would_change(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    launched: list[object] = []
    monkeypatch.setattr("ppdsl.runtime.run.launch.launch", lambda *a, **k: launched.append(a) or 0)
    monkeypatch.setattr(sys, "argv", ["ppdsl"])
    spec = tiny_cpu_spec(tmp_path, "s", steps=6, every=3)
    spec.write_text(spec.read_text().replace("global_batch = 8", "global_batch = 4 * dp"))
    rdzv = ["--nnodes", "1:2", "--nproc", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:1"]
    code = cli.main(["run", str(spec), *PP2, *rdzv, "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and launched == [], err
    lines = err.splitlines()
    assert lines[0] == (
        "error[E0331]: --nnodes 1:2 x --nproc 2 can make world sizes 2, 4, and the spec's global batch differs between "
        "them (4 at world 2, 8 at world 4): a job restarted at another world could not resume its checkpoints, which "
        "keep the global batch")
    assert lines[1] == f"  --> {spec}:35:3" and "global_batch = 4 * dp" in lines[3]
    assert lines[5] == "   = hint: give one global batch for every world (e.g. --set train.global_batch=8), or a fixed --nnodes"
    # a fixed global batch over the range launches; so does a world-dependent one without checkpoints
    assert cli.main(["run", str(spec), *PP2, *rdzv, "--set", "train.global_batch=8", "--out", str(tmp_path / "o")]) == 0
    plain = tiny_cpu_spec(tmp_path, "p", steps=6, every=None)
    plain.write_text(plain.read_text().replace("global_batch = 8", "global_batch = 4 * dp"))
    assert cli.main(["run", str(plain), *PP2, *rdzv, "--out", str(tmp_path / "p")]) == 0
    assert len(launched) == 2


# ---------------------------------------------------------------------------------------------
# Real runs
# ---------------------------------------------------------------------------------------------


@pytest.mark.distributed
def test_resume_at_a_smaller_world_keeps_the_global_batch_and_the_losses(tmp_path: Path) -> None:
    # world 4 (dp 2) for 6 steps, checkpoints at 3 and 6; then world 2 (dp 1) from step 3's
    spec = tiny_cpu_spec(tmp_path, "shrink", steps=6, every=3, ckpt_dir=tmp_path / "ck")
    ref = tmp_path / "ref"
    proc, _ = run_cmd(["run", str(spec), *PP2, "--nproc", "4", "--out", str(ref)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = dict(losses(ref))
    ck = tmp_path / "ck2"
    shutil.copytree(tmp_path / "ck" / step_name(3), ck / step_name(3))
    (ck / "latest").write_text(step_name(3) + "\n")
    out = tmp_path / "out"
    proc, _ = run_cmd(["run", str(spec), *PP2, "--nproc", "2", "--out", str(out), "--resume",
                       "--set", f'train.checkpoint.dir="{ck}"'])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (f"ppdsl: resumed step 3 from {ck / step_name(3)} on world 2 (was 4): dp 2 -> 1, microbatch size 1 -> 2, "
            "global batch 8 kept; continuing at step 4") in proc.stdout
    assert "resharding" not in proc.stdout
    got = dict(losses(out))
    assert sorted(got) == [4, 5, 6]
    for step in got:  # dp 1 sums the same samples in another order: about 1e-7
        assert abs(got[step] - want[step]) <= 1e-6, (step, got[step], want[step])




def _kill_tree(pid: int) -> None:
    for p in process_tree(pid):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


ELASTIC_TIMEOUT_S = 300  # the whole elastic job; about 50-90 s on a shared 2-core machine


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds a launcher's workers through /proc")
def test_two_launchers_lose_one_and_the_job_continues_on_the_survivor(tmp_path: Path) -> None:
    spec = tiny_cpu_spec(tmp_path, "elastic", steps=8, every=2, ckpt_dir=tmp_path / "ck")
    ref = tmp_path / "ref"
    proc, _ = run_cmd(["run", str(spec), *PP2, "--nproc", "4", "--out", str(ref), "--set", "train.save_final=false",
                       "--set", f'train.checkpoint.dir="{tmp_path / "ck-ref"}"'])
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = dict(losses(ref))

    port = free_port()
    out = tmp_path / "out"
    # keep-alive: a lost node is dropped from the rendezvous after 2 s x 3; last call: the
    # survivor waits 20 s for nodes before it goes on alone (and the second launcher has as
    # long to join the first round)
    conf = "last_call_timeout=20,keep_alive_interval=2,keep_alive_max_attempt=3"
    cmd = [sys.executable, "-m", "ppdsl", "run", str(spec), *PP2, "--nnodes", "1:2", "--nproc", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "ppdsl-elastic",
           "--rdzv-conf", conf, "--max-restarts", "2", "--out", str(out)]
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    extra = env(PPDSL_TIMEOUT_S="30")

    def start(log: Path) -> subprocess.Popen:
        with open(log, "w") as f:
            return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=extra, cwd=ROOT)

    t0 = time.monotonic()
    deadline = t0 + ELASTIC_TIMEOUT_S
    # the first launcher hosts the rendezvous store (the c10d endpoint): the second is the one
    # to lose, as a lost store host would end the job everywhere
    survivor = start(logs[0])
    victim = None
    try:
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert survivor.poll() is None and time.monotonic() < deadline, logs[0].read_text()[-3000:]
                time.sleep(0.1)
        victim = start(logs[1])
        while not complete_checkpoints(tmp_path / "ck"):
            assert survivor.poll() is None and victim.poll() is None and time.monotonic() < deadline, \
                logs[0].read_text()[-3000:] + logs[1].read_text()[-3000:]
            time.sleep(0.1)
        killed_at = time.monotonic() - t0
        _kill_tree(victim.pid)  # the launcher, its torchrun agent and its two workers
        victim.wait(timeout=30)
        code = survivor.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in (survivor, victim):
            if p is not None and p.poll() is None:
                _kill_tree(p.pid)
                p.wait()
    elapsed = time.monotonic() - t0
    text = logs[0].read_text()
    both = text + logs[1].read_text()
    assert code == 0, text[-4000:]
    assert "on 4 cpu process(es), dp=2 pp=2 tp=1" in both  # the first round: both launchers
    m = re.search(r"ppdsl: resumed step (\d+) from \S+ on world 2 \(was 4\): dp 2 -> 1, microbatch size 1 -> 2, "
                  r"global batch 8 kept; continuing at step \d+", text)
    assert m, text[-4000:]
    resumed = int(m.group(1))
    assert resumed in (2, 4, 6)
    got = losses(out)
    assert [s for s, _ in got] == list(range(1, 9)), got
    for step, loss in got:  # before the kill at world 4, after it at world 2: the same run
        assert abs(loss - want[step]) <= 1e-6, (step, loss, want[step])
    assert [s for s, _ in complete_checkpoints(tmp_path / "ck")][-1] == 8
    print(f"checkpoint after {killed_at:.1f} s, resumed at step {resumed}, job done after {elapsed:.1f} s")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(r["step"] <= 8 for r in records)
