"""A hung rank is found and named in seconds (runtime/run/watchdog.py, train.hang_timeout).

The distributed cases run a real ``ppdsl run --nproc 4`` of specs/tiny_cpu.ppspec, hang one
non-zero rank (SIGSTOP from outside, or a test fault that sleeps in a loop while alive) and
check that the job exits with 1 within the watchdog's bound, naming that rank and its pid.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _run_helpers import ROOT, env, tiny_cpu_spec
from ppdsl.runtime.run.failure import read_status, read_status_pid, timeout_s
from ppdsl.runtime.run.watchdog import STOPPED_AFTER_S, Beat, Monitor, Verdict, describe, main_thread_waiting

LINE = re.compile(r"^ppdsl run: rank (\d+) \(pid (\d+), host (\S+)\) made no progress for (\d+) s at step (\d+), "
                  r"in (.+)$", re.M)
START_BOUND_S = 150  # start-up to the step the fault is at, on 2 shared cores


# -- the rule, pure ----------------------------------------------------------------------------


def _beat(rank: int, seq: int, count: int, *, step: int = 5, long: bool = False, waiting: bool = False,
          done: bool = False) -> Beat:
    return Beat(rank, 1000 + rank, "h", seq, count, step, f"doing {rank}", long, waiting, done)


def _feed(mon: Monitor, t0: float, t1: float, beats_at) -> Verdict | None:
    """Observe once a second from t0 to t1; `beats_at(t)` gives the beats at time t."""
    t = t0
    while t <= t1:
        v = mon.observe(t, beats_at(t))
        if v is not None:
            return v
        t += 1.0
    return None


def test_a_silent_heartbeat_is_named_after_the_stopped_limit() -> None:
    mon = Monitor(60.0)
    # rank 2 stops at t = 10 (its beat and count freeze); the others beat on, waiting on it
    beats = lambda t: {r: _beat(r, int(min(t, 10)) if r == 2 else int(t), int(min(t, 10)), waiting=r != 2 and t > 10)
                       for r in range(4)}
    v = _feed(mon, 0, 100, beats)
    assert v is not None and v.rank == 2 and v.pid == 1002 and v.reason == "heartbeat"
    assert 10 + STOPPED_AFTER_S < v.seconds + 10 <= 10 + STOPPED_AFTER_S + 1.5


def test_no_progress_names_the_rank_that_is_not_waiting() -> None:
    mon = Monitor(5.0)
    # all beat; progress stops at t = 3 everywhere, rank 3 computing (a busy loop), the others in collectives
    beats = lambda t: {r: _beat(r, int(t), int(min(t, 3)), waiting=r != 3 and t > 3) for r in range(4)}
    v = _feed(mon, 0, 30, beats)
    assert v is not None and (v.rank, v.reason) == (3, "progress")
    assert 5 < v.seconds <= 6.5


def test_all_waiting_names_the_rank_whose_progress_stopped_first() -> None:
    mon = Monitor(5.0)
    stop_at = {0: 6, 1: 4, 2: 6, 3: 7}  # rank 1 stopped first; everyone ends up waiting (a deadlock)
    beats = lambda t: {r: _beat(r, int(t), int(min(t, s)), waiting=t > s) for r, s in stop_at.items()}
    v = _feed(mon, 0, 30, beats)
    assert v is not None and v.rank == 1 and v.seconds > 5


def test_long_phases_and_finished_ranks_give_no_verdict() -> None:
    mon = Monitor(5.0)
    # rank 0 saves a checkpoint for 100 s (long phase, beating), the others wait on it
    beats = lambda t: {r: _beat(r, int(t), 1, long=r == 0, waiting=r != 0) for r in range(4)}
    assert _feed(mon, 0, 100, beats) is None
    # a long phase tolerates a silent heartbeat (a C call holding the GIL) up to hang_timeout
    mon = Monitor(30.0)
    beats = lambda t: {0: _beat(0, int(min(t, 5)), 1, long=True), 1: _beat(1, int(t), 1, waiting=True)}
    v = _feed(mon, 0, 100, beats)
    assert v is not None and v.rank == 0 and 35 <= v.seconds + 0 <= 37
    # ranks that finished stop beating without being taken for stopped ones
    mon = Monitor(5.0)
    beats = lambda t: {r: _beat(r, 3 if r else int(t), 3 if r else int(t), done=r != 0) for r in range(4)}
    assert _feed(mon, 0, 60, beats) is None


def test_the_verdict_line_and_the_action_in_words() -> None:
    from ppdsl.core.schedules.ir import Action, Op

    assert describe("step", Action(Op.F, 2, 1)) == "forward of stage 1 microbatch 2"
    assert describe("eval", Action(Op.F, 0, 0)) == "eval, forward of stage 0 microbatch 0"
    assert describe("optimizer step", None) == "optimizer step"
    assert describe("save", None) == "saving a checkpoint"
    v = Verdict(2, 4242, "node7", 21.4, 9, "backward of stage 0 microbatch 3", "heartbeat")
    assert LINE.fullmatch(v.line()).groups() == ("2", "4242", "node7", "21", "9", "backward of stage 0 microbatch 3")
    assert Verdict.from_text(v.to_text()) == v


def test_the_main_thread_is_seen_computing_not_waiting(monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    from ppdsl.runtime.run import watchdog

    monkeypatch.setattr(watchdog, "_TORCH_DISTRIBUTED", "/no/torch/distributed/")  # not imported for this

    seen: list[bool] = []
    t = threading.Thread(target=lambda: (time.sleep(0.1), seen.append(main_thread_waiting())))
    t.start()
    time.sleep(0.3)  # the main thread's innermost frame: here, not in torch.distributed
    t.join()
    assert seen == [False]


def test_the_collective_timeout_leaves_the_watchdog_time_to_fire_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PPDSL_TIMEOUT_S", "120")
    assert timeout_s() == 120 and timeout_s(60.0) == 120 and timeout_s(100.0) == 200 and timeout_s(None) == 120


# -- real runs ---------------------------------------------------------------------------------


def _status_dir(tmp: Path) -> Path | None:
    found = sorted(tmp.glob("ppdsl-status-*"))
    return found[0] if found else None


def _kill_all(pids: set[int]) -> None:
    for pid in pids:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(pid, sig)
            except OSError:
                pass


def _hang_run(tmp_path: Path, rank: int, at_step: int, *, hang_timeout: float | None, fault: str | None,
              deadline_s: float, nproc: int = 4) -> tuple[int, str, float, int]:
    """Run tiny_cpu on `nproc` ranks (2: tp = 1) and hang `rank` at step `at_step`: SIGSTOP
    from here (`fault` None) or the PPDSL_TEST_FAULT action `fault`. Returns (exit code,
    stderr, seconds from the hang to the exit, the hung rank's pid)."""
    spec = tiny_cpu_spec(tmp_path, "hang", steps=400, every=None)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    extra = {"TMPDIR": str(tmp)}
    if fault is not None:
        extra["PPDSL_TEST_FAULT"] = f"step:{at_step}:{rank}:{fault}"
    args = [sys.executable, "-m", "ppdsl", "run", str(spec), "--nproc", str(nproc), "--out", str(tmp_path / "out")]
    if nproc == 2:
        args += ["--set", "mesh.tp=1"]
    if hang_timeout is not None:
        args += ["--set", f"train.hang_timeout={hang_timeout:g}"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(**extra), cwd=ROOT)
    pids: set[int] = set()
    try:
        t_start = time.monotonic()
        hung_pid, t_hang = None, None
        while t_hang is None:  # wait for the rank to reach the step, then hang it
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() - t_start < START_BOUND_S, "the run never reached the step"
            d = _status_dir(tmp)
            st = None if d is None else read_status(d, rank)
            if d is not None:
                pids |= {p for r in range(nproc) if (p := read_status_pid(d, r))}
            if st is not None and st[0] >= at_step and (fault is not None or st[1] == "step"):
                hung_pid = read_status_pid(d, rank)
                assert hung_pid is not None
                if fault is None:
                    os.kill(hung_pid, signal.SIGSTOP)
                t_hang = time.monotonic()
            time.sleep(0.05)
        try:
            _, err = proc.communicate(timeout=deadline_s + 30)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
            pytest.fail(f"the job did not end within {deadline_s + 30} s of the hang:\n{err[-3000:]}")
        return proc.returncode, err, time.monotonic() - t_hang, hung_pid
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        _kill_all(pids)


def _check_named(code: int, err: str, rank: int, pid: int) -> re.Match:
    assert code == 1, err[-3000:]
    lines = LINE.findall(err)
    assert len(lines) == 1, err[-3000:]
    assert "lost contact with a peer" not in err, err[-3000:]  # the ranks it ended tell no second story
    m = LINE.search(err)
    assert (int(m.group(1)), int(m.group(2))) == (rank, pid), err[-3000:]
    report = err[err.index("worker(s) failed"):]
    assert report.startswith(f"worker(s) failed; the cause: rank {rank} hung"), report
    assert report.splitlines()[1].startswith(f"  rank {rank} was killed by SIGKILL"), report
    assert "by the hang watchdog" in report.splitlines()[1], report
    return m


@pytest.mark.distributed
def test_a_sigstopped_rank_is_named_and_the_job_ends_in_seconds(tmp_path: Path) -> None:
    code, err, elapsed, pid = _hang_run(tmp_path, 2, 4, hang_timeout=8, fault=None, deadline_s=8 + 15)
    m = _check_named(code, err, 2, pid)
    assert "heartbeat stopped" in err
    assert elapsed < 8 + 15, elapsed  # the silent heartbeat's limit (8 s) + beats and teardown (2 shared cores)
    print(f"SIGSTOP -> exit {elapsed:.1f} s (hang_timeout 8); {m.group(0)}")


@pytest.mark.distributed
def test_a_rank_alive_in_a_loop_is_named_not_the_ranks_waiting_on_it(tmp_path: Path) -> None:
    # 2 ranks (pp = 2) start faster than 4; rank 0, the one watching, waits on rank 1
    code, err, elapsed, pid = _hang_run(tmp_path, 1, 4, hang_timeout=6, fault="hang", deadline_s=6 + 15, nproc=2)
    m = _check_named(code, err, 1, pid)
    assert "alive, no progress" in err and m.group(5) == "4", err[-3000:]
    assert elapsed < 6 + 15, elapsed
    print(f"busy hang -> exit {elapsed:.1f} s (hang_timeout 6); {m.group(0)}")


@pytest.mark.distributed
@pytest.mark.slow
def test_with_the_defaults_a_sigstopped_rank_ends_the_job_within_60_s(tmp_path: Path) -> None:
    code, err, elapsed, pid = _hang_run(tmp_path, 1, 4, hang_timeout=None, fault=None, deadline_s=60)
    m = _check_named(code, err, 1, pid)
    assert elapsed < 60, elapsed
    print(f"SIGSTOP -> exit {elapsed:.1f} s (defaults); {m.group(0)}")


@pytest.mark.distributed
@pytest.mark.slow
def test_a_sigstopped_rank_0_is_named_by_rank_1(tmp_path: Path) -> None:
    # rank 0 watches the others; a stopped rank 0 is seen by rank 1's thread (the store is torchrun's)
    code, err, elapsed, pid = _hang_run(tmp_path, 0, 4, hang_timeout=8, fault=None, deadline_s=8 + 15)
    _check_named(code, err, 0, pid)
    assert elapsed < 8 + 15, elapsed
