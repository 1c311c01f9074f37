"""Run a plan's world and compare it with the single-process reference: ``verify_in_process``
(collective: every rank of the plan's world calls it) trains in parallel and compares on rank 0
(`runtime.verify.compare`); ``verify`` spawns that world on CPU with gloo (hard timeout), and
reruns in float64 a comparison whose later steps drift in fp32.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import queue
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import attrs
import torch
import torch.distributed as dist

from ppdsl.lowering.plan import Plan

from ppdsl.runtime.parallel.groups import ProcessGroups, build_process_groups, tie_pp_ranks_of
from ppdsl.runtime.run.failure import RankFailures, describe_user_error
from ppdsl.runtime.train.trainer import Trainer
from ppdsl.runtime.verify.compare import compare, describe
from ppdsl.runtime.verify.gather import _gather_to_rank0
from ppdsl.runtime.verify.reference import reference_run
from ppdsl.runtime.verify.report import Tolerances, VerifyReport


def verify_in_process(
    plan: Plan, groups: ProcessGroups, device: torch.device, steps: int, tol: Tolerances | None = None
) -> VerifyReport | None:
    """Train `steps` steps in parallel, gather everything on rank 0, compare there with the
    reference (computed on rank 0 afterwards). Returns the report on rank 0, None elsewhere."""
    trainer = Trainer(plan, groups, device)
    losses: list[float] = []
    norms: list[float] = []
    grads: list[dict[str, torch.Tensor] | None] = []
    for step in range(steps):
        losses.append(trainer.forward_backward(step))
        trainer.sync_gradients()
        grads.append(_gather_to_rank0(trainer, "grad"))
        if not trainer.unscale_and_check():
            norms.append(float(trainer.grad_norm()))
            trainer.clip()
            trainer.optimizer_step()
    params = _gather_to_rank0(trainer, "param")
    evaluated = None
    if plan.train.eval is not None:
        from ppdsl.runtime.train.evaluate import Evaluator

        evaluated = Evaluator(trainer).run(steps)
    if groups.rank != 0:
        return None
    ref = reference_run(plan, steps, "cpu")
    report = compare(plan, steps, losses, norms, grads, params, ref, tol or Tolerances.for_plan(plan))  # type: ignore[arg-type]
    if evaluated is not None:
        report = dataclasses.replace(report, eval=(evaluated, ref.eval))
    return report


def _init_from_store(rank: int, world: int, port: int, timeout_s: float) -> None:
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))


def _verify_worker(rank: int, world: int, port: int, timeout_s: float, plan_json: dict[str, Any], steps: int,
                   tol: Tolerances, results: Any) -> None:
    torch.set_num_threads(1)
    try:
        _init_from_store(rank, world, port, timeout_s)
        try:
            plan = Plan.from_json(plan_json)
            groups = build_process_groups(plan.mesh, "cpu", tie_pp_ranks_of(plan.schedule.stage_ranks))
            report = verify_in_process(plan, groups, torch.device("cpu"), steps, tol)
        finally:
            dist.destroy_process_group()
        results.put((rank, True, report))
    except ValueError as exc:  # a configuration the runtime cannot run: the user's to fix
        results.put((rank, False, _UserError(describe_user_error(rank, exc))))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


@dataclass(frozen=True)
class _UserError:
    line: str


def as_fp64(plan: Plan) -> Plan:
    """`plan` computing in float64: train.precision only. The front end (`--set
    train.precision=fp64`, what `ppdsl verify` passes as `fp64_plan`) also builds an HF model
    with the kernels float64 needs (transformers' grouped_mm experts take no float64)."""
    return attrs.evolve(plan, train=attrs.evolve(plan.train, precision="fp64"))


def verify(plan: Plan, steps: int, *, timeout_s: float = 600.0,
           tol: Tolerances | None = None, notes: Sequence[str] = (), fp64_rerun: bool = True,
           fp64_plan: Callable[[], Plan | None] | None = None,
           progress: Callable[[str], None] | None = None) -> VerifyReport:
    """Run `plan` on CPU in plan.mesh.world gloo processes and compare with the reference.
    Raises RuntimeError (with every failing rank's traceback) on a crash or a timeout.

    An fp32 comparison whose first step agrees but a later step exceeds its tolerance
    (`VerifyReport.drift_only`: Adam amplifies rounding over depth and steps) is run again in
    float64 (`fp64_rerun`); the report carries that run, and is OK when fp64 agrees.
    `fp64_plan`: the plan to rerun (None from it: the spec does not check in fp64); default
    `as_fp64(plan)`. `progress` hears one line before the rerun starts."""
    report = _verify_world(plan, steps, timeout_s, tol)
    if notes:
        report = dataclasses.replace(report, notes=tuple(notes))
    if not (fp64_rerun and report.drift_only):
        return report
    if progress is not None:
        progress("verify: step 1 agrees, later steps exceed the fp32 tolerance; running both again in fp64 "
                 "to tell rounding from a wrong split")
    try:
        wide_plan = as_fp64(plan) if fp64_plan is None else fp64_plan()
        if wide_plan is None:
            return dataclasses.replace(report, fp64_error="the spec does not check with train.precision=fp64")
        wide = _verify_world(wide_plan, steps, timeout_s, None)
    except RankFailures as exc:
        return dataclasses.replace(report, fp64_error="; ".join(exc.lines))
    except (RuntimeError, ValueError) as exc:  # a crash: its first line and the traceback's last
        lines = [line for line in str(exc).splitlines() if line.strip()] or [type(exc).__name__]
        return dataclasses.replace(report, fp64_error=" ... ".join(dict.fromkeys((lines[0], lines[-1]))))
    return dataclasses.replace(report, fp64=dataclasses.replace(wide, notes=tuple(notes)))


def _verify_world(plan: Plan, steps: int, timeout_s: float,
                  tol: Tolerances | None) -> VerifyReport:
    import torch.multiprocessing as mp

    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if plan.train.precision == "fp16":
        raise ValueError("verify runs on CPU: precision fp16 needs CUDA (use fp32 or bf16)")
    world = plan.mesh.world
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_verify_worker, daemon=True,
                    args=(r, world, store.port, timeout_s, plan.to_json(), steps, tol or Tolerances.for_plan(plan), results))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    got: dict[int, Any] = {}
    errors: dict[int, str] = {}
    try:
        while len(got) + len(errors) < world:
            if time.monotonic() > deadline:
                errors[-1] = f"timed out after {timeout_s:.0f} s"
                break
            try:
                rank, ok, value = results.get(timeout=0.2)
            except queue.Empty:
                for r, p in enumerate(procs):
                    if p.exitcode not in (None, 0) and r not in got and r not in errors:
                        errors[r] = f"process exited with code {p.exitcode}"
                continue
            (got if ok else errors)[rank] = value
            if errors:
                deadline = min(deadline, time.monotonic() + 5)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5)
        del store
    user = [e.line for _, e in sorted(errors.items()) if isinstance(e, _UserError)]
    if user:  # the cause; the other ranks' failures (a lost peer) are its consequences
        causes: dict[str, str] = {}
        for line in user:  # each cause once, under the lowest rank that raised it
            causes.setdefault(line.split(": ", 2)[-1], line)
        raise RankFailures(list(causes.values()), internal=False)
    if errors:
        detail = "\n".join(f"--- {'harness' if r < 0 else f'rank {r}'} ---\n{e}" for r, e in sorted(errors.items()))
        raise RuntimeError(f"verify of {describe(plan)} failed (pid {os.getpid()}):\n{detail}")
    return got[0]
