"""Failure behaviour of a run: timeouts, which rank failed at which step, SIGTERM.

- Every collective and point-to-point transfer fails after ``PPDSL_TIMEOUT_S`` seconds
  (default ``DEFAULT_TIMEOUT_S``) instead of waiting forever. A rank that dies outright
  (kill -9, OOM) closes its connections, so its peers fail at once (gloo: "Connection closed by
  peer"); the timeout bounds the case of a rank that hangs while alive.
- Each worker keeps its current step (and its pid) in ``<status dir>/rank-N`` (the launcher's
  temporary directory, ``PPDSL_STATUS_DIR``); when a worker dies the launcher names it and its
  step. A worker that raises prints ``ppdsl run: rank R failed at step S: ...`` itself.
- ``StepStatus`` also holds, in memory, what the rank is doing (phase and executor action) and a
  progress count: ``runtime.run.watchdog`` publishes them twice a second and names a rank that hangs.
- SIGTERM sets a flag; after each step the ranks agree on it (one all-reduce), save a final
  checkpoint when the spec has a checkpoint block, and exit with 143.
- A `RunFault` (a loss that stayed non-finite, a data file changed under the run) ends the run
  with one line and exit 1, no traceback.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

DEFAULT_TIMEOUT_S = 120.0
EXIT_OK, EXIT_FAIL, EXIT_INVALID = 0, 1, 2  # a worker's and the launcher's exit codes (2: the user's to fix)
EXIT_SIGTERM = 128 + signal.SIGTERM  # 143


def timeout_s(hang_timeout: float | None = None) -> float:
    """The collective timeout: ``PPDSL_TIMEOUT_S``, raised to twice `hang_timeout` (the
    watchdog's, ``train.hang_timeout``) so that the watchdog, which names the hung rank, fires
    before the collectives of the ranks waiting on it, which cannot tell who is to blame."""
    base = float(os.environ.get("PPDSL_TIMEOUT_S", DEFAULT_TIMEOUT_S))
    return base if hang_timeout is None else max(base, 2 * hang_timeout)


class StopFlag:
    """Set by SIGTERM (and SIGINT under a launcher); read by the training loop after each step."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._old: dict[int, Any] = {}

    def install(self) -> "StopFlag":
        for sig in (signal.SIGTERM,):
            try:
                self._old[sig] = signal.signal(sig, self._handler)
            except ValueError:  # not the main thread
                pass
        return self

    def _handler(self, signum: int, frame: object) -> None:
        self.signum = signum

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()

    @property
    def set(self) -> bool:
        return self.signum is not None


class StepStatus:
    """``rank-N`` in the launcher's status directory: this worker's current step and pid,
    written once per step and phase. In memory also what the rank is doing now, for the
    watchdog: `what` (the phase: start, load, step, eval, save, saved, export, or a part of a
    step such as "optimizer step"), `action` (the executor's current action, None outside the
    pipeline) and `count`, which every change advances (progress)."""

    def __init__(self, rank: int) -> None:
        d = os.environ.get("PPDSL_STATUS_DIR")
        self.path = None if not d else Path(d) / f"rank-{rank}"
        self.step = 0
        self.what = "start"
        self.action: object = None
        self.count = 0
        self.first_step: int | None = None  # the first training step this process ran

    def at(self, step: int, what: str = "step") -> None:
        self.step, self.what, self.action = step, what, None
        self.count += 1
        if what == "step" and self.first_step is None:
            self.first_step = step
        if self.path is not None:
            try:
                tmp = self.path.with_suffix(".tmp")
                tmp.write_text(f"{step} {what} {os.getpid()}\n", encoding="utf-8")
                os.replace(tmp, self.path)
            except OSError:
                pass

    def doing(self, what: str) -> None:
        """A part of the current step (in memory only): "gradient sync", "optimizer step"."""
        self.what, self.action = what, None
        self.count += 1

    def act(self, action: object) -> None:
        """The executor starts `action` (hot path: two attribute stores)."""
        self.action = action
        self.count += 1


def read_status(status_dir: str | Path, rank: int) -> tuple[int, str] | None:
    try:
        step, what, *_ = (Path(status_dir) / f"rank-{rank}").read_text(encoding="utf-8").split()
        return int(step), what
    except (OSError, ValueError):
        return None


def read_status_pid(status_dir: str | Path, rank: int) -> int | None:
    """The pid the worker of `rank` wrote into its status file."""
    try:
        return int((Path(status_dir) / f"rank-{rank}").read_text(encoding="utf-8").split()[2])
    except (OSError, ValueError, IndexError):
        return None


def is_communication_error(exc: BaseException) -> bool:
    """Whether `exc` is a lost peer or a timed-out collective (a consequence, not a cause)."""
    text = f"{type(exc).__name__}: {exc}".lower()
    return any(s in text for s in ("connection closed by peer", "connection reset", "timed out", "timeout",
                                   "broken pipe", "distbackenderror", "gloo", "nccl"))


def describe_user_error(rank: int, exc: BaseException) -> str:
    """The line for a ValueError raised by the runtime: a configuration it cannot run, which the
    user can fix. Check is meant to refuse each of these first; no report is asked for."""
    return f"ppdsl: rank {rank}: {exc}"


AGREED_STOP = "stopped"  # StepStatus phase of a rank that left on a RunFault every rank raised


class RunFault(Exception):
    """A fault of the run, not of ppdsl (a loss that stayed non-finite, a damaged checkpoint, a
    full disk, a data file changed under the run): the worker prints one line and exits with
    `exit_code`, no traceback. `agreed`: every rank raised it at the same point (only rank 0
    prints it, and the ranks leave the process group together); otherwise the line names the
    rank and step."""

    exit_code = 1

    def __init__(self, message: str, *, agreed: bool = False) -> None:
        super().__init__(message)
        self.agreed = agreed

    def leave(self, rank: int, status: "StepStatus") -> int:
        """Print the one line, leave the process group together when agreed; the exit code."""
        if not self.agreed:
            print(f"ppdsl run: rank {rank} failed at step {status.step}: {self}", file=sys.stderr, flush=True)
            return self.exit_code
        status.at(status.step, AGREED_STOP)  # the launcher's report then adds nothing to rank 0's line
        if rank == 0:
            print(f"ppdsl run: {self}", file=sys.stderr, flush=True)
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
        return self.exit_code


class CheckpointFault(RunFault):
    """A checkpoint fault every rank agreed on (they all raise it at the same point): the run
    ends with one message from rank 0, the ranks leaving the process group together."""

    def __init__(self, message: str) -> None:
        super().__init__(message, agreed=True)


class RankFailures(Exception):
    """Ranks of a spawned world that failed. ``lines``: one per distinct cause, user errors
    (`describe_user_error`) first; ``internal``: whether any was not a user error."""

    def __init__(self, lines: list[str], internal: bool) -> None:
        super().__init__("\n".join(lines))
        self.lines = lines
        self.internal = internal


def describe_failure(rank: int, step: int, exc: BaseException) -> str:
    """The one line a failing worker prints first."""
    if is_communication_error(exc):
        return (f"ppdsl run: rank {rank} stopped at step {step}: lost contact with a peer "
                f"({type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}); "
                "another rank probably failed first")
    return f"ppdsl run: rank {rank} failed at step {step}: {type(exc).__name__}: {exc}"


def test_fault(point: str, step: int, rank: int) -> None:
    """Test hook. ``PPDSL_TEST_FAULT=POINT:STEP:RANK[:ACTION]``: at POINT ("step": before
    running step STEP, 1-based; "save": after writing checkpoint STEP, before publishing it) rank
    RANK is killed with SIGKILL (ACTION "kill", the default), raises (ACTION "raise") or hangs
    while alive, sleeping in a loop (ACTION "hang")."""
    spec = os.environ.get("PPDSL_TEST_FAULT")
    if not spec:
        return
    parts = spec.split(":")
    if len(parts) < 3 or parts[0] != point or int(parts[1]) != step or int(parts[2]) != rank:
        return
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0" and not os.environ.get("PPDSL_TEST_FAULT_ALWAYS"):
        return  # fire once: a restarted job runs clean
    action = parts[3] if len(parts) > 3 else "kill"
    if action == "raise":
        raise RuntimeError(f"test fault at {point} {step} on rank {rank}")
    if action == "hang":
        while True:
            time.sleep(0.05)
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def test_fault_due(point: str, step: int, rank: int) -> bool:
    """Test hook for faults that are not a death: whether ``PPDSL_TEST_FAULT=POINT:STEPS:RANK``
    names this point, step and rank; STEPS lists steps and ranges, 1-based (``3``, ``2-4,7``).
    "nan": rank RANK's gradients of those steps get a NaN (``Trainer.step``). Not in a
    restarted job, like `test_fault`."""
    parts = os.environ.get("PPDSL_TEST_FAULT", "").split(":")
    if len(parts) < 3 or parts[0] != point or int(parts[2]) != rank:
        return False
    if not any(int(a) <= step <= int(b or a) for a, _, b in (r.partition("-") for r in parts[1].split(","))):
        return False
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" or bool(os.environ.get("PPDSL_TEST_FAULT_ALWAYS"))
