"""Start and run the workers of a plan.

``launch`` hands ``python -m ppdsl run SPEC ...`` to torchrun's own launcher (local rendezvous,
``--standalone``); each worker, seeing torchrun's RANK / WORLD_SIZE / LOCAL_RANK, lowers the
spec for that world and calls ``run_worker``. Multi-node is plain ``torchrun`` with its usual
rendezvous flags and ``-m ppdsl run SPEC``.
"""

from __future__ import annotations

import datetime
import os
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ppdsl.lowering.plan import Plan

if TYPE_CHECKING:
    import torch

EXIT_OK, EXIT_FAIL, EXIT_INVALID = 0, 1, 2
DEFAULT_TIMEOUT_S = 600.0  # a collective waiting longer than this fails instead of hanging


def run_worker(plan: Plan, out_dir: str | None) -> int:
    """Train `plan` as this process's rank (environment set by torchrun; without it, a world of
    one). Writes ``metrics.jsonl`` into `out_dir` on rank 0. Returns the exit code."""
    import torch
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if plan.mesh.world != world:
        print(
            f"ppdsl run: the plan needs {plan.mesh.world} processes (dp={plan.mesh.dp} x pp={plan.mesh.pp} x "
            f"tp={plan.mesh.tp}), but WORLD_SIZE = {world}; start {plan.mesh.world} processes "
            f"(--nproc {plan.mesh.world}) or change the mesh",
            file=sys.stderr,
        )
        return EXIT_INVALID
    device = _device()
    timeout = datetime.timedelta(seconds=float(os.environ.get("PPDSL_TIMEOUT_S", DEFAULT_TIMEOUT_S)))
    backend = "nccl" if device.type == "cuda" else "gloo"
    if "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend, timeout=timeout, device_id=device if device.type == "cuda" else None)
    else:  # a single process started without torchrun
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    try:
        return _train(plan, out_dir, device, rank)
    finally:
        dist.destroy_process_group()


def _device() -> torch.device:
    import torch

    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def _train(plan: Plan, out_dir: str | None, device: torch.device, rank: int) -> int:
    from .groups import build_process_groups, tie_pp_ranks_of
    from .metrics import MetricsLogger
    from .train import Trainer

    try:
        groups = build_process_groups(plan.mesh, device.type, tie_pp_ranks_of(plan.schedule.stage_ranks))
        trainer = Trainer(plan, groups, device)
        metrics = None if out_dir is None else Path(out_dir) / "metrics.jsonl"
        with MetricsLogger(metrics, plan.train.steps, enabled=rank == 0) as logger:
            m = plan.mesh
            logger.note(
                f"ppdsl: {plan.model.target} on {m.world} {device.type} process(es), dp={m.dp} pp={m.pp} tp={m.tp}, "
                f"{plan.schedule.style} x {plan.schedule.microbatches} microbatches, {plan.train.steps} steps"
            )
            trainer.train(logger)
            if metrics is not None:
                logger.note(f"metrics: {metrics}")
        return EXIT_OK
    except ValueError as exc:  # a plan the runtime cannot run: the user's to fix
        print(f"ppdsl run (rank {rank}): {exc}", file=sys.stderr)
        return EXIT_INVALID
    except Exception:
        print(f"ppdsl run (rank {rank}) failed:\n{traceback.format_exc()}", file=sys.stderr)
        return EXIT_FAIL


def torchrun_args(spec_path: str, argv: Sequence[str], nproc: int) -> list[str]:
    """torchrun's arguments for `nproc` local workers running ``python -m ppdsl <argv>``.
    `argv` is the ``ppdsl`` command line (starting with ``run``; ``--nproc`` is dropped)."""
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    args = _without_nproc(list(argv))
    if not args or args[0] != "run":
        args = ["run", spec_path, *args]
    return ["--standalone", f"--nproc-per-node={nproc}", "--module", "ppdsl", *args]


def _without_nproc(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            out.append(a)
    return out


def launch(spec_path: str, argv: Sequence[str], nproc: int) -> int:
    """Start `nproc` workers through torchrun's launcher and wait for them. Returns 0, or the
    first failing worker's exit code (2 when a worker rejected the plan, else 1)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    ns = get_args_parser().parse_args(torchrun_args(spec_path, argv, nproc))
    try:
        run(ns)
    except ChildFailedError as exc:
        codes = sorted({f.exitcode for f in exc.failures.values()})
        print(f"ppdsl run: {len(exc.failures)} of {nproc} worker(s) failed (exit codes {codes})", file=sys.stderr)
        own = [c for c in codes if c > 0]  # negative: a signal, e.g. torchrun stopping the rest
        return EXIT_INVALID if own == [EXIT_INVALID] else EXIT_FAIL
    return EXIT_OK
