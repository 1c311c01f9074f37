"""One writer per run directory.

A run holds an exclusive ``flock`` on ``DIR/.ppdsl.lock`` (``rundir.LOCK_FILE``) of its run
directory, and of its checkpoint directory when that lies outside it, for its whole life. The
file records the holder (host, pid, start time, command line) so that a run refused because
of it can name the live job. The kernel drops the lock when the holder dies, however it dies;
a file left behind by a dead holder is a stale lock, taken over with one line saying so.

Who holds it: ``ppdsl run``'s launcher on one node (it tells its workers so with
``PPDSL_RUN_LOCKED``); otherwise (a plain torchrun, several nodes) global rank 0, before it
looks at the directory. The descriptor is opened close-on-exec (Python's default), so no
program the holder starts keeps the lock after the holder is gone.

An ``flock`` is as wide as the file system makes it: on a local disk it covers the host; on
NFSv4, Lustre mounted with ``-o flock``, GPFS, it covers every client; on a file system that
keeps flock per client (Lustre ``-o localflock``, some NFSv3 set-ups) only the host.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import shlex
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import attrs

from ppdsl.runtime.run.rundir import LOCK_FILE

LOCK_ENV = "PPDSL_RUN_LOCKED"  # set by a launcher that holds the lock for its workers
_UNSUPPORTED = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL)


class LockBusy(ValueError):
    """The directory is held by a live run (a user's situation: exit 2, nothing changed)."""


@attrs.frozen
class Holder:
    """Who holds a lock, as recorded in the lock file."""

    host: str
    pid: int
    started: str  # local time, ISO 8601 with its offset
    command: str

    @classmethod
    def me(cls, command: str | None = None) -> "Holder":
        return cls(socket.gethostname(), os.getpid(),
                   datetime.datetime.now().astimezone().isoformat(timespec="seconds"), command or command_line())

    @classmethod
    def parse(cls, text: str) -> "Holder | None":
        try:
            d = json.loads(text)
            return cls(str(d["host"]), int(d["pid"]), str(d["started"]), str(d["command"]))
        except (ValueError, KeyError, TypeError):
            return None

    def to_text(self) -> str:
        return json.dumps(attrs.asdict(self)) + "\n"

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}, started {self.started}: `{self.command}`"

    def gone(self) -> bool | None:
        """Whether the process is gone; None when it ran on another host (ppdsl cannot look)."""
        if self.host != socket.gethostname():
            return None
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # alive, another user's
            return False
        return False


def command_line() -> str:
    text = shlex.join(["ppdsl", *sys.argv[1:]])
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a worker: say whose
        text += f" (rank {os.environ.get('RANK', '0')} under torchrun pid {os.getppid()})"
    return text


class _DirLock:
    """The flock on one directory's lock file (held, its record not yet written)."""

    def __init__(self, path: Path, fd: int | None, created: bool) -> None:
        self.path, self.fd, self.created = path, fd, created

    @classmethod
    def take(cls, directory: Path, what: str, instead: str) -> "_DirLock":
        path = directory / LOCK_FILE
        for _ in range(10):  # a holder may unlink the file between our open and our flock
            created = not path.exists()
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except OSError as exc:
                raise ValueError(f"cannot lock {what} {directory}: {exc.strerror}: {path}") from None
            try:
                _flock_soon(fd, fcntl.LOCK_EX)
            except BlockingIOError:
                holder = Holder.parse(_read(fd))
                os.close(fd)
                raise _busy(directory, what, instead, holder, path) from None
            except OSError as exc:
                os.close(fd)
                if exc.errno not in _UNSUPPORTED:
                    raise ValueError(f"cannot lock {what} {directory}: {exc.strerror}: {path}") from None
                return cls(path, None, created)  # no flock here: see record()
            try:
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                return cls(path, fd, created)
            os.close(fd)
        raise ValueError(f"cannot lock {what} {directory}: {path} keeps being replaced")

    def record(self, holder: Holder) -> str | None:
        """Write `holder` into the file; the line about a stale holder taken over, if any."""
        if self.fd is None:
            return (f"ppdsl: warning: this file system does not support flock ({self.path}); "
                    "two runs into this directory are not kept apart")
        old = Holder.parse(_read(self.fd))
        data = holder.to_text().encode()
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, data, 0)
        os.fsync(self.fd)
        if old is None:
            return None
        gone = old.gone()
        why = ("its process is gone" if gone else
               "that pid is now another process" if gone is False else
               "on another host: if that run is alive, this file system does not share flock locks between hosts")
        return f"ppdsl: took over the stale lock {self.path} of pid {old.pid} on {old.host} (started {old.started}; {why})"

    def release(self, remove: bool) -> None:
        if self.fd is None:  # not held (a file system without flock)
            if remove and self.created:
                self.path.unlink(missing_ok=True)
            return
        try:
            if remove and os.stat(self.path).st_ino == os.fstat(self.fd).st_ino:
                os.unlink(self.path)
        except OSError:
            pass
        os.close(self.fd)  # drops the flock
        self.fd = None


@attrs.define
class RunLock:
    """The locks of one run's directories. ``notes``: lines to show (a stale lock taken over,
    a file system without flock). Release it, or use it as a context manager."""

    locks: list[_DirLock]
    notes: list[str]
    made: list[Path] = attrs.Factory(list)  # directories it created, outermost first

    def release(self) -> None:
        for lock in reversed(self.locks):
            lock.release(remove=True)
        self.locks = []
        _remove_empty(self.made)
        self.made = []

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *_: object) -> None:
        self.release()


def refuse_if_busy(out_dir: str | os.PathLike[str]) -> None:
    """LockBusy when a live run holds `out_dir`: a quick look, before the slower checks of a
    launch, that creates and changes nothing (the lock itself is taken by `lock_run`)."""
    path = Path(out_dir) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # held for a moment: see _flock_soon
    except BlockingIOError:
        raise _busy(Path(out_dir), "run directory", "choose another --out", Holder.parse(_read(fd)), path) from None
    except OSError:
        pass
    finally:
        os.close(fd)


def lock_run(out_dir: str | os.PathLike[str] | None, ckpt_dir: str | os.PathLike[str] | None,
             holder: Holder | None = None) -> RunLock:
    """Lock the run directory `out_dir` (created if missing) and the checkpoint directory
    `ckpt_dir` when it lies outside it. LockBusy (a ValueError) naming the live job when one
    holds either; a refused call changes nothing (what it created, it removes)."""
    wanted: list[tuple[Path, str, str]] = []
    if out_dir is not None:
        wanted.append((Path(out_dir), "run directory", "choose another --out"))
    if ckpt_dir is not None and not (out_dir is not None and _inside(Path(ckpt_dir), Path(out_dir))):
        wanted.append((Path(ckpt_dir), "checkpoint directory", "set another train.checkpoint.dir"))
    taken: list[_DirLock] = []
    made: list[Path] = []
    try:
        for directory, what, instead in wanted:
            made += _makedirs(directory)
            taken.append(_DirLock.take(directory, what, instead))
    except ValueError:
        for lock in reversed(taken):
            lock.release(remove=lock.created)
        _remove_empty(made)
        raise
    holder = holder or Holder.me()
    notes = [n for n in (lock.record(holder) for lock in taken) if n is not None]
    return RunLock(taken, notes, made)


@contextmanager
def held_for_workers(lock: RunLock) -> Iterator[RunLock]:
    """In a launcher: hold `lock` while the workers run, and tell them so (an empty `lock`:
    they take it themselves)."""
    if lock.locks:
        os.environ[LOCK_ENV] = str(os.getpid())
    try:
        with lock:
            yield lock
    finally:
        os.environ.pop(LOCK_ENV, None)


_HELD: list[RunLock] = []  # the lock the worker took, until its run ends


def take_for_worker(out_dir: str | os.PathLike[str] | None, ckpt_dir: str | os.PathLike[str] | None) -> list[str]:
    """In the worker that writes the run (global rank 0): lock its directories until
    `release_worker_lock`, unless its launcher holds them. Returns the lines to show;
    LockBusy as `lock_run`."""
    if os.environ.get(LOCK_ENV):
        return []
    lock = lock_run(out_dir, ckpt_dir)
    _HELD.append(lock)
    return lock.notes


def release_worker_lock() -> None:
    while _HELD:
        _HELD.pop().release()


def _flock_soon(fd: int, how: int) -> None:
    """flock without waiting for a holder, but past another launch's `refuse_if_busy` look."""
    for _ in range(4):
        try:
            fcntl.flock(fd, how | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            time.sleep(0.05)
    fcntl.flock(fd, how | fcntl.LOCK_NB)


def _busy(directory: Path, what: str, instead: str, holder: Holder | None, path: Path) -> LockBusy:
    who = holder.describe() if holder is not None else "its record is not written yet"
    return LockBusy(f"{what} {directory} is in use by a live run ({who}; lock {path}); wait for it to end or stop "
                    f"it, or {instead} (nothing was changed)")


def _read(fd: int) -> str:
    try:
        return os.pread(fd, 64 * 1024, 0).decode("utf-8", "replace")
    except OSError:
        return ""


def _inside(path: Path, root: Path) -> bool:
    try:
        return path.resolve().is_relative_to(root.resolve())
    except OSError:
        return False


def _remove_empty(made: list[Path]) -> None:
    for d in reversed(made):
        try:
            d.rmdir()
        except OSError:  # not empty: the run wrote there
            pass


def _makedirs(directory: Path) -> list[Path]:
    """Create `directory` and its missing parents; the ones created, outermost first."""
    missing = []
    p = directory
    while not p.exists() and p != p.parent:
        missing.append(p)
        p = p.parent
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"cannot create {directory}: {exc.strerror}") from None
    return list(reversed(missing))
