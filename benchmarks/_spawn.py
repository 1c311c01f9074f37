"""Run one benchmark function on several spawned CPU processes and collect what each returns."""

from __future__ import annotations

import datetime
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(measure: Callable[..., Any], rank: int, world: int, port: int, args: Sequence[Any], results: Any) -> None:
    try:
        torch.set_num_threads(1)
        timeout = datetime.timedelta(seconds=300)
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
        result = measure(rank, world, *args)
        dist.destroy_process_group()
        results.put((rank, result))
    except BaseException:
        results.put((rank, traceback.format_exc()))


def run_ranks(world: int, measure: Callable[..., Any], args: Sequence[Any], timeout_s: float = 1800) -> dict[int, Any] | None:
    """`measure(rank, world, *args)` on `world` spawned processes, each with one thread and in a
    gloo process group of them all; rank -> its result, or None after printing a failed rank's
    traceback."""
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=300))
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(measure, r, world, store.port, tuple(args), results)) for r in range(world)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=timeout_s) for _ in range(world))
    for p in procs:
        p.join(timeout=30)
    for rank, value in got.items():
        if isinstance(value, str):
            print(f"rank {rank} failed:\n{value}", file=sys.stderr)
            return None
    return got
