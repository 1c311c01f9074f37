"""Step s + 1's microbatches read in a background thread while step s runs, and the time a step
waited for its data.

The training loop (runtime/train/loop.py) asks for step s's microbatches with `take(s)`: those
read ahead, waited for if not ready yet, or read now when none were (the first step, or a step
out of sequence); the seconds `take` spent are `wait_s`, the step's data wait (metrics.jsonl's
``data_wait_s``). Then step s + 1's read starts in the one background thread. The data is a
pure function of (seed, step, replica) (`runtime.data.source`), so reading ahead changes no sample; an
error of a read ahead (bad data at step s + 1) is raised by the `take` of that step, as it was
without prefetch. At most one read runs at a time, so a source is never read by two threads at
once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

__all__ = ["Prefetcher"]


class Prefetcher:
    """Reads step `s + 1` while step `s` runs; `read(step)` gives a step's microbatches. `end`:
    the first step not to read ahead (the run's step count)."""

    def __init__(self, read: Callable[[int], Any], end: int) -> None:
        self._read, self._end = read, end
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ppdsl-data")
        self._ahead: tuple[int, Future[Any]] | None = None
        self.wait_s = 0.0

    def take(self, step: int) -> Any:
        t0 = time.perf_counter()
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == step:
            out = ahead[1].result()
        else:
            if ahead is not None:  # another step was read ahead: let it finish (one reader at a time)
                ahead[1].exception()
            out = self._read(step)
        self.wait_s = time.perf_counter() - t0
        if step + 1 < self._end:
            self._ahead = (step + 1, self._pool.submit(self._read, step + 1))
        return out

    def close(self) -> None:
        """Waits for a read in progress (a pending one is dropped)."""
        self._ahead = None
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
