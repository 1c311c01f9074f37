"""The training loop: steps, logging, evaluation, checkpoints, and stopping (SIGTERM, or
non-finite steps), over a `runtime.train.trainer.Trainer` that does one step."""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist

from ppdsl.runtime.train.metrics import MetricsLogger, StepRecord, compile_stats, eta_seconds, mfu, peak_memory_mib
from ppdsl.runtime.train.trace import bubble_slots

if TYPE_CHECKING:
    from ppdsl.runtime.train.trainer import Trainer


def run_steps(trainer: Trainer, logger: MetricsLogger, steps: int | None = None, **kw: Any) -> list[StepRecord]:
    """`_run_steps`, each step's data read ahead in a background thread (`runtime.data.prefetch`)."""
    from ppdsl.runtime.data.prefetch import Prefetcher

    end = trainer.plan.train.steps if steps is None else steps
    with Prefetcher(trainer.read_step, end) as trainer.feed:
        try:
            return _run_steps(trainer, logger, steps, **kw)
        finally:
            trainer.feed = None


def _run_steps(
    trainer: Trainer,
    logger: MetricsLogger,
    steps: int | None = None,
    *,
    start: int = 0,
    checkpointer: Any = None,
    stop: Any = None,
    status: Any = None,
    after_step: Callable[[int], None] | None = None,
) -> list[StepRecord]:
    """Run steps `start` .. `steps` - 1 (0-based; `start` = the steps a resumed checkpoint
    holds). `checkpointer` (runtime.checkpoint.store.Checkpointer): save every
    ``train.checkpoint.every`` steps and at the end. `stop` (runtime.run.failure.StopFlag): after
    each step the ranks agree whether any got SIGTERM; if so they save a checkpoint and
    return early with ``trainer.stopped`` set. `status` (runtime.run.failure.StepStatus): told
    each step, so a failure can be attributed. With ``train.eval`` the held-out data is
    evaluated every ``eval.every`` steps and after the last step (``runtime.train.evaluate``).
    A skipped (non-finite) step is always logged; after ``train.max_nonfinite`` of them in
    a row (``on_nonfinite = stop``: the first) every rank raises the same
    `runtime.run.failure.RunFault`, without saving a checkpoint. `after_step`: called with the
    step's number (1-based) once it is logged (``ppdsl run --memory-trace`` stops counting there)."""
    from ppdsl.runtime.train.evaluate import Evaluator
    from ppdsl.runtime.run.failure import RunFault, test_fault

    train = trainer.plan.train
    steps = train.steps if steps is None else steps
    every = train.checkpoint.every if train.checkpoint is not None else 0
    tokens = train.global_batch * train.seq_len
    records = []
    trainer.stopped = False
    saved_at = start if start > 0 else None
    rank = trainer.groups.rank
    trainer.skipped_steps = logger.skipped_before  # rank 0's count, for the records
    streak = 0  # non-finite steps in a row (the same on every rank)
    limit = 1 if train.on_nonfinite == "stop" else train.max_nonfinite
    evaluator = Evaluator(trainer) if train.eval is not None and steps > start else None
    if train.metrics == "tensorboard" and (log_dir := logger.enable_tensorboard()) is not None:
        logger.note(f"tensorboard: {log_dir}")
    flops = trainer.model_flops_per_token() if train.peak_tflops is not None else None
    trainer.executor.progress = status
    loop_start = time.perf_counter()
    for i in range(start, steps):
        if status is not None:
            status.at(i + 1)
        test_fault("step", i + 1, rank)
        lr = trainer.optimizer.param_groups[0]["lr"]
        if trainer.recorder is not None:
            trainer.recorder.begin_step(i + 1)
        t0 = time.perf_counter()
        loss, norm, skipped = trainer.step(i)
        streak = streak + 1 if skipped else 0
        trainer.skipped_steps += int(skipped)
        if trainer.device.type == "cuda":
            torch.cuda.synchronize(trainer.device)
        elapsed = time.perf_counter() - t0
        wait = trainer.feed.wait_s if trainer.feed is not None else 0.0  # of this step's time
        eta = eta_seconds(time.perf_counter() - loop_start, i + 1 - start, steps - i - 1)
        if trainer.recorder is not None:
            trainer.recorder.end_step()
        if (i + 1) % max(1, train.log_every) == 0 or i + 1 == steps or skipped:
            peak, wait, bubble = _peak_memory_and_bubbles(trainer, wait)
            record = StepRecord(
                step=i + 1,
                loss=loss,
                lr=lr,
                grad_norm=norm,
                step_time_s=elapsed,
                tokens_per_s=tokens / elapsed,
                peak_memory_mib=peak,
                skipped=skipped,
                loss_scale=None if trainer.scaler is None else trainer.scaler.scale,
                mfu=None if flops is None else mfu(tokens / elapsed, flops, train.peak_tflops, trainer.groups.layout.world),
                eta_s=eta,
                bubble=bubble,
                skipped_steps=trainer.skipped_steps,
                compile=compile_stats() if train.compile else None,
                data_wait_s=wait,
            )
            logger.log(record)
            records.append(record)
        else:
            logger.status(i + 1, eta)
        if after_step is not None:
            after_step(i + 1)
        if streak >= limit:
            raise RunFault(_nonfinite_line(trainer, i + 1, streak, loss, saved_at), agreed=True)
        if evaluator is not None and evaluator.due(i + 1, steps):
            if status is not None:
                status.at(i + 1, "eval")
            logger.log_eval(evaluator.run(i + 1))
        if stop is not None and _any_rank_stopping(trainer, stop):
            trainer.stopped = True
            if checkpointer is not None and saved_at != i + 1:
                _save(trainer, checkpointer, i + 1, logger, status, "SIGTERM")
            return records
        if checkpointer is not None and every > 0 and (i + 1) % every == 0 and i + 1 < steps:
            _save(trainer, checkpointer, i + 1, logger, status, "every")
            saved_at = i + 1
    if checkpointer is not None and saved_at != steps and steps > start:
        _save(trainer, checkpointer, steps, logger, status, "end")
    return records

def _nonfinite_line(trainer: Trainer, step: int, streak: int, loss: float, saved_at: int | None) -> str:
    """The line of a run stopped by non-finite steps (`what` as the last of them saw it)."""
    train = trainer.plan.train
    what = "the loss" if not math.isfinite(loss) else "a gradient"
    if train.on_nonfinite == "stop":
        why = f"{what} was not finite (train.on_nonfinite = stop)"
    else:
        why = f"{what} was not finite for {streak} steps in a row (train.max_nonfinite = {train.max_nonfinite})"
    good = step - streak
    state = f"the parameters are step {good}'s" if good > 0 else "the parameters are the initial ones"
    newest = "" if saved_at is None else f", the newest checkpoint is step {saved_at}'s"
    return f"stopped at step {step}: {why}; no checkpoint written ({state}{newest})"

def _any_rank_stopping(trainer: Trainer, stop: Any) -> bool:
    flag = torch.tensor(1.0 if stop.set else 0.0, device=trainer.device)
    if trainer.groups.layout.world > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())

def _save(trainer: Trainer, checkpointer: Any, step: int, logger: MetricsLogger, status: Any, why: str) -> None:
    if status is not None:
        status.at(step, "save")
    t0 = time.perf_counter()
    path = checkpointer.save(trainer, step)
    logger.note(f"checkpoint: {path} ({why}, {time.perf_counter() - t0:.1f} s)")
    if status is not None:
        status.at(step, "saved")

def _peak_memory_and_bubbles(trainer: Trainer, wait: float) -> tuple[float, float, list[float] | None]:
    """The largest peak memory and data wait (`wait`: this rank's) over the ranks; with tracing
    also every rank's bubble this step (`runtime.train.trace.bubble_slots`), carried by the same
    all-reduce."""
    world = trainer.groups.layout.world
    values = [peak_memory_mib(trainer.device), wait]
    if trainer.recorder is not None:
        values += bubble_slots(trainer.recorder, world)
    both = torch.tensor(values, dtype=torch.float32, device=trainer.device)
    if world > 1:
        dist.all_reduce(both, op=dist.ReduceOp.MAX)
    bubbles = None if trainer.recorder is None else [round(float(b), 4) for b in both[2:]]
    return float(both[0]), float(both[1]), bubbles
