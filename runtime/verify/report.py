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
        gradients 2.7e-7), while a wrong split is off by far more.

        The tolerances do not grow with depth or steps: Adam's amplification of rounding depends on
        how many gradient elements sit near zero, not on a formula of the layer count (an OPT with
        100 layers at pp 2 x tp 2 reaches 1.5e-4 after one Adam step), and a looser drift tolerance
        would let through a split that goes wrong after the first step (an optimizer shard).
        Instead `verify` reruns an fp32 comparison whose first step agrees and whose later steps
        exceed (`VerifyReport.drift_only`) in fp64, and calls it OK when fp64 agrees."""
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
    # an fp32 report whose first step agrees but a later-step quantity exceeds its tolerance: the
    # same comparison rerun in float64 (`runtime.verify.world.verify` does it), which tells the rounding
    # Adam amplifies over depth and steps from a wrong split; or why that rerun could not run
    fp64: "VerifyReport | None" = None
    fp64_error: str | None = None

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
    def within_tolerance(self) -> bool:
        """Every measure of this run within its tolerance (the verdict without an fp64 rerun)."""
        return (
            not self.problems
            and self.max_loss_diff <= self.tol.loss_abs
            and self.first_step_grad_diff <= self.tol.grad_rel
            and all(d <= self._norm_tol for d in self.grad_norm_diffs)
            and self.later_grad_diff <= self.tol.drift_rel
            and self.max_param_diff <= self.tol.drift_rel
            and self.eval_loss_diff <= self.tol.loss_abs
            and self.eval_accuracy_diff <= 1
        )

    @property
    def _norm_tol(self) -> float:
        return max(self.tol.norm_rel, self.tol.drift_rel)

    @property
    def first_step_ok(self) -> bool:
        """The strict test of the split: both runs start from the same parameters, so step 1's
        loss, gradients and gradient norm differ by the summation order only, whatever the depth
        or the optimizer. A wrong split shows here, far above rounding."""
        return (
            not self.problems
            and (not self.losses or self.loss_diffs[0] <= self.tol.loss_abs)
            and self.first_step_grad_diff <= self.tol.grad_rel
            and (not self.grad_norms or self.grad_norm_diffs[0] <= self._norm_tol)
        )

    @property
    def drift_only(self) -> bool:
        """An fp32 comparison whose first step agrees and whose excess comes after an optimizer
        step only: Adam's near-sign update on near-zero gradients amplifies the first step's
        rounding, more so the deeper the model and the more steps. fp64 tells that from a wrong
        split (what `verify` reruns). Not with dropout kept: those runs differ by design."""
        return (
            self.precision == "fp32"
            and not self.within_tolerance
            and self.first_step_ok
            and not any(n.startswith("dropout kept") for n in self.notes)
        )

    @property
    def ok(self) -> bool:
        """Within tolerance; or an fp32 drift after the first step that the fp64 rerun shows
        to be rounding (fp64 agrees at its own, tight tolerances)."""
        if self.within_tolerance:
            return True
        return self.drift_only and self.fp64 is not None and self.fp64.ok

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
        if self.within_tolerance:
            lines.append("OK")
        elif any(n.startswith("dropout kept") for n in self.notes):
            lines.append("the differences are expected: dropout is on (--keep-dropout), and the two runs draw other masks")
            lines.append("FAILED")
        elif self.drift_only and (self.fp64 is not None or self.fp64_error is not None):
            lines += self._render_fp64(top)
        elif not self.problems and self.precision == "fp32":
            if self.drift_only:
                lines.append("step 1 agrees; only later steps exceed: Adam amplifies rounding after the first step "
                             "(more so the deeper the model), or a wrong split? run again with "
                             "--set train.precision=fp64 (ppdsl verify does so by itself): rounding then falls to ~1e-16, "
                             "a wrong split stays")
            else:
                lines.append("rounding that the model amplifies (gradients of nearly cancelling terms) or a wrong split? "
                             "run again with --set train.precision=fp64: rounding then falls to ~1e-16, a wrong split stays")
            lines.append("FAILED")
        else:
            lines.append("FAILED")
        return "\n".join(lines)

    def _fp32_drift_figure(self) -> str:
        """The fp32 measures after the first step that exceed their tolerance, e.g.
        `grad rel, later 1.536e-04 > 1e-04`."""
        tol = self.tol
        parts = [(f"loss |diff| {d:.3e} > {tol.loss_abs:.0e} (step {i + 2})") for i, d in enumerate(self.loss_diffs[1:])
                 if d > tol.loss_abs][:1]
        if self.later_grad_diff > tol.drift_rel:
            parts.append(f"grad rel, later {self.later_grad_diff:.3e} > {tol.drift_rel:.0e}")
        if self.max_param_diff > tol.drift_rel:
            parts.append(f"param rel {self.max_param_diff:.3e} > {tol.drift_rel:.0e}")
        worst_norm = max(self.grad_norm_diffs[1:], default=0.0)
        if worst_norm > self._norm_tol:
            parts.append(f"grad norm rel {worst_norm:.3e} > {self._norm_tol:.0e}")
        if self.eval_loss_diff > tol.loss_abs:
            parts.append(f"eval loss |diff| {self.eval_loss_diff:.3e} > {tol.loss_abs:.0e}")
        if self.eval_accuracy_diff > 1:
            parts.append(f"eval accuracy {self.eval_accuracy_diff:.0f} samples apart > 1")
        return ", ".join(parts)

    def _render_fp64(self, top: int) -> list[str]:
        """The verdict of an fp32 drift after the first step, decided by the fp64 rerun."""
        lines = [f"step 1 within tolerance{' (loss bitwise equal)' if self.first_loss_bitwise else ''}; "
                 f"after it fp32 exceeds: {self._fp32_drift_figure()}",
                 "rounding grows after an optimizer step (Adam's near-sign update on near-zero gradients, more so "
                 "over depth and steps); a split wrong only after step 1 (an optimizer shard) would look alike: "
                 "both runs again in float64 (precision = fp64) to tell which"]
        wide = self.fp64
        if wide is None:
            lines.append(f"fp64 rerun could not run: {self.fp64_error}")
            lines.append("FAILED (run again with --set train.precision=fp64 to tell rounding from a wrong split)")
            return lines
        t = wide.tol
        lines.append("")
        lines.append("fp64 rerun:")
        lines.append("  " + _verdict("loss |diff|", wide.max_loss_diff, t.loss_abs))
        lines.append("  " + _verdict("grad rel, step 1", wide.first_step_grad_diff, t.grad_rel))
        if wide.steps > 1:
            lines.append("  " + _verdict("grad rel, later", wide.later_grad_diff, t.drift_rel))
        lines.append("  " + _verdict("param rel", wide.max_param_diff, t.drift_rel))
        if wide.eval is not None:
            lines.append("  " + _verdict("eval loss |diff|", wide.eval_loss_diff, t.loss_abs))
        agreed = max(wide.max_loss_diff, wide.max_grad_diff_checked, wide.max_param_diff)
        if wide.ok:
            lines.append(f"OK (fp32 later-step drift {self._drift_value():.3e} is rounding: fp64 agrees to {agreed:.3e})")
            return lines
        lines += [f"  problem: {p}" for p in wide.problems]
        grads = wide.grad_diffs
        worst = sorted((n for n in grads if n not in wide.noise),
                       key=lambda n: -max(grads[n], wide.param_diffs.get(n, 0.0)))[:top]
        if worst:
            lines.append(f"  {'fp64: parameter (worst first)':<46}  {'grad rel':>10}  {'param rel':>10}")
            lines += [f"  {n:<46}  {grads[n]:>10.3e}  {wide.param_diffs.get(n, math.nan):>10.3e}" for n in worst]
        lines.append("FAILED (fp64 disagrees too: not rounding, the split computes something else)")
        return lines

    def _drift_value(self) -> float:
        """The fp32 figure the verdict names: the largest relative difference after step 1
        (gradients, parameters), else the largest later loss difference."""
        rel = max(self.later_grad_diff, self.max_param_diff)
        return rel if rel > self.tol.drift_rel else max(self.loss_diffs[1:] + (self.eval_loss_diff,), default=0.0)

    @property
    def max_grad_diff_checked(self) -> float:
        """The largest relative gradient difference over the steps, noise left out."""
        return max((d for step in self.grad_diffs_by_step for d in self._checked(step)), default=0.0)


def _verdict(what: str, value: float, tol: float) -> str:
    return f"{what:<16} max {value:.3e}  (tolerance {tol:.0e})  {'ok' if value <= tol else 'EXCEEDED'}"
