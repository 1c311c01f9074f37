"""Evaluation on held-out data (`train.eval`): forward-only pipeline passes, mean loss, and
accuracy (classification) or perplexity (causal LM).

Every evaluation reads the same `eval.batches` global batches of ``plan.train.eval.data``
(batch k of the eval source is what step k of a training source would be: a pure function of
(seed, k, dp rank)), split into the training's microbatches and run through the plan's schedule
forward only (``PipelineExecutor.eval_sums``). The loss is the mean over every microbatch of
every replica and batch; accuracy counts the argmax class of each sample against its label;
perplexity is exp(mean loss), the per-token perplexity when every sequence has the same number
of predicted tokens (token streams: `seq_len - 1`).

Evaluation never changes training: the stages run in eval mode (no dropout) and the random
streams (torch's CPU and CUDA generators, Python's `random`) are restored afterwards, since the
tensor-parallel dropout regions draw from them on entry even in eval mode. Eval data is its own
source, so the training batches stay what they were.
"""

from __future__ import annotations

import contextlib
import math
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from ppdsl.core.task_loss import at_least_fp32
from ppdsl.lowering.plan import EvalPlan, Plan

from ppdsl.runtime.data.batch import DataSource, num_labels_of
from ppdsl.runtime.data.source import make_data
from ppdsl.runtime.parallel.fsdp import reshard

if TYPE_CHECKING:
    from ppdsl.runtime.train.trainer import Trainer


@dataclass(frozen=True)
class EvalResult:
    step: int  # training steps done when it ran
    loss: float  # mean over every microbatch of every batch and replica
    batches: int
    samples: int
    accuracy: float | None = None  # classification: correct / samples
    perplexity: float | None = None  # causal LM: exp(loss)
    time_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        """The metrics.jsonl line (``"kind": "eval"``; training lines are ``"kind": "train"``)."""
        out: dict[str, Any] = {"kind": "eval", "step": self.step, "eval_loss": _finite(self.loss)}
        if self.accuracy is not None:
            out["eval_accuracy"] = self.accuracy
        if self.perplexity is not None:
            out["eval_perplexity"] = _finite(self.perplexity)
        out.update(eval_batches=self.batches, eval_samples=self.samples, eval_time_s=self.time_s)
        return out


def _finite(v: float) -> float | None:
    return v if math.isfinite(v) else None


def perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 700 else math.inf


def wants_accuracy(data: DataSource, plan: Plan) -> bool:
    """Accuracy for single-label classification (more than one class; one label is regression)."""
    return data.task == "classification" and num_labels_of(plan.model) > 1


def due(evaluation: EvalPlan, step: int, last: int) -> bool:
    """Whether an evaluation runs after training step `step` (1-based) of a run ending at `last`."""
    return step == last or (evaluation.every > 0 and step % evaluation.every == 0)


# ---------------------------------------------------------------------------------------------
# Scores of one microbatch
# ---------------------------------------------------------------------------------------------


def predicted_classes(stage: Any, logits: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim; with a head split over tp (``stage.head_partition``) each rank
    takes the argmax of its real entries and the ranks agree on the largest (the lowest index on
    a tie, as torch.argmax). Collective over the stage's tp group in that case."""
    logits = at_least_fp32(logits.detach())
    part = getattr(stage, "head_partition", None)
    if part is None:
        return logits.argmax(-1)
    local = logits[..., : part.end - part.start]
    if local.shape[-1] == 0:
        best = torch.full(local.shape[:-1], -math.inf, dtype=logits.dtype, device=logits.device)
        index = torch.zeros(local.shape[:-1], dtype=torch.long, device=logits.device)
    else:
        best, index = local.max(-1)
        index = index + part.start
    tp = dist.get_world_size(stage.tp_group)
    bests = [torch.empty_like(best) for _ in range(tp)]
    indices = [torch.empty_like(index) for _ in range(tp)]
    dist.all_gather(bests, best.contiguous(), group=stage.tp_group)
    dist.all_gather(indices, index.contiguous(), group=stage.tp_group)
    winner = torch.stack(bests).argmax(0, keepdim=True)  # the first (lowest-rank) maximum
    return torch.stack(indices).gather(0, winner).squeeze(0)


def correct_predictions(stage: Any, logits: torch.Tensor, mb: Any) -> torch.Tensor:
    """How many samples of the microbatch are classified right (a float scalar)."""
    return (predicted_classes(stage, logits) == mb.labels.view(-1)).sum().float()


# ---------------------------------------------------------------------------------------------
# Isolation from training
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def isolated(modules: Sequence[nn.Module], device: torch.device) -> Iterator[None]:
    """Eval mode for `modules`, and every random stream put back afterwards."""
    modes = [m.training for m in modules]
    py_state = random.getstate()
    devices = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):
            for m in modules:
                m.train(False)
            yield
    finally:
        for m, mode in zip(modules, modes):
            m.train(mode)
        random.setstate(py_state)


# ---------------------------------------------------------------------------------------------
# The parallel evaluator and the single-process reference
# ---------------------------------------------------------------------------------------------


class Evaluator:
    """Evaluates a trainer's stages on the plan's held-out data (collective: every rank calls)."""

    def __init__(self, trainer: Trainer) -> None:
        plan = trainer.plan
        assert plan.train.eval is not None
        self.trainer = trainer
        self.plan = plan
        self.evaluation = plan.train.eval
        self.data = make_data(plan, pp_rank=trainer.groups.pp_rank, data=self.evaluation.data,
                              cp_rank=trainer.groups.cp_rank)
        self.accuracy = wants_accuracy(self.data, plan)
        # read (and check) the eval data now: a short or broken file fails before training
        self.data.batch(0, trainer.groups.dp_rank)

    def due(self, step: int, last: int) -> bool:
        return due(self.evaluation, step, last)

    def run(self, step: int) -> EvalResult:
        t = self.trainer
        t0 = time.perf_counter()
        score = correct_predictions if self.accuracy else None
        losses, correct = [], 0.0
        t.refresh_stage_copies()
        with isolated(t.stages, t.device):
            for k in range(self.evaluation.batches):
                mbs = self.data.microbatches(k, t.groups.dp_rank, t.device)
                loss, right = t.executor.eval_sums(mbs, score)
                losses.append(loss)
                correct += right
        reshard(t.fsdp_roots)  # ZeRO-3: forward-only passes leave the parameters gathered
        return summarize(self.plan, self.data, step, losses, correct, time.perf_counter() - t0, self.accuracy)


def summarize(plan: Plan, data: DataSource, step: int, losses: Sequence[float], correct: float, time_s: float,
              accuracy: bool) -> EvalResult:
    loss = math.fsum(losses) / len(losses)
    samples = len(losses) * plan.train.global_batch
    return EvalResult(
        step=step, loss=loss, batches=len(losses), samples=samples,
        accuracy=correct / samples if accuracy else None,
        perplexity=perplexity(loss) if data.task == "causal_lm" else None,
        time_s=time_s,
    )


def reference_evaluate(plan: Plan, model: nn.Module, device: torch.device | str = "cpu",
                       step: int = 0) -> EvalResult:
    """The same evaluation on the full model in one process: every replica's microbatches of
    every eval batch, losses averaged in the pipeline's order."""
    from ppdsl.runtime.pipeline.step_loss import sum_losses
    from ppdsl.runtime.train.optim import autocast_factory

    assert plan.train.eval is not None
    device = torch.device(device)
    data = make_data(plan, data=plan.train.eval.data)
    accuracy = wants_accuracy(data, plan)
    autocast = autocast_factory(plan.train.precision, device)
    dp, m = plan.mesh.dp, plan.schedule.microbatches
    losses, correct = [], 0.0
    t0 = time.perf_counter()
    with isolated([model], device), torch.no_grad():
        for k in range(plan.train.eval.batches):
            replicas = []
            for dp_rank in range(dp):
                mb_losses = []
                for mb in data.microbatches(k, dp_rank, device):
                    with autocast():
                        loss, logits = _reference_outputs(plan, model, mb, accuracy)
                    mb_losses.append(at_least_fp32(loss.detach()))
                    if accuracy:
                        correct += float((at_least_fp32(logits).argmax(-1) == mb.labels.view(-1)).sum())
                replicas.append(sum_losses(mb_losses) / m)
            losses.append(float(sum_losses(replicas)) / dp)
    return summarize(plan, data, step, losses, correct, time.perf_counter() - t0, accuracy)


def _reference_outputs(plan: Plan, model: nn.Module, mb: Any, logits: bool) -> tuple[torch.Tensor, Any]:
    from ppdsl.runtime.verify.reference_loss import reference_loss, reference_outputs

    if not logits:
        return reference_loss(plan, model, mb), None
    return reference_outputs(plan, model, mb)  # classification runs transformers models


__all__ = [
    "EvalResult", "Evaluator", "correct_predictions", "due", "isolated", "perplexity", "predicted_classes",
    "reference_evaluate", "summarize", "wants_accuracy",
]
