"""What `verify` holds the parallel run to (`Tolerances`) and how it reports the differences
(`VerifyReport`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ppdsl.lowering.plan import Plan


@dataclass(frozen=True)
class Tolerances:
    loss_abs: float = 1e-6  # every step
    grad_rel: float = 1e-5  # first step, where both models start from the same parameters
    # after an optimizer step: parameter updates and the later steps' gradients
    drift_rel: float = 1e-5
    # a gradient smaller than this fraction of the global gradient norm is rounding noise
    # (BERT's key bias: softmax is invariant to it, its true gradient is 0)
    noise_floor: float = 1e-6
    # the global gradient norm: one fp32 sum of squares over millions of elements, added up in
    # another order by the parallel run (per shard, per stage) than by clip_grad_norm_; both
    # are off the exact (float64) value by up to ~1e-5 (GPT-2 124M at tp 2: 3.8e-5 apart)
    norm_rel: float = 1e-4

    @classmethod
    def for_plan(cls, plan: Plan) -> "Tolerances":
        """Adam's step lr * m / sqrt(v) is nearly the sign of each gradient element, so an
        element whose gradient is at rounding level can step either way, and the trajectories
        drift apart by more than the gradients differ: after Adam steps parameters and
        gradients are compared at 1e-4, after SGD steps at 1e-5; with bf16 / fp16 autocast,
        whose rounding noise is 2^16 times coarser, at 1e-3. With autocast and tp > 1 each rank
        rounds its partial matmul results to bf16 before they are summed, which one process
        never does: the runs then agree to bf16 precision only (tiny_cpu at tp 2: loss 1.4e-4,
        first-step gradients 6.8e-3, 1e-2 after a step), so loss, gradients and parameters are
        held to 1e-3 absolute / 3e-2 relative (a coarse check; fp32 is the tight one).

        fp64 is the tightest: rounding falls to ~1e-16, so what a model's conditioning amplifies
        in fp32 (DiffLlama's lambda gradients, differences of nearly equal exponentials: 4e-3
        apart in fp32 at tp 2, 0 in fp64) vanishes and only the split's errors remain. Many
        models still compute parts in float32 (an RMSNorm's variance, a softmax), where a 1e-16
        difference of their input can flip a float32 rounding: loss 1e-7 and gradients 1e-6 leave
        room for that (Gemma 4's per-head norms: gradients 2e-7; Qwen3 at tp 2: loss 1.5e-9,
        gradients 2.7e-7), while a wrong split is off by far more."""
        if plan.train.precision == "fp64":
            return cls(loss_abs=1e-7, grad_rel=1e-6, drift_rel=1e-6, noise_floor=1e-9, norm_rel=1e-9)
        if plan.train.precision != "fp32" and plan.mesh.tp > 1:
            return cls(loss_abs=1e-3, grad_rel=3e-2, drift_rel=3e-2)
        if plan.train.precision != "fp32":
            return cls(drift_rel=1e-3)
        return cls(drift_rel=1e-5 if plan.train.optimizer.name == "sgd" else 1e-4)


@dataclass(frozen=True)
class VerifyReport:
    plan: str  # one-line description
    steps: int
    losses: tuple[tuple[float, float], ...]  # per step: (parallel, reference)
    # per step: the global gradient norm before clipping (parallel: every rank's part, each
    # replicated or tied tensor once; reference: clip_grad_norm_)
    grad_norms: tuple[tuple[float, float], ...]
    grad_diffs_by_step: tuple[dict[str, float], ...]  # per step: parameter -> relative difference
    param_diffs: dict[str, float]  # parameter -> relative difference after the last step
    noise: tuple[str, ...] = ()  # parameters whose true gradient is 0 (rounding noise): not checked
    problems: tuple[str, ...] = ()  # missing or extra parameters, shape mismatches
    tol: Tolerances = field(default_factory=Tolerances)
    precision: str = "fp32"  # the plan's train.precision: both runs computed in it
    # train.eval: the held-out evaluation after the last step, (parallel, reference)
    eval: tuple[Any, Any] | None = None

    @property
    def eval_loss_diff(self) -> float:
        return 0.0 if self.eval is None else abs(self.eval[0].loss - self.eval[1].loss)

    @property
    def eval_accuracy_diff(self) -> float:
        """In samples: a prediction may flip between two classes whose logits differ by rounding."""
        if self.eval is None or self.eval[1].accuracy is None:
            return 0.0
        return abs(self.eval[0].accuracy - self.eval[1].accuracy) * self.eval[1].samples
    notes: tuple[str, ...] = ()  # what the comparison changed (dropout off), one line each

    @property
    def loss_diffs(self) -> tuple[float, ...]:
        return tuple(abs(p - r) for p, r in self.losses)

    @property
    def first_loss_bitwise(self) -> bool:
        return bool(self.losses) and self.losses[0][0] == self.losses[0][1]

    @property
    def grad_diffs(self) -> dict[str, float]:
        """parameter -> largest relative gradient difference over the steps."""
        out: dict[str, float] = {}
        for step in self.grad_diffs_by_step:
            for n, d in step.items():
                out[n] = max(out.get(n, 0.0), d)
        return out

    @property
    def max_loss_diff(self) -> float:
        return max(self.loss_diffs, default=0.0)

    @property
    def max_grad_diff(self) -> float:
        return max(self.grad_diffs.values(), default=0.0)

    def _checked(self, step: dict[str, float]) -> list[float]:
        return [d for n, d in step.items() if n not in self.noise]

    @property
    def first_step_grad_diff(self) -> float:
        return max(self._checked(self.grad_diffs_by_step[0]), default=0.0) if self.grad_diffs_by_step else 0.0

    @property
    def grad_norm_diffs(self) -> tuple[float, ...]:
        return tuple(abs(p - r) / r if r > 0 else abs(p - r) for p, r in self.grad_norms)

    @property
    def later_grad_diff(self) -> float:
        return max((d for step in self.grad_diffs_by_step[1:] for d in self._checked(step)), default=0.0)

    @property
    def max_param_diff(self) -> float:
        return max((d for n, d in self.param_diffs.items() if n not in self.noise), default=0.0)

    @property
    def ok(self) -> bool:
        return (
            not self.problems
            and self.max_loss_diff <= self.tol.loss_abs
            and self.first_step_grad_diff <= self.tol.grad_rel
            and all(d <= max(self.tol.norm_rel, self.tol.drift_rel) for d in self.grad_norm_diffs)
            and self.later_grad_diff <= self.tol.drift_rel
            and self.max_param_diff <= self.tol.drift_rel
            and self.eval_loss_diff <= self.tol.loss_abs
            and self.eval_accuracy_diff <= 1
        )

    def render(self, top: int = 8) -> str:
        lines = [f"verify {self.plan}: {self.steps} step(s) against a single-process reference", *self.notes]
        if self.precision == "fp64":
            lines.append("both runs in float64 (precision = fp64): rounding falls to ~1e-16 (~1e-7 where the model computes "
                         "in float32 inside, such as an RMSNorm's variance)")
        lines.append("")
        lines.append(f"{'step':>4}  {'parallel loss':>16}  {'reference loss':>16}  {'|diff|':>10}  "
                     f"{'max grad rel':>12}  {'grad norm rel':>13}")
        for i, (p, r) in enumerate(self.losses):
            g = max(self._checked(self.grad_diffs_by_step[i]), default=0.0) if i < len(self.grad_diffs_by_step) else math.nan
            n = self.grad_norm_diffs[i] if i < len(self.grad_norms) else math.nan
            lines.append(f"{i + 1:>4}  {p:>16.10f}  {r:>16.10f}  {abs(p - r):>10.3e}  {g:>12.3e}  {n:>13.3e}")
        lines.append("")
        grads = self.grad_diffs
        worst = sorted(grads, key=lambda n: (n in self.noise, -max(grads[n], self.param_diffs.get(n, 0.0))))[:top]
        lines.append(f"{'parameter (worst first)':<48}  {'grad rel':>10}  {'param rel':>10}")
        for name in worst:
            p = "noise" if name in self.noise else f"{self.param_diffs.get(name, math.nan):.3e}"
            lines.append(f"{name:<48}  {grads[name]:>10.3e}  {p:>10}")
        lines.append("")
        lines.append(_verdict("loss |diff|", self.max_loss_diff, self.tol.loss_abs))
        lines.append(_verdict("grad rel, step 1", self.first_step_grad_diff, self.tol.grad_rel))
        if self.steps > 1:
            lines.append(_verdict("grad rel, later", self.later_grad_diff, self.tol.drift_rel))
        lines.append(_verdict("param rel", self.max_param_diff, self.tol.drift_rel))
        lines.append(f"first-step loss bitwise equal: {'yes' if self.first_loss_bitwise else 'no'}")
        if self.eval is not None:
            lines.append(_verdict("eval loss |diff|", self.eval_loss_diff, self.tol.loss_abs)
                         + f"  ({self.eval[0].loss:.10f} vs {self.eval[1].loss:.10f})")
            if self.eval[1].accuracy is not None:
                lines.append(f"eval accuracy    {self.eval[0].accuracy:.4f} vs {self.eval[1].accuracy:.4f} "
                             f"({self.eval_accuracy_diff:.0f} sample(s) apart, at most 1)")
        if self.noise:
            lines.append(f"{len(self.noise)} parameter(s) with rounding-noise gradients (true gradient 0), "
                         "their gradients and values not checked: "
                         + ", ".join(self.noise[:3]) + (" ..." if len(self.noise) > 3 else ""))
        lines += [f"problem: {p}" for p in self.problems]
        if not self.ok and any(n.startswith("dropout kept") for n in self.notes):
            lines.append("the differences are expected: dropout is on (--keep-dropout), and the two runs draw other masks")
        elif not self.ok and not self.problems and self.precision == "fp32":
            lines.append("rounding that the model amplifies (gradients of nearly cancelling terms) or a wrong split? "
                         "run again with --set train.precision=fp64: rounding then falls to ~1e-16, a wrong split stays")
        lines.append("OK" if self.ok else "FAILED")
        return "\n".join(lines)


def _verdict(what: str, value: float, tol: float) -> str:
    return f"{what:<16} max {value:.3e}  (tolerance {tol:.0e})  {'ok' if value <= tol else 'EXCEEDED'}"
