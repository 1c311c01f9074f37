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

The comparison itself; running the two (`verify_in_process`, `verify`) is `runtime.verify.world`,
the full tensors it compares `runtime.verify.gather`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from ppdsl.lowering.plan import Plan

from ppdsl.runtime.verify.reference import ReferenceRun
from ppdsl.runtime.verify.report import Tolerances, VerifyReport


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


def _global_norm(tensors: Any) -> float:
    return math.sqrt(sum(torch.linalg.vector_norm(t.double()).item() ** 2 for t in tensors))


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
