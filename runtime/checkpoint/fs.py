"""The file-system side of saving a checkpoint (runtime/checkpoint/store.py): DCP's file system that
remembers the first failed write, a full disk said as such, atomic small files, directory fsync."""

from __future__ import annotations

import errno
import os
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["fsync_dir", "recording_fs", "with_free_space", "write_atomic"]


def recording_fs() -> Any:
    """DCP's file system, remembering the first OSError a write raised (``error``)."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    class Recording(FileSystem):
        error: OSError | None = None

        @contextmanager
        def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
            try:
                with super().create_stream(path, mode) as stream:
                    yield Guarded(stream, self) if "w" in mode else stream
            except OSError as exc:
                self.error = self.error or exc
                raise

    return Recording()


class Guarded:
    """A stream whose failing write is remembered by `fs` before it propagates."""

    def __init__(self, stream: Any, fs: Any) -> None:
        self._stream, self._fs = stream, fs

    def write(self, data: Any) -> int:
        try:
            return self._stream.write(data)
        except OSError as exc:
            self._fs.error = self._fs.error or exc
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def with_free_space(why: str, root: Path) -> str:
    """`why`, said as a full disk when the error did not say so but the file system is full."""
    try:
        free = shutil.disk_usage(root).free
    except OSError:
        return why
    if free < (1 << 20) and os.strerror(errno.ENOSPC) not in why:
        return f"{os.strerror(errno.ENOSPC)} ({free} bytes free; {why})"
    return why


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{secrets.token_hex(4)}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
