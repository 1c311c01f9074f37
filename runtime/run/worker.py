"""One worker of a run: ``run_worker`` trains the plan as this process's rank (its environment
set by torchrun, or a world of one without it): it joins the process group, decides with the
other ranks where to start (a fresh run directory or the newest intact checkpoint), trains, and
exports the final model. Returns the exit code (`runtime.run.failure`). The launcher that starts
the workers is `runtime.run.launch`.
"""

from __future__ import annotations

import datetime
import os
import sys
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ppdsl.lowering.plan import Plan

from ppdsl.runtime.run.failure import EXIT_FAIL, EXIT_INVALID, EXIT_OK, EXIT_SIGTERM

if TYPE_CHECKING:
    import torch


def preflight(plan: Plan, out_dir: str | None, device_type: str) -> None:
    """ValueError for what the workers would refuse only after building (or, for the final
    model, after training): fp16 without CUDA, a ``RUN_DIR/final`` that cannot be written."""
    import torch

    from ppdsl.runtime.export.atomic_dir import check_final_destination
    from ppdsl.runtime.train.optim import autocast_factory

    autocast_factory(plan.train.precision, torch.device(device_type))
    if out_dir is not None and plan.train.save_final:
        check_final_destination(out_dir)


def run_worker(plan: Plan, out_dir: str | None, *, resume: bool = False, overwrite: bool = False,
               memory_trace: bool = False, memory_trace_steps: int = 0) -> int:
    """Train `plan` as this process's rank (environment set by torchrun; without it, a world of
    one). Writes ``metrics.jsonl`` into `out_dir` on rank 0. `resume`: continue from the newest
    complete checkpoint in ``train.checkpoint.dir`` (also done when torchrun restarted the
    job, ``TORCHELASTIC_RESTART_COUNT`` > 0). An `out_dir` holding an earlier run is refused
    unless `resume` or `overwrite` (rank 0 then removes what the earlier run wrote).
    `memory_trace`: measure each rank's peak of live tensor bytes over the steps and print it
    against the plan's prediction (``runtime.train.memory_report``), over its first
    `memory_trace_steps` steps (0: all of them). Returns the exit code."""
    import torch.distributed as dist

    from ppdsl.runtime.run.failure import timeout_s

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
    try:  # every rank decides alike, before any of them joins
        preflight(plan, out_dir, device.type)
        if memory_trace and plan.train.compile and device.type == "cpu":
            raise ValueError("--memory-trace counts live tensors on CPU with a dispatch mode, which torch.compile's "
                             "graphs do not run under: run it with train.compile = false")
    except ValueError as exc:
        print(f"ppdsl run (rank {rank}): {exc}", file=sys.stderr)
        return EXIT_INVALID
    timeout = datetime.timedelta(seconds=timeout_s(plan.train.hang_timeout))
    backend = "nccl" if device.type == "cuda" else "gloo"
    try:
        _init_process_group(backend, device, world, rank, timeout)
    except Exception as exc:  # a peer that never came, a store that went away
        print(f"ppdsl run: rank {rank} could not join the process group: {type(exc).__name__}: "
              f"{str(exc).splitlines()[0] if str(exc) else ''}", file=sys.stderr)
        return EXIT_FAIL
    ok = False
    try:
        code = _train(plan, out_dir, device, rank, resume, overwrite, memory_trace, memory_trace_steps)
        ok = code in (EXIT_OK, EXIT_SIGTERM)
        return code
    finally:
        if ok and dist.is_initialized():
            dist.destroy_process_group()
        # after a failure a peer may be gone: do not wait on it here, the process is ending


def _init_process_group(backend: str, device: torch.device, world: int, rank: int, timeout: datetime.timedelta) -> None:
    import torch.distributed as dist

    device_id = device if device.type == "cuda" else None
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if "MASTER_ADDR" in os.environ and restart > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # a restarted job: torchrun's store still holds the addresses the previous attempt's
        # processes published under the same keys; a fresh prefix keeps them apart
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size=world,
                              is_master=False, timeout=timeout)
        store = dist.PrefixStore(f"ppdsl/attempt-{restart}", store)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout, device_id=device_id)
    elif "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend, timeout=timeout, device_id=device_id)
    else:  # a single process started without torchrun
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


def _device() -> torch.device:
    import torch

    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def _resume_point(plan: Plan, out_dir: str | None, resume: bool, overwrite: bool,
                  rank: int) -> tuple[list[str], list[str]]:
    """Rank 0 decides where to start and tells the others (one view of the file system):
    (the checkpoints to try, newest first - empty for a fresh start; notes). Raises ValueError
    when the run must not start (a user error): a checkpoint it cannot use, a run directory
    holding an earlier run."""
    import torch.distributed as dist

    from ppdsl.runtime.checkpoint.store import resume_candidates
    from ppdsl.runtime.run.lock import take_for_worker
    from ppdsl.runtime.run.rundir import claim_run_dir, clear_earlier_run

    box: list[object] = [None]
    if rank == 0:
        restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
        try:
            lock_notes = take_for_worker(out_dir, None if plan.train.checkpoint is None else plan.train.checkpoint.dir)
            start_from, notes = resume_candidates(plan, resume, restarted)
            notes = lock_notes + notes
            if out_dir is not None:
                claim_run_dir(out_dir, resume=resume or restarted, overwrite=overwrite)
                if overwrite and not (resume or restarted):
                    removed = clear_earlier_run(out_dir)
                    if removed:
                        notes.append(f"ppdsl: --overwrite: removed the earlier run's {', '.join(removed)} from {out_dir}")
            box[0] = ("ok", start_from, notes)
        except ValueError as exc:
            box[0] = ("error", str(exc), [])
    dist.broadcast_object_list(box, src=0)
    kind, value, notes = box[0]  # type: ignore[misc]
    if kind == "error":
        # every rank has the verdict: leave the group together, or gloo aborts (SIGABRT) the
        # ranks whose peers exit first with a live process group
        dist.barrier()
        dist.destroy_process_group()
        raise ValueError(value)
    return value, notes


def _train(plan: Plan, out_dir: str | None, device: torch.device, rank: int, resume: bool = False,
           overwrite: bool = False, memory_trace: bool = False, memory_trace_steps: int = 0) -> int:
    from ppdsl.runtime.checkpoint.store import Checkpointer, step_name
    from ppdsl.runtime.export.write import export_model
    from ppdsl.runtime.export.atomic_dir import FINAL_DIR
    from ppdsl.runtime.run.failure import RunFault, StepStatus, StopFlag, describe_failure
    from ppdsl.runtime.parallel.groups import build_process_groups, tie_pp_ranks_of
    from ppdsl.runtime.run.lock import release_worker_lock
    from ppdsl.runtime.train.metrics import MetricsLogger
    from ppdsl.runtime.run.rundir import METRICS_FILE
    from ppdsl.runtime.train.trace import TRACE_FILE, write_plan, write_trace
    from ppdsl.runtime.train.trainer import Trainer
    from ppdsl.runtime.train.loop import run_steps
    from ppdsl.runtime.run.watchdog import Watchdog

    status = StepStatus(rank)
    status.at(0, "start")
    stop = StopFlag().install()
    watchdog = Watchdog.start(plan.train.hang_timeout, status, rank, plan.mesh.world)
    try:
        start_from, notes = _resume_point(plan, out_dir, resume, overwrite, rank)
        groups = build_process_groups(plan.mesh, device.type, tie_pp_ranks_of(plan.schedule.stage_ranks))
        trainer = Trainer(plan, groups, device)
        kept = sorted({n for stage in trainer.stages for n in getattr(stage, "pretrained_kept", ())})
        if kept and groups.tp_rank == 0 and groups.dp_rank == 0:  # once per pipeline rank
            print(f"ppdsl: hf_pretrained: {len(kept)} parameter(s) of pipeline rank {groups.pp_rank} are not in the "
                  f"checkpoint and keep their initial values: {', '.join(kept[:6])}{' ...' if len(kept) > 6 else ''}",
                  flush=True)
        ckpt = plan.train.checkpoint
        checkpointer = None if ckpt is None else Checkpointer(Path(ckpt.dir), plan, rank)
        resumed = None
        if start_from:
            assert checkpointer is not None
            status.at(0, "load")
            resumed = checkpointer.resume(trainer, start_from)  # the first intact one
        start = 0 if resumed is None else resumed.step
        metrics = None if out_dir is None else Path(out_dir) / METRICS_FILE
        if out_dir is not None and rank == 0:
            write_plan(plan, Path(out_dir))
        resume_after = None if resumed is None else start
        with MetricsLogger(metrics, plan.train.steps, enabled=rank == 0, resume_after=resume_after) as logger:
            m = plan.mesh
            logger.note(
                f"ppdsl: {plan.model.target} on {m.world} {device.type} process(es), dp={m.dp} pp={m.pp} tp={m.tp}, "
                f"{plan.schedule.style} x {plan.schedule.microbatches} microbatches, {plan.train.steps} steps"
            )
            if out_dir is not None:
                logger.note(f"run directory: {out_dir}")
            for note in notes:
                logger.note(note)
            for line in () if resumed is None else resumed.lines:
                logger.note(line)
            for unsupported in _not_implemented(plan):
                logger.note(f"ppdsl: warning: {unsupported} is not implemented by the runtime yet and is ignored")
            if memory_trace:
                _traced_steps(trainer, logger, plan, out_dir, device, rank, start, checkpointer, stop, status,
                              memory_trace_steps)
            else:
                run_steps(trainer, logger, start=start, checkpointer=checkpointer, stop=stop, status=status)
            if trainer.recorder is not None:
                traced = write_trace(trainer.recorder, None if out_dir is None else Path(out_dir) / TRACE_FILE,
                                     {"spec": plan.spec_file, "style": plan.schedule.style})
                if traced is not None:
                    logger.note(f"trace: {traced} (Perfetto / chrome://tracing; `ppdsl schedule --measured {out_dir}`)")
            if metrics is not None:
                logger.note(f"metrics: {metrics}")
            if trainer.stopped:
                saved = "" if checkpointer is None else f"; checkpoint {Path(ckpt.dir) / step_name(status.step)}"
                logger.note(f"ppdsl: stopped by SIGTERM after step {status.step}{saved}")
                return EXIT_SIGTERM
            if out_dir is not None and plan.train.save_final:
                status.at(status.step, "export")
                final = export_model(trainer, Path(out_dir) / FINAL_DIR, force=True)
                if final is not None:
                    logger.note(f"model: {final} (`ppdsl export {out_dir} OUT_DIR` publishes it)")
        return EXIT_OK
    except RunFault as exc:  # the run's fault, not ppdsl's (a damaged checkpoint, a full disk, a diverged loss)
        return exc.leave(rank, status)
    except ValueError as exc:  # a plan the runtime cannot run, a checkpoint it cannot load: the user's to fix
        print(f"ppdsl run (rank {rank}): {exc}", file=sys.stderr)
        return EXIT_INVALID
    except Exception as exc:
        if watchdog is not None and watchdog.consequence(exc):
            return EXIT_FAIL  # the watchdog named the hung rank and ends this process: no second story
        print(describe_failure(rank, status.step, exc), file=sys.stderr, flush=True)
        if not _quiet_failure(exc):
            print(traceback.format_exc(), file=sys.stderr)
        return EXIT_FAIL
    finally:
        if watchdog is not None:
            watchdog.stop()
        stop.restore()
        release_worker_lock()


def _traced_steps(trainer: Any, logger: Any, plan: Plan, out_dir: str | None, device: torch.device, rank: int,
                  start: int, checkpointer: Any, stop: Any, status: Any, memory_trace_steps: int = 0) -> None:
    """`run_steps` under `runtime.train.memory_trace` (its first `memory_trace_steps` steps, 0: all);
    then rank 0 writes and prints every rank's peak against the plan's prediction
    (`runtime.train.memory_report`)."""
    from ppdsl.runtime.train import memory_report
    from ppdsl.runtime.train.memory_trace import MemoryTracker, trainer_state, tracked_optimizer
    from ppdsl.runtime.train.loop import run_steps

    tracker = MemoryTracker(device, rank, memory_trace_steps)
    tracker.track(trainer_state(trainer))
    tracked_optimizer(trainer, tracker)
    tracker.start()
    try:
        run_steps(trainer, logger, start=start, checkpointer=checkpointer, stop=stop, status=status,
                  after_step=tracker.after_step)
    finally:
        tracker.stop()
    measured = memory_report.gather(tracker.result(), plan.mesh.world)
    steps = tracker.steps
    if rank == 0:
        for line in memory_report.lines(plan, measured, steps):
            logger.note(line)
        if out_dir is not None:
            logger.note(f"memory: {memory_report.write(out_dir, plan, measured, steps)}")


def _quiet_failure(exc: BaseException) -> bool:
    from ppdsl.runtime.run.failure import is_communication_error

    return is_communication_error(exc) and not os.environ.get("PPDSL_DEBUG")


def _not_implemented(plan: Plan) -> list[str]:
    out = []
    return out
