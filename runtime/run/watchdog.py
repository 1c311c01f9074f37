"""The hang watchdog: a rank that stops making progress is named, and the job ends, in seconds.

Every rank runs one daemon thread. Twice a second (``HEARTBEAT_S``) it publishes a heartbeat to
torchrun's c10d store (``MASTER_ADDR`` / ``MASTER_PORT``, which every rank of every node
reaches, under NCCL as under gloo): its pid and host, a beat counter, and what its
``runtime.run.failure.StepStatus`` says the main thread is doing (phase, executor action, progress
count). The main thread only advances that count (two attribute stores per action); nothing is
written per action.

Two signs of a hang, told apart because a rank blocked in a collective waiting on a hung peer is
alive and makes no progress too:

- *liveness*: a rank's beat counter stops. A process stopped (SIGSTOP, a frozen host) or one
  whose main thread holds the GIL stops beating. Named after ``min(hang_timeout,
  STOPPED_AFTER_S)`` (``hang_timeout`` in the long phases below, where a C call may hold the
  GIL for a while, unpickling a checkpoint say).
- *progress*: no rank's count moved for ``hang_timeout`` while all beat. Every rank then waits;
  the cause is the one that is not inside a collective or transfer (the thread looks at the main
  thread's innermost frame), else the one whose progress stopped first.

Long phases (start-up and model building, loading a checkpoint, saving one, exporting, and the
first training step a process runs) are single operations that may legitimately take minutes:
there only liveness is watched, and no progress verdict is given while any rank is in one. A
single action elsewhere (a forward, the optimizer step) longer than ``hang_timeout`` is
reported as a hang: raise ``train.hang_timeout`` for such a model.

Rank 0's thread watches every rank; rank 1's watches rank 0 (a stopped rank 0 cannot report
itself). The first verdict is claimed in the store (compare-and-set), so the job prints one
line. Every rank's thread then sees it: a rank on the hung rank's host SIGKILLs it (a stopped
process would ignore torchrun's SIGTERM for its 30 s grace), the hung rank itself dies if it is
alive, the verdict goes into the node's status directory (the launcher's summary names the
cause from it), and each worker exits with code 1, so torchrun ends the job at once, on every
node, whatever the backend.
"""

from __future__ import annotations

import datetime
import json
import linecache
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

HEARTBEAT_S = 0.5  # publish (and look) twice a second: the last beat of a stopped rank is at most this old
STOPPED_AFTER_S = 20.0  # a silent heartbeat (a stopped process) is named this fast, hang_timeout at most
LONG_PHASES = frozenset({"start", "load", "save", "export"})
VERDICT_FILE = "hang.json"  # in the launcher's status directory
EXIT_HANG = 1
_STORE_TIMEOUT_S = 10.0
_OPS = {"F": "forward", "B": "backward", "W": "weight backward"}
_PHASES = {
    "start": "start-up (process groups, building the model)",
    "load": "loading the checkpoint",
    "step": "the step, before its first action",
    "eval": "eval",
    "save": "saving a checkpoint",
    "saved": "the step's end, after saving a checkpoint",
    "export": "exporting the final model",
}


@attrs.frozen
class Beat:
    """One heartbeat of one rank, as published."""

    rank: int
    pid: int
    host: str
    seq: int  # advances every beat: liveness
    count: int  # StepStatus.count: advances with every action and phase: progress
    step: int
    doing: str  # what the main thread is doing, in words
    long: bool  # in a long phase (no progress verdict)
    waiting: bool  # the main thread is inside a collective or transfer
    done: bool = False  # the rank left training: no longer watched

    def to_text(self) -> str:
        return json.dumps(attrs.asdict(self))

    @classmethod
    def from_text(cls, text: str | bytes) -> "Beat":
        return cls(**json.loads(text))


@attrs.frozen
class Verdict:
    rank: int
    pid: int
    host: str
    seconds: float  # without progress
    step: int
    doing: str
    reason: str  # "heartbeat" (the process stopped beating) | "progress" (alive, no progress)

    def line(self) -> str:
        return (f"ppdsl run: rank {self.rank} (pid {self.pid}, host {self.host}) made no progress for "
                f"{self.seconds:.0f} s at step {self.step}, in {self.doing}")

    def to_text(self) -> str:
        return json.dumps(attrs.asdict(self))

    @classmethod
    def from_text(cls, text: str | bytes) -> "Verdict":
        return cls(**json.loads(text))


class Monitor:
    """The detection rule, pure: fed every rank's latest beat with the monitor's own clock (so
    hosts' clocks never meet), it returns a verdict or None. `progress`: apply the progress
    rule (rank 0, which sees every rank), else liveness only."""

    def __init__(self, hang_timeout: float, *, progress: bool = True) -> None:
        self.hang_timeout = hang_timeout
        self.progress = progress
        self.last: dict[int, Beat] = {}
        self.beat_at: dict[int, float] = {}
        self.moved_at: dict[int, float] = {}
        self.last_move: float | None = None

    def observe(self, now: float, beats: Mapping[int, Beat]) -> Verdict | None:
        for r, b in beats.items():
            old = self.last.get(r)
            if old is None or b.seq != old.seq:
                self.beat_at[r] = now
            if old is None or (b.count, b.step) != (old.count, old.step):
                self.moved_at[r] = now
                self.last_move = now
            self.last[r] = b
        live = [r for r, b in self.last.items() if not b.done]
        stopped = [r for r in live if now - self.beat_at[r] > self._silence_limit(self.last[r])]
        if stopped:
            r = min(stopped, key=lambda r: (self.beat_at[r], r))
            return self._verdict(r, now, "heartbeat")
        if not self.progress or not live or self.last_move is None or any(self.last[r].long for r in live):
            return None
        if now - self.last_move <= self.hang_timeout:
            return None
        r = min(live, key=lambda r: (self.last[r].waiting, self.moved_at[r], r))
        return self._verdict(r, now, "progress")

    def _silence_limit(self, b: Beat) -> float:
        return self.hang_timeout if b.long else min(self.hang_timeout, STOPPED_AFTER_S)

    def _verdict(self, r: int, now: float, reason: str) -> Verdict:
        b = self.last[r]
        return Verdict(b.rank, b.pid, b.host, now - self.moved_at[r], b.step, b.doing, reason)


def describe(what: str, action: Any) -> str:
    """What a rank is doing, in words, from StepStatus's `what` and `action`."""
    if action is None:
        return _PHASES.get(what, what)
    text = f"{_OPS.get(str(action.op), str(action.op))} of stage {action.stage} microbatch {action.microbatch}"
    return f"eval, {text}" if what == "eval" else text


def is_long(status: Any) -> bool:
    return status.what in LONG_PHASES or (status.first_step is not None and status.step == status.first_step)


_TORCH_DISTRIBUTED: str | None = None
_WAIT_CALL = ".wait("  # a source line waiting on a torch.distributed Work (executor, gradient buckets)


def main_thread_waiting() -> bool:
    """Whether the main thread is inside torch.distributed or at a ``work.wait()``: waiting on
    peers rather than computing (or hanging on its own)."""
    global _TORCH_DISTRIBUTED
    if _TORCH_DISTRIBUTED is None:
        import torch.distributed

        _TORCH_DISTRIBUTED = os.path.dirname(torch.distributed.__file__) + os.sep
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    if frame is None:
        return False
    code = frame.f_code
    if code.co_filename.startswith(_TORCH_DISTRIBUTED):
        return True
    return _WAIT_CALL in linecache.getline(code.co_filename, frame.f_lineno)


def read_verdict(status_dir: str | Path) -> Verdict | None:
    """The verdict a worker left in the launcher's status directory, if any."""
    try:
        return Verdict.from_text((Path(status_dir) / VERDICT_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError, TypeError):
        return None


class Watchdog:
    """The thread of one rank (see the module's doc). `store`: a c10d store every rank shares."""

    def __init__(self, store: Any, status: Any, rank: int, world: int, hang_timeout: float) -> None:
        self.store, self.status, self.rank, self.world = store, status, rank, world
        self.host = socket.gethostname()
        self.pid = os.getpid()
        self.seq = 0
        self.monitor: Monitor | None = None
        self.watched: list[int] = []
        if rank == 0:
            self.monitor, self.watched = Monitor(hang_timeout), list(range(world))
        elif rank == 1:
            self.monitor, self.watched = Monitor(hang_timeout, progress=False), [0]
        self._present: set[int] = set()
        self._stop = threading.Event()
        self.ending = threading.Event()  # a verdict is being carried out: the process is about to exit
        self._thread = threading.Thread(target=self._loop, name="ppdsl-watchdog", daemon=True)

    @classmethod
    def start(cls, hang_timeout: float | None, status: Any, rank: int, world: int) -> "Watchdog | None":
        """The running watchdog, or None: off (`hang_timeout` None), or no torchrun store."""
        if hang_timeout is None or "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
            return None
        import torch.distributed as dist

        try:
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                  wait_for_workers=False, timeout=datetime.timedelta(seconds=_STORE_TIMEOUT_S))
        except Exception as exc:  # no store to reach: run without the watchdog rather than not at all
            print(f"ppdsl: warning: rank {rank}: no hang watchdog (the c10d store is not reachable: "
                  f"{type(exc).__name__})", file=sys.stderr)
            return None
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        dog = cls(dist.PrefixStore(f"ppdsl/watchdog/attempt-{attempt}", store), status, rank, world, hang_timeout)
        dog._beat()
        dog._thread.start()
        return dog

    def stop(self) -> None:
        """This rank leaves training: say so (no longer watched) and end the thread."""
        self._stop.set()
        self._thread.join(timeout=5)
        if not self.ending.is_set():
            try:
                self._beat(done=True)
            except Exception:
                pass

    def consequence(self, exc: BaseException) -> bool:
        """Whether `exc` (raised by the main thread) follows from a verdict: a lost peer while
        this thread carries one out, or within four beats, time for every rank to see it."""
        from ppdsl.runtime.run.failure import is_communication_error

        return self.ending.is_set() or (is_communication_error(exc) and self.ending.wait(4 * HEARTBEAT_S))

    # -- the thread ------------------------------------------------------------------------

    def _loop(self) -> None:
        failures = 0
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self._beat()
                verdict = self._posted()
                if verdict is None and self.monitor is not None:
                    found = self.monitor.observe(time.monotonic(), self._beats())
                    if found is not None:
                        verdict = self._claim(found)
                failures = 0
            except Exception:  # the store is gone (the job is ending) or slow: try again, then give up
                failures += 1
                if failures >= 5:
                    return
                continue
            if verdict is not None:
                self._carry_out(verdict)
                return

    def _beat(self, done: bool = False) -> None:
        st = self.status
        self.seq += 1
        doing = describe(st.what, st.action)
        waiting = main_thread_waiting()
        if waiting:
            doing += " (waiting on a peer)"
        beat = Beat(self.rank, self.pid, self.host, self.seq, st.count, st.step, doing, is_long(st), waiting, done)
        self.store.set(f"beat/{self.rank}", beat.to_text())

    def _beats(self) -> dict[int, Beat]:
        for r in self.watched:
            if r not in self._present and self.store.check([f"beat/{r}"]):
                self._present.add(r)
        ranks = sorted(self._present)
        if not ranks:
            return {}
        return {r: Beat.from_text(t) for r, t in zip(ranks, self.store.multi_get([f"beat/{r}" for r in ranks]))}

    def _posted(self) -> Verdict | None:
        if not self.store.check(["verdict"]):
            return None
        return Verdict.from_text(self.store.get("verdict"))

    def _claim(self, found: Verdict) -> Verdict:
        """Post `found` unless another monitor posted first; the winner prints the one line."""
        text = found.to_text()
        posted = self.store.compare_set("verdict", "", text)
        if isinstance(posted, bytes):
            posted = posted.decode()
        if posted == text:
            print(found.line(), file=sys.stderr, flush=True)
            return found
        return Verdict.from_text(posted)

    def _carry_out(self, verdict: Verdict) -> None:
        self.ending.set()
        status_dir = os.environ.get("PPDSL_STATUS_DIR")
        if status_dir:
            try:
                tmp = Path(status_dir) / f"{VERDICT_FILE}.{self.rank}.tmp"
                tmp.write_text(verdict.to_text(), encoding="utf-8")
                os.replace(tmp, Path(status_dir) / VERDICT_FILE)
            except OSError:
                pass
        sys.stdout.flush()
        sys.stderr.flush()
        if verdict.rank == self.rank:  # alive but hung (a busy loop, a lost wake-up): no clean way out
            os.kill(self.pid, signal.SIGKILL)
        if verdict.host == self.host:
            try:
                os.kill(verdict.pid, signal.SIGKILL)
            except OSError:  # gone already, or another rank of this host was first
                pass
        os._exit(EXIT_HANG)

