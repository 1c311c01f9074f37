"""Check a plan against a single-process reference: same seed, same data, same optimizer.

``verify(plan, steps)`` runs the plan on CPU with gloo in ``plan.mesh.world`` spawned processes
(hard timeout) and compares, step by step, with the full model trained in one process by
gradient accumulation over the same microbatches:

- the loss of every step (absolute difference);
- every parameter's gradient (after the tied / data-parallel synchronisation, before
  clipping), tensor-parallel shards gathered to the full shape (fused parts in order, vocab
  padding removed), relative to max(||b||, 1e-6 x the global gradient norm): below that a
  gradient is rounding noise;
- every parameter after the last optimizer step, leaving out the elements whose reference
  gradient was rounding noise at some step (below 1e-6 of the global gradient's RMS element, or,
  in a tensor whose gradient agrees, an element the two runs disagree on by more than 1%):
  BERT's key bias, the key third of GPT-2's fused q|k|v bias (softmax is invariant to them, their
  true gradient is 0). Adam turns such noise into steps of size lr in either direction. A
  parameter all of whose elements are such noise is reported as noise, and neither its
  gradient (noise compared with noise) nor its value is held to a tolerance.

Differences are norm-wise: ||a - b|| / ||b|| with the 2-norm over the whole tensor.

Step 1 (both runs from the same parameters) is the strict test of the split. After an Adam step,
rounding grows with depth and steps (Adam's update is about the sign of each gradient element): an
fp32 comparison whose step 1 agrees but a later step exceeds is run again in float64 by `verify`,
and is OK when fp64 agrees (rounding), FAILED when fp64 disagrees too (a wrong split).
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
import queue
import re
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch import nn

from ppdsl.lowering.plan import Plan

from ppdsl.runtime.run.failure import RankFailures, describe_user_error
from ppdsl.runtime.parallel.fsdp import full
from ppdsl.runtime.parallel.groups import ProcessGroups, build_process_groups, tie_pp_ranks_of
from ppdsl.runtime.parallel.expert import is_expert_shard
from ppdsl.runtime.stage.params import is_tp_sharded, owner_modules
from ppdsl.core.config_tree import deep_merge, frozen, leaves

from ppdsl.runtime.verify.reference import ReferenceRun, reference_run
from ppdsl.runtime.verify.report import Tolerances, VerifyReport
from ppdsl.runtime.train.trainer import Trainer


# config keys that are probabilities of randomness a parallel run cannot reproduce: each stage
# and tp rank draws its own dropout masks (and stochastic depth's, `drop_path_rate` of BEiT and
# Data2Vec-Vision), so the two runs' numbers differ by more than rounding
_RANDOM_KEY = re.compile(r"dropout|pdrop|layerdrop|drop_path", re.IGNORECASE)


def random_config(plan: Plan, config: dict[str, Any]) -> dict[str, float]:
    """The dropout probabilities in effect: every float key of the model's full config (`config`:
    the HF config, or a python factory's keyword defaults) named like a dropout, overridden by
    the spec's values, that is above 0; a composite model's sub-configs' too (Blip2's
    ``qformer_config``), named by their dotted path (``qformer_config.hidden_dropout_prob``)."""
    full = deep_merge(config, plan.model.config_dict)
    return {".".join(path): v for path, v in leaves(full)
            if _RANDOM_KEY.search(path[-1]) and isinstance(v, float) and v > 0}


def without_randomness(plan: Plan, config: dict[str, Any], keep: bool = False) -> tuple[Plan, tuple[str, ...]]:
    """The plan to verify, with dropout switched off in both runs (unless `keep`), and the one
    line that says so."""
    found = random_config(plan, config)
    if not found:
        return plan, ()
    names = ", ".join(sorted(found))
    if keep:
        return plan, (f"dropout kept ({names}): each run draws its own dropout masks (the parallel run per "
                      "stage and tensor-parallel rank), so the numbers differ by more than rounding; leave out "
                      "--keep-dropout to compare the computation itself",)
    off: dict[str, Any] = {}
    for name in found:
        *blocks, key = name.split(".")
        where = off
        for block in blocks:
            where = where.setdefault(block, {})
        where[key] = 0.0
    config_items = deep_merge(plan.model.config_dict, off)
    model = attrs.evolve(plan.model, config=tuple(sorted((k, frozen(v)) for k, v in config_items.items())))
    return attrs.evolve(plan, model=model), (f"dropout off for the comparison: {names}",)


def describe(plan: Plan) -> str:
    m, s = plan.mesh, plan.schedule
    return (
        f"{plan.model.family} {plan.model.target} dp={m.dp} pp={m.pp} tp={m.tp}{f' ep={m.ep}' if m.ep > 1 else ''} "
        f"{s.style} chunks={s.chunks} microbatches={s.microbatches}"
    )


def rel_diff(a: torch.Tensor, b: torch.Tensor, floor: float = 0.0) -> float:
    """||a - b|| / max(||b||, floor); inf for different shapes, ||a - b|| when both are 0."""
    if a.shape != b.shape:
        return math.inf
    a, b = a.detach().double(), b.detach().double()
    diff = torch.linalg.vector_norm(a - b).item()
    if diff == 0.0:
        return 0.0
    scale = max(torch.linalg.vector_norm(b).item(), floor)
    return diff / scale if scale > 0 else diff


# ---------------------------------------------------------------------------------------------
# Full tensors from the parallel run
# ---------------------------------------------------------------------------------------------


def full_tensors(trainer: Trainer, kind: str) -> dict[str, torch.Tensor]:
    """name -> full-shape CPU copy of each local parameter (kind="param") or its gradient
    (kind="grad"). Collective over tp (and ep): every rank of those groups must call it."""
    tp = trainer.groups.layout.tp
    owners: dict[int, tuple[nn.Module, str]] = {}
    for stage in trainer.stages:
        owners.update(owner_modules(stage))
    out = {}
    # ZeRO-1 leaves each averaged gradient on its owner only: gather them (verification only)
    gathered = trainer.zero.gathered_gradients() if kind == "grad" and trainer.zero is not None else None
    for name, p in trainer.named_params:
        t = p.detach() if kind == "param" else p.grad if gathered is None else gathered[id(p)]
        if t is None:
            t = torch.zeros_like(p)
        t = full(t)  # ZeRO-3: the dp shards gathered (collective over dp)
        owner, local = owners[id(p)]
        if is_expert_shard(owner):  # its experts' rows from every rank of the ep group
            shards = [torch.empty_like(t) for _ in range(trainer.groups.layout.ep)]
            dist.all_gather(shards, t.contiguous(), group=trainer.groups.ep)
            t = owner.merge_shards(local, shards)
        elif is_tp_sharded(p, owner, local, tp):
            shards = [torch.empty_like(t) for _ in range(tp)]
            dist.all_gather(shards, t.contiguous(), group=trainer.groups.tp)
            t = owner.merge_shards(local, shards)
        out[name] = t.detach().cpu().clone()
    return out


def _gather_to_rank0(trainer: Trainer, kind: str) -> dict[str, torch.Tensor] | None:
    """Every parameter's full tensor on global rank 0 (None elsewhere). Collective."""
    g = trainer.groups
    mine = full_tensors(trainer, kind)
    if g.tp_rank != 0 or g.dp_rank != 0 or g.cp_rank != 0:
        mine = {}
    parts: list[Any] = [None] * g.layout.world if g.rank == 0 else None  # type: ignore[assignment]
    dist.gather_object(mine, parts, dst=0)
    if g.rank != 0:
        return None
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        merged.update(part)
    return merged


def _global_norm(tensors: Any) -> float:
    return math.sqrt(sum(torch.linalg.vector_norm(t.double()).item() ** 2 for t in tensors))


# ---------------------------------------------------------------------------------------------
# Running and comparing (collective: every rank of the plan's world calls it)
# ---------------------------------------------------------------------------------------------


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


def compare(
    plan: Plan,
    steps: int,
    losses: Sequence[float],
    grad_norms: Sequence[float],
    grads: Sequence[dict[str, torch.Tensor]],
    params: dict[str, torch.Tensor],
    ref: ReferenceRun,
    tol: Tolerances,
) -> VerifyReport:
    problems = []
    # a tied tensor counts as present when the parallel run has it under any of its names
    missing = sorted(n for n in ref.params if not any(a in params for a in ref.aliases.get(n, (n,))))
    if missing:
        problems.append(f"{len(missing)} reference parameter(s) not found in the parallel model: {', '.join(missing[:5])}")
    extra = sorted(set(params) - set(ref.params))
    if extra:
        problems.append(f"{len(extra)} parallel parameter(s) unknown to the reference: {', '.join(extra[:5])}")
    by_step: list[dict[str, float]] = []
    signal: dict[str, torch.Tensor] = {}  # elements whose reference gradient was above noise every step
    for step_grads, ref_grads in zip(grads, ref.grads):
        norm = _global_norm(ref_grads.values())
        floor = tol.noise_floor * norm
        element_floor = floor / math.sqrt(max(1, sum(t.numel() for t in ref_grads.values())))
        diffs = {}
        for name, g in step_grads.items():
            if name not in ref_grads:
                continue
            b = ref_grads[name]
            diffs[name] = rel_diff(g, b, floor)
            above = b.abs() >= element_floor
            if g.shape == b.shape and diffs[name] <= tol.drift_rel:
                # an element the two runs disagree on by more than 1% is a near-zero sum decided by
                # rounding (near Adam's eps it steps by any fraction of lr: BERT-base as shipped, layer 0's
                # intermediate bias, 7% apart at 1e-8). A tensor whose gradient differs is reported instead.
                above = above & ((g - b).abs() <= 0.01 * b.abs())
            signal[name] = above if name not in signal else signal[name] & above
        by_step.append(diffs)
    param_diffs: dict[str, float] = {}
    noise = []
    for name, t in params.items():
        if name not in ref.params:
            continue
        b, mask = ref.params[name], signal.get(name)
        if t.shape != b.shape:
            problems.append(f"{name}: shape {tuple(t.shape)} vs reference {tuple(b.shape)}")
            param_diffs[name] = math.inf
        elif mask is None or bool(mask.all()):
            param_diffs[name] = rel_diff(t, b)
        elif bool(mask.any()):
            param_diffs[name] = rel_diff(t[mask], b[mask])
        else:
            noise.append(name)
    return VerifyReport(
        plan=describe(plan),
        steps=steps,
        losses=tuple(zip(losses, ref.losses)),
        grad_norms=tuple(zip(grad_norms, ref.grad_norms)),
        grad_diffs_by_step=tuple(by_step),
        param_diffs=param_diffs,
        noise=tuple(noise),
        problems=tuple(problems),
        tol=tol,
        precision=plan.train.precision,
    )


# ---------------------------------------------------------------------------------------------
# verify(): spawn the world on CPU
# ---------------------------------------------------------------------------------------------


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
