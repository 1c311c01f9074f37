"""Faults of the launcher: workers die with it (runtime/run/lifetime.py), and one run writes a run
directory at a time (runtime/run/lock.py). The distributed cases start real `ppdsl run` / torchrun
process trees, each with a hard timeout, and find their workers by a marker in /proc/PID/environ."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from ppdsl.runtime.checkpoint.store import complete_checkpoints
from ppdsl.runtime.run.lock import (LOCK_ENV, Holder, LockBusy, lock_run, refuse_if_busy, release_worker_lock,
                                take_for_worker)
from ppdsl.runtime.run.rundir import LOCK_FILE

from _run_helpers import HARD_TIMEOUT_S, ROOT, env, run_cmd, snapshot, tiny_cpu_spec

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and PR_SET_PDEATHSIG")
MARKER = "PPDSL_TEST_MARKER"
ORPHAN_STEPS = 400  # orphaned workers would train on for minutes, not finish within the 15 s looked at


# ---- the lock ------------------------------------------------------------------------------------


def _holder_process(tmp_path: Path, out: Path, ckpt: Path | None = None, *, child: bool = False) -> subprocess.Popen:
    """Another process holding the lock of `out` (and `ckpt`), until killed. With `child`, it
    first starts a long-lived child of its own that inherits every descriptor it may."""
    code = (
        "import subprocess, sys, time\n"
        "from ppdsl.runtime.run.lock import lock_run\n"
        f"lock = lock_run({str(out)!r}, {None if ckpt is None else str(ckpt)!r})\n"
        + ("c = subprocess.Popen(['sleep', '60'], close_fds=False)\n" if child else "")
        + f"print('held', {'c.pid' if child else '0'}, flush=True)\n"
        "time.sleep(120)\n"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env(), cwd=tmp_path)
    assert p.stdout is not None
    word, child_pid = p.stdout.readline().split()
    assert word == "held"
    p.child_pid = int(child_pid)  # type: ignore[attr-defined]
    return p


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_the_lock_records_its_holder_is_not_inherited_and_goes_at_release(tmp_path: Path) -> None:
    out = tmp_path / "runs" / "a"  # created, with its parent
    lock = lock_run(out, None)
    path = out / LOCK_FILE
    holder = Holder.parse(path.read_text())
    assert holder is not None and (holder.host, holder.pid) == (socket.gethostname(), os.getpid())
    assert holder.command.startswith("ppdsl") and holder.started[:4].isdigit()
    assert lock.notes == [] and not os.get_inheritable(lock.locks[0].fd)
    with pytest.raises(LockBusy):  # another open of the file, even in this process
        lock_run(out, None)
    lock.release()
    assert not path.exists()
    lock_run(out, None).release()  # free again


def test_a_live_holder_is_named_and_nothing_is_changed(tmp_path: Path) -> None:
    out, ckpt = tmp_path / "run", tmp_path / "ckpt"
    holder = _holder_process(tmp_path, out, ckpt)
    try:
        (out / "metrics.jsonl").write_text("{}\n")
        before = snapshot(tmp_path)
        with pytest.raises(LockBusy) as exc:
            lock_run(out, ckpt)
        msg = str(exc.value)
        assert f"run directory {out} is in use by a live run (pid {holder.pid} on {socket.gethostname()}, started " in msg
        assert "(nothing was changed)" in msg and "\n" not in msg
        with pytest.raises(LockBusy, match=f"pid {holder.pid} on"):  # the quick look before a launch's checks
            refuse_if_busy(out)
        refuse_if_busy(tmp_path / "elsewhere")
        # the checkpoint directory alone, from another run directory: refused, and the run
        # directory this call created is gone again
        with pytest.raises(LockBusy, match=f"checkpoint directory {ckpt} is in use by a live run .pid {holder.pid} "):
            lock_run(tmp_path / "other" / "run", ckpt)
        assert not (tmp_path / "other").exists()
        assert snapshot(tmp_path) == before
    finally:
        holder.kill()
        holder.wait()


def test_a_checkpoint_dir_inside_the_run_dir_is_one_lock(tmp_path: Path) -> None:
    with lock_run(tmp_path / "run", tmp_path / "run" / "ckpt") as lock:
        assert [x.path for x in lock.locks] == [tmp_path / "run" / LOCK_FILE]
    with lock_run(tmp_path / "run", tmp_path / "ckpt") as lock:
        assert [x.path for x in lock.locks] == [tmp_path / "run" / LOCK_FILE, tmp_path / "ckpt" / LOCK_FILE]


def test_a_stale_lock_is_taken_over_with_one_line(tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    dead = Holder(socket.gethostname(), _dead_pid(), "2026-01-01T00:00:00+00:00", "ppdsl run old.ppspec --nproc 4")
    (out / LOCK_FILE).write_text(dead.to_text())
    with lock_run(out, None) as lock:
        assert lock.notes == [f"ppdsl: took over the stale lock {out / LOCK_FILE} of pid {dead.pid} on "
                              f"{dead.host} (started 2026-01-01T00:00:00+00:00; its process is gone)"]
        assert Holder.parse((out / LOCK_FILE).read_text()).pid == os.getpid()
    (out / LOCK_FILE).write_text(Holder("elsewhere", 1, "t", "c").to_text())
    with lock_run(out, None) as lock:
        assert "of pid 1 on elsewhere" in lock.notes[0] and "does not share flock locks between hosts" in lock.notes[0]


def test_a_killed_holder_leaves_a_stale_lock_even_with_a_child_alive(tmp_path: Path) -> None:
    out = tmp_path / "run"
    holder = _holder_process(tmp_path, out, child=True)  # its child (sleep 60) outlives it
    holder.kill()
    holder.wait()
    try:
        with lock_run(out, None) as lock:
            assert f"of pid {holder.pid} on" in lock.notes[0] and "its process is gone" in lock.notes[0]
        assert _alive(holder.child_pid)  # type: ignore[attr-defined]
    finally:
        os.kill(holder.child_pid, signal.SIGKILL)  # type: ignore[attr-defined]


def test_a_file_system_without_flock_gets_a_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno
    import fcntl

    def no_flock(fd: int, how: int) -> None:
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    with lock_run(tmp_path / "run", None) as lock:
        assert lock.notes == [f"ppdsl: warning: this file system does not support flock ({tmp_path / 'run' / LOCK_FILE}); "
                              "two runs into this directory are not kept apart"]
    assert not (tmp_path / "run" / LOCK_FILE).exists()


def test_a_worker_takes_the_lock_unless_its_launcher_holds_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(LOCK_ENV, "1234")
    assert take_for_worker(tmp_path / "run", None) == [] and not (tmp_path / "run").exists()
    monkeypatch.delenv(LOCK_ENV)
    take_for_worker(tmp_path / "run", None)
    assert (tmp_path / "run" / LOCK_FILE).exists()
    release_worker_lock()
    assert not (tmp_path / "run" / LOCK_FILE).exists()


# ---- a worker dies with its parent ---------------------------------------------------------------


def test_die_with_parent_when_the_parent_is_killed_or_already_gone(tmp_path: Path) -> None:
    marker = uuid.uuid4().hex
    child = ("import os, time\n"
             "from ppdsl.runtime.run.lifetime import die_with_parent\n"
             "print(die_with_parent(), os.getpid(), flush=True)\n"
             "time.sleep(60)\n")
    parent = ("import subprocess, sys, time\n"
              f"p = subprocess.Popen([sys.executable, '-c', {child!r}], start_new_session=True)\n"
              "time.sleep(60)\n")
    p = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True, env=env(**{MARKER: marker}))
    assert p.stdout is not None
    how, pid = p.stdout.readline().split()
    assert how == "prctl"
    p.kill()
    p.wait()
    assert _wait_gone([int(pid)], 5.0) < 5.0
    # started with a launcher pid that is not its parent (the launcher died before the prctl call)
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=30,
                          env=env(PPDSL_LAUNCHER_PID=str(_dead_pid())))
    assert proc.returncode == -signal.SIGKILL and "its launcher (pid" in proc.stderr


# ---- the launcher killed, a second run into a live run -------------------------------------------


@pytest.mark.distributed
def test_kill_9_of_the_launcher_stops_every_worker_and_a_second_run_is_refused(tmp_path: Path) -> None:
    spec = tiny_cpu_spec(tmp_path, "t", steps=ORPHAN_STEPS, every=2)
    out, ckpt = tmp_path / "run", tmp_path / "ckpt"
    marker = uuid.uuid4().hex
    launcher = _start([sys.executable, "-m", "ppdsl", "run", str(spec), "--nproc", "4", "--out", str(out)], marker,
                      tmp_path / "launcher.log")
    try:
        _wait_for(lambda: (ckpt / "step-000004").is_dir(), launcher)
        workers = _marked_pids(marker, workers=True)
        assert len(workers) == 4, workers
        # a second run into the live run's directory: refused before launch, naming it
        second, took = run_cmd(["run", str(spec), "--nproc", "4", "--out", str(out), "--resume"], timeout=60)
        assert second.returncode == 2, second.stderr
        assert f"is in use by a live run (pid {launcher.pid} on {socket.gethostname()}, started" in second.stderr
        assert took < 20, took
        print(f"second launch refused in {took:.1f} s")
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=10)
        gone = _wait_gone(workers, 15.0)
        print(f"kill -9 of the launcher: every worker gone after {gone:.2f} s")
        assert gone < 15.0, [p for p in workers if _alive(p)]
    finally:
        _kill_all(launcher, marker)
    found = complete_checkpoints(ckpt)
    published = sorted(p for p in ckpt.iterdir() if p.name.startswith("step-"))
    assert published == [p for _, p in found]  # nothing half-written under a published name
    last = found[-1][0]
    # --resume then works: it takes over the dead launcher's lock and continues
    proc, _ = run_cmd(["run", str(spec), "--nproc", "4", "--out", str(out), "--resume",
                       "--set", f"train.steps={last + 1}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"ppdsl: took over the stale lock {out / LOCK_FILE} of pid {launcher.pid} on" in proc.stderr
    assert f"continuing at step {last + 1}" in proc.stdout
    assert not (out / LOCK_FILE).exists() and not (ckpt / LOCK_FILE).exists()


@pytest.mark.distributed
def test_resume_or_overwrite_into_a_live_run_exits_2_and_changes_nothing(tmp_path: Path) -> None:
    out, ckpt = tmp_path / "run", tmp_path / "ckpt"
    spec = tiny_cpu_spec(tmp_path, "t", steps=4, every=2, ckpt_dir=ckpt)
    (ckpt / "step-000002").mkdir(parents=True)
    (ckpt / "step-000002" / "meta.json").write_text("{}")
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 4.9}\n')
    (out / "plan.json").write_text("{}")
    holder = _holder_process(tmp_path, out, ckpt)  # the live job, as ppdsl run's launcher holds it
    try:
        before = snapshot(tmp_path)
        for flag, into, what in (("--overwrite", out, "run directory"), ("--resume", out, "run directory"),
                                 ("--resume", tmp_path / "other", "checkpoint directory")):  # after the check
            proc, took = run_cmd(["run", str(spec), "--nproc", "4", "--out", str(into), flag], timeout=60)
            assert proc.returncode == 2, proc.stderr
            lines = [x for x in proc.stderr.splitlines() if "in use by a live run" in x]
            assert len(lines) == 1, proc.stderr
            assert f"{what} {out if into == out else ckpt} is in use by a live run (pid {holder.pid} on " in lines[0]
            # the run directory is looked at before the spec is checked; the checkpoint directory after
            assert took < (20 if into == out else 60), (flag, took)
            print(f"{flag} into a live run's {what}: exit 2 after {took:.1f} s")
            assert snapshot(tmp_path) == before, flag
            assert not (tmp_path / "other").exists()
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.distributed
@pytest.mark.slow  # 10-16 s
def test_kill_9_of_plain_torchrun_stops_every_worker(tmp_path: Path) -> None:
    spec = tiny_cpu_spec(tmp_path, "t", steps=ORPHAN_STEPS, every=2)
    out, ckpt = tmp_path / "run", tmp_path / "ckpt"
    marker = uuid.uuid4().hex
    torchrun = _start([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                       "-m", "ppdsl", "run", str(spec), "--out", str(out)], marker, tmp_path / "torchrun.log")
    try:
        _wait_for(lambda: (ckpt / "step-000004").is_dir(), torchrun)
        workers = _marked_pids(marker, workers=True)
        assert len(workers) == 4, workers
        rank0 = Holder.parse((out / LOCK_FILE).read_text())  # rank 0 holds it: no ppdsl launcher
        assert rank0 is not None and rank0.pid in workers and "(rank 0 under torchrun pid" in rank0.command
        second, _ = run_cmd(["run", str(spec), "--nproc", "4", "--out", str(out), "--overwrite"], timeout=60)
        assert second.returncode == 2 and f"is in use by a live run (pid {rank0.pid} on" in second.stderr
        torchrun.send_signal(signal.SIGKILL)
        torchrun.wait(timeout=10)
        gone = _wait_gone(workers, 15.0)
        print(f"kill -9 of torchrun: every worker gone after {gone:.2f} s")
        assert gone < 15.0
    finally:
        _kill_all(torchrun, marker)
    found = complete_checkpoints(ckpt)
    assert sorted(p for p in ckpt.iterdir() if p.name.startswith("step-")) == [p for _, p in found]
    with lock_run(out, ckpt) as lock:  # rank 0 is gone: the lock is stale
        assert f"of pid {rank0.pid} on" in lock.notes[0]


# ---- helpers ---------------------------------------------------------------------------------------


def _start(argv: list[str], marker: str, log: Path) -> subprocess.Popen:
    with open(log, "w") as f:
        p = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env(**{MARKER: marker}))
    p.log = log  # type: ignore[attr-defined]
    return p


def _wait_for(cond, proc: subprocess.Popen, timeout: float = HARD_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if proc.poll() is not None:
            raise AssertionError(f"the job ended early ({proc.returncode}): {proc.log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            raise AssertionError("the job did not get there in time")
        time.sleep(0.2)


def _pids() -> list[int]:
    return [int(d) for d in os.listdir("/proc") if d.isdigit()]


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(x.split("=", 1) for x in raw.decode("utf-8", "replace").split("\0") if "=" in x)


def _marked_pids_by(pred) -> list[int]:
    return [p for p in _pids() if p != os.getpid() and pred(p)]


def _marked_pids(marker: str, workers: bool = False) -> list[int]:
    """Processes carrying the test's marker (workers: those torchrun gave a RANK)."""
    def pred(p: int) -> bool:
        e = _environ(p)
        return e.get(MARKER) == marker and (not workers or "RANK" in e)
    return _marked_pids_by(pred)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _wait_gone(pids: list[int], timeout: float) -> float:
    """Seconds until none of `pids` is alive (zombies count as gone), or `timeout`."""
    t0 = time.monotonic()
    while any(_alive(p) for p in pids) and time.monotonic() - t0 < timeout:
        time.sleep(0.05)
    return time.monotonic() - t0


def _kill_all(proc: subprocess.Popen, marker: str) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    for pid in _marked_pids(marker):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
