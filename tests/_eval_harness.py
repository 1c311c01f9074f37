"""Distributed checks of held-out evaluation (runtime/train/evaluate.py), run by tests/test_evaluate.py
in one spawned world of 4 gloo processes (start-up dominates, so every check shares it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from _tiny_models import HIDDEN, tiny_plan
from ppdsl.lowering.plan import Plan
from ppdsl.core.schedules import STYLES

EVAL_SEED = 77


def eval_entry(every: int = 0, batches: int = 2) -> str:
    """The train block's eval entry: held-out synthetic data of its own seed."""
    return f"eval {{ data = synthetic(seed = {EVAL_SEED}), every = {every}, batches = {batches} }}"


def _dropout_plan(steps: int, *evaluation: str) -> Plan:
    """The generic decoder at tp = 2 x pp = 2 with dropout on (tp regions drawing)."""
    return tiny_plan("generic", "1f1b", pp=2, tp=2, microbatches=4, num_layers=4, steps=steps,
                     config={"dropout": 0.1}, train_entries=evaluation)


class Recorder:
    """What Trainer.train tells a MetricsLogger, kept."""

    def __init__(self) -> None:
        self.steps: list[Any] = []
        self.evals: list[Any] = []
        self.skipped_before = 0  # a fresh run: no skipped steps recorded before it

    def log(self, record: Any) -> None:
        self.steps.append(record)

    def log_eval(self, result: Any) -> None:
        self.evals.append(result)

    def status(self, step: int, eta_s: float | None) -> None:
        pass

    def note(self, message: str) -> None:
        pass

    def enable_tensorboard(self, log_dir: Any = None) -> None:
        pass


def eval_checks_worker(rank: int, world: int, tmp: str) -> dict[str, Any]:
    from ppdsl.runtime.checkpoint.store import Checkpointer, step_name
    from ppdsl.runtime.train.evaluate import Evaluator, reference_evaluate
    from ppdsl.runtime.parallel.groups import build_process_groups, tie_pp_ranks_of
    from ppdsl.runtime.stage.build import build_reference_model
    from ppdsl.runtime.train.trainer import Trainer
    from ppdsl.runtime.train.loop import run_steps
    from ppdsl.runtime.verify.world import verify_in_process

    cpu = torch.device("cpu")
    out: dict[str, Any] = {}

    def groups_of(plan: Plan) -> Any:
        return build_process_groups(plan.mesh, "cpu", tie_pp_ranks_of(plan.schedule.stage_ranks))

    # every schedule style, dp = 2 x pp = 2: the forward-only pass equals one process's
    for style in STYLES:
        plan = tiny_plan("generic", style, pp=2, dp=2, microbatches=4, num_layers=4, steps=0,
                         train_entries=[eval_entry()])
        result = Evaluator(Trainer(plan, groups_of(plan), cpu)).run(0)
        if rank == 0:
            model = build_reference_model(plan.model, cpu, plan.train.seed)
            out[f"style-{style}"] = (result, reference_evaluate(plan, model))

    # tp = 2 x pp = 2 after a training step, through verify: GPT-2 (tied, vocab-split head,
    # zbv) and BERT classification with its classifier split over tp (accuracy across shards)
    gpt2 = tiny_plan("gpt2", "zbv", pp=2, tp=2, microbatches=4, num_layers=4, steps=1, train_entries=[eval_entry()])
    out["verify-gpt2"] = verify_in_process(gpt2, groups_of(gpt2), cpu, 1)
    # MFU's FLOPs per token: the parallel count (tp shards, pipeline stages, tied head) equals
    # the full model's non-embedding parameters
    flops = Trainer(gpt2, groups_of(gpt2), cpu).model_flops_per_token()
    if rank == 0:
        from ppdsl.runtime.train.metrics import flops_per_token

        model = build_reference_model(gpt2.model, cpu, gpt2.train.seed)
        params = {id(p): p.numel() for m in model.modules() if not isinstance(m, torch.nn.Embedding)
                  for p in m.parameters(recurse=False)}
        out["flops"] = (flops, flops_per_token(sum(params.values()), gpt2.num_blocks, HIDDEN, gpt2.train.seq_len))
    bert = tiny_plan("bert", "1f1b", pp=2, tp=2, microbatches=4, microbatch_size=2, num_layers=4, steps=1,
                     tensor_parallel=["classifier : column"], train_entries=[eval_entry(batches=3)])
    out["verify-bert"] = verify_in_process(bert, groups_of(bert), cpu, 1)

    # training losses are the same with and without evaluation (dropout on, tp regions drawing)
    runs = {}
    for name, plan in (("without", _dropout_plan(3)), ("with", _dropout_plan(3, eval_entry(every=1)))):
        rec = Recorder()
        run_steps(Trainer(plan, groups_of(plan), cpu), rec)  # type: ignore[arg-type]
        runs[name] = ([r.loss for r in rec.steps], [e.loss for e in rec.evals])
    out["rng"] = runs

    # checkpoint / resume with evaluation on: 2 steps, save, a new trainer loads and runs 2 more
    plan = _dropout_plan(4, eval_entry(every=2))
    whole = Recorder()
    run_steps(Trainer(plan, groups_of(plan), cpu), whole)  # type: ignore[arg-type]
    ckpt = Checkpointer(Path(tmp) / "ckpt", plan, rank)
    first, second = Recorder(), Recorder()
    run_steps(Trainer(plan, groups_of(plan), cpu), first, steps=2, checkpointer=ckpt)  # type: ignore[arg-type]
    resumed = Trainer(plan, groups_of(plan), cpu)
    start = ckpt.load(resumed, Path(tmp) / "ckpt" / step_name(2))
    run_steps(resumed, second, start=start)  # type: ignore[arg-type]
    out["resume"] = {
        "whole": ([r.loss for r in whole.steps], [(e.step, e.loss) for e in whole.evals]),
        "split": ([r.loss for r in first.steps + second.steps], [(e.step, e.loss) for e in first.evals + second.evals]),
        "start": start,
    }
    return out


__all__ = ["Recorder", "eval_checks_worker", "eval_entry"]
