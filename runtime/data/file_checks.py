"""The checks on a data file: a regular file before it is opened (never a hang on a FIFO), and a
memory-mapped file watched each step for being truncated, removed or rewritten while the run reads it.
"""

from __future__ import annotations

import os
import sys

from ppdsl.runtime.run.failure import RunFault


def _regular_file(path: str, what: str) -> None:
    """ValueError unless `path` is a regular file (a FIFO would block on open: never a hang)."""
    if not os.path.lexists(path):
        raise ValueError(f"{what} {path} does not exist")
    if not os.path.isfile(path):
        raise ValueError(f"{what} {path} is not a regular file")


class _WatchedFile:
    """A memory-mapped file, watched through a descriptor kept open (it names the mapped file
    even after a rename or removal of the path)."""

    def __init__(self, path: str, what: str) -> None:
        self.path, self.what = path, what
        self.fd = os.open(path, os.O_RDONLY)
        st = os.fstat(self.fd)
        self.size, self.mtime_ns = st.st_size, st.st_mtime_ns
        self.warned: set[str] = set()

    def check(self) -> None:
        st = os.fstat(self.fd)
        if st.st_size < self.size:
            raise RunFault(
                f"{self.what} {self.path} shrank from {self.size} to {st.st_size} bytes while the run read it "
                "(truncated or rewritten in place); reading on would crash the process (SIGBUS). Restore the file, "
                "then resume from the newest checkpoint (ppdsl run --resume) or run again")
        if st.st_nlink == 0:
            self._warn("removed", f"{self.what} {self.path} was removed during the run: the run goes on reading "
                                  "the file it opened, but a resume will not find it")
        elif st.st_mtime_ns != self.mtime_ns:
            self._warn("modified", f"{self.what} {self.path} was modified in place during the run: the steps "
                                   "from here on read its new contents")

    def _warn(self, kind: str, text: str) -> None:
        if kind not in self.warned:
            self.warned.add(kind)
            print(f"ppdsl: warning: {text}", file=sys.stderr, flush=True)
