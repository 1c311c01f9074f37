"""Run a function in several spawned processes joined by a gloo process group, with a hard
timeout, and bring back the per-rank results or every failing rank's traceback.

    results = run_distributed(fn, 2, arg1, arg2, timeout=120)

`fn(rank, world_size, *args)` must be a module-level (picklable) function; what it returns must
be picklable. The parent hosts the rendezvous TCPStore on a port the OS picks (no race for a
"free" port); children get `torch.set_num_threads(1)`.

Two limits: `timeout` is the hard wall-clock limit of the whole run (process start-up included,
which on a loaded 2-core machine is most of it: every child imports torch); `collective_timeout`
bounds each collective, so a rank waiting on a peer that will never join raises (and is
reported) well before the hard limit. A hang, a crash or an exception in any rank fails the
caller with a `DistributedFailure` (an AssertionError, so pytest reports it as a test failure)
carrying the children's tracebacks; stragglers are killed.
"""

from __future__ import annotations

import datetime
import os
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["DistributedFailure", "run_distributed"]

_HOST = "127.0.0.1"
_ERROR_GRACE_S = 5.0  # after one rank fails, how long to wait for the others' reports


class DistributedFailure(AssertionError):
    """A distributed run failed: an exception, a crash or a timeout in some rank."""


def _worker(fn: Callable[..., Any], rank: int, world_size: int, port: int, timeout: float,
            collective_timeout: float, backend: str, args: tuple[Any, ...],
            results: Any) -> None:
    torch.set_num_threads(1)
    try:
        store = dist.TCPStore(_HOST, port, world_size, is_master=False,
                              timeout=datetime.timedelta(seconds=timeout))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=collective_timeout))
        try:
            value = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, True, value))
    except BaseException:  # noqa: BLE001 -- report everything, SystemExit included
        results.put((rank, False, traceback.format_exc()))


def _kill(procs: list[Any]) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=5)


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any,
                    timeout: float = 120.0, collective_timeout: float | None = None,
                    backend: str = "gloo") -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` spawned ranks; return the results in
    rank order, or raise DistributedFailure within about `timeout` seconds. Each collective
    times out after `collective_timeout` (default: min(timeout, 60) s)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if collective_timeout is None:
        collective_timeout = min(timeout, 60.0)
    store = dist.TCPStore(_HOST, 0, world_size, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout))
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_worker, daemon=True, name=f"rank{rank}",
                    args=(fn, rank, world_size, store.port, timeout, collective_timeout,
                          backend, args, results))
        for rank in range(world_size)
    ]
    start = time.monotonic()
    for p in procs:
        p.start()
    values: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = start + timeout
    try:
        while len(values) + len(errors) < world_size:
            now = time.monotonic()
            if now >= deadline:
                missing = sorted(set(range(world_size)) - values.keys() - errors.keys())
                errors.setdefault(-1, f"timed out after {timeout:.0f} s; ranks {missing} "
                                      "did not finish (hang or deadlock?)")
                break
            try:
                rank, ok, value = results.get(timeout=min(0.2, deadline - now))
            except queue.Empty:
                _note_silent_deaths(procs, results, values, errors)
                continue
            (values if ok else errors)[rank] = value
            if errors and deadline > time.monotonic() + _ERROR_GRACE_S:
                deadline = time.monotonic() + _ERROR_GRACE_S
    finally:
        _kill(procs)
        del store
    if errors:
        raise DistributedFailure(_format_errors(fn, world_size, errors, time.monotonic() - start))
    return [values[r] for r in range(world_size)]


def _note_silent_deaths(procs: list[Any], results: Any, values: dict[int, Any],
                        errors: dict[int, str]) -> None:
    """Record ranks whose process exited without reporting (segfault, os._exit, OOM kill)."""
    for rank, p in enumerate(procs):
        if rank in values or rank in errors or p.exitcode is None:
            continue
        try:  # its report may still be in the pipe
            r, ok, value = results.get(timeout=0.5)
            (values if ok else errors)[r] = value
            continue
        except queue.Empty:
            errors[rank] = f"process exited with code {p.exitcode} without reporting"


def _format_errors(fn: Callable[..., Any], world_size: int, errors: dict[int, str],
                   elapsed: float) -> str:
    name = getattr(fn, "__qualname__", repr(fn))
    lines = [f"{name} failed on {world_size} ranks after {elapsed:.1f} s (pid {os.getpid()}):"]
    for rank in sorted(errors):
        label = "harness" if rank < 0 else f"rank {rank}"
        lines.append(f"--- {label} ---\n{errors[rank].rstrip()}")
    return "\n".join(lines)
