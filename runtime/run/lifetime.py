"""A worker dies with its launcher.

torchrun starts every worker in a session of its own (``start_new_session``), so when the
launcher is killed outright (``kill -9``, the OOM killer, a lost ssh session: no SIGTERM to
forward) its workers would go on training, writing and rotating checkpoints, with nobody left
to stop them. `die_with_parent`, called first thing in a worker, has the kernel SIGKILL the
worker when its parent dies: ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` on Linux.

- The kernel sends it when the *thread* that forked the child exits. torch.distributed.elastic
  starts the workers (``SubprocessContext._start``: ``subprocess.Popen``, also on a restart)
  from the thread that runs the agent: the main thread of ``torchrun``, and of ``ppdsl run``'s
  launcher (``launch`` calls torchrun's ``run`` there), which lives as long as the process.
- A parent that died before the ``prctl`` call is caught right after it: the parent must
  still be the launcher (``PPDSL_LAUNCHER_PID``, set by ``ppdsl run``; under a plain torchrun
  the parent seen at the first look, which must not be init).
- Without ``prctl`` (not Linux), a daemon thread polls the parent pid every second instead.

SIGKILL rather than SIGTERM: with the launcher gone, its run-directory lock (runtime/run/lock.py)
is gone too, so the workers must not outlive it by a step and a checkpoint save. What they
lose is the work since the last complete checkpoint, as if the whole job had been killed; a
save in progress stays an unpublished ``.step-N.tmp-*`` directory (runtime/checkpoint/store.py).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

LAUNCHER_PID_ENV = "PPDSL_LAUNCHER_PID"  # `ppdsl run`'s launcher, the parent of its workers
_PR_SET_PDEATHSIG = 1
_POLL_S = 1.0


def die_with_parent() -> str:
    """Make this process die (SIGKILL) when its parent does. Returns how: "prctl" or "poll"."""
    parent = _expected_parent()
    how = "prctl" if _set_pdeathsig(signal.SIGKILL) else "poll"
    if how == "poll":
        threading.Thread(target=_watch, args=(parent,), name="ppdsl-parent-watch", daemon=True).start()
    if parent <= 1 or os.getppid() != parent:  # the parent died before the prctl call
        _die()
    return how


@contextmanager
def launcher_env() -> Iterator[None]:
    """In the launcher, around starting its workers: tell them their parent's pid."""
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
    try:
        yield
    finally:
        os.environ.pop(LAUNCHER_PID_ENV, None)


def _expected_parent() -> int:
    try:
        return int(os.environ[LAUNCHER_PID_ENV])
    except (KeyError, ValueError):
        return os.getppid()


def _set_pdeathsig(sig: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(_POLL_S)
    _die()


def _die() -> None:
    try:
        print(f"ppdsl run: worker {os.getpid()}: its launcher (pid {_expected_parent()}) is gone; stopping",
              file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass
    os.kill(os.getpid(), signal.SIGKILL)
