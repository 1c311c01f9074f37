"""Dropout under tensor parallelism (``runtime.parallel.rng``).

In process: the replicated stream's seed separates data-parallel replicas and pipeline ranks;
a tensor-parallel region draws per-tp-rank masks from the replicated state and gives that
state back.

Distributed (gloo, 4 ranks = tp 2 x pp 2, hard timeout): with dropout 0.1 on the generic
decoder, GPT-2 and BERT, after a few steps every parameter that is replicated over tp (norms,
embeddings, row-parallel biases) is bitwise equal on both tp ranks; the losses are finite and
differ from the dropout-0 run; activation checkpointing gives the same run bit for bit; and a
run resumed from a rank state continues the uninterrupted one bit for bit.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from _tiny_models import tiny_plan
from dist_harness import run_distributed

from ppdsl.lowering.plan import Plan
from ppdsl.runtime.parallel.rng import TensorParallelRng, replicated_seed, seed_replicated_stream

# ---------------------------------------------------------------------------------------------
# In process
# ---------------------------------------------------------------------------------------------


def test_replicated_seed_separates_replicas_and_pipeline_ranks() -> None:
    seeds = {(dp, pp): replicated_seed(0, dp, pp) for dp in range(4) for pp in range(4)}
    assert len(set(seeds.values())) == len(seeds)
    assert replicated_seed(0, 1, 2) == seeds[(1, 2)]  # a pure function: every tp rank agrees
    assert replicated_seed(1, 0, 0) != seeds[(0, 0)]
    assert all(0 <= s < 2**63 for s in seeds.values())


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


def _region_masks(tp_rank: int, device: str) -> tuple[torch.Tensor, ...]:
    """From one replicated state: a mask inside a region, one after leaving it early, one from
    a second region, and one after its exit."""
    seed_replicated_stream(5, 0, 0)
    rng = TensorParallelRng(tp_rank, device)
    x = torch.ones(64, 64, device=device)
    with rng.region():
        assert rng.inside
        inside = torch.nn.functional.dropout(x, 0.5)
        rng.leave()  # the row-parallel layer's input
        assert not rng.inside
        after_leave = torch.nn.functional.dropout(x, 0.5)
    with rng.region():
        second = torch.nn.functional.dropout(x, 0.5)
    after = torch.nn.functional.dropout(x, 0.5)
    assert rng.entered == 2
    return inside, after_leave, second, after


@pytest.mark.parametrize("device", DEVICES)
def test_region_masks_are_per_tp_rank_and_replicated_state_comes_back(device: str) -> None:
    in0, leave0, second0, after0 = _region_masks(0, device)
    in1, leave1, second1, after1 = _region_masks(1, device)
    assert not torch.equal(in0, in1)  # each tp rank its own heads' masks
    assert not torch.equal(second0, second1)
    assert not torch.equal(in0, second0)  # a new seed for every region
    assert torch.equal(leave0, leave1)  # back on the replicated stream: equal masks
    assert torch.equal(after0, after1)
    again = _region_masks(0, device)  # a function of the replicated state (recomputation, resume)
    assert all(torch.equal(a, b) for a, b in zip(again, (in0, leave0, second0, after0)))


def test_region_does_not_nest() -> None:
    seed_replicated_stream(0, 0, 0)
    rng = TensorParallelRng(1)
    before = torch.get_rng_state()
    with rng.region():
        with rng.region():
            pass
        assert rng.inside  # the inner exit does not end the outer region
    assert not rng.inside and rng.entered == 1
    assert not torch.equal(before, torch.get_rng_state())  # the entry's draw advanced the stream


# ---------------------------------------------------------------------------------------------
# Distributed: tp 2 x pp 2 on gloo
# ---------------------------------------------------------------------------------------------

STEPS = 3
TIMEOUT_S = 360  # hard limit of the whole spawned run (4 processes on a loaded 2-core machine)

_DROPOUT_KEYS = {
    "generic": ("dropout",),
    "gpt2": ("resid_pdrop", "embd_pdrop", "attn_pdrop"),
    "bert": ("hidden_dropout_prob", "attention_probs_dropout_prob"),
}


def plan_for(family: str, style: str, dropout: float, ac: bool = False, steps: int = STEPS) -> Plan:
    return tiny_plan(family, style, pp=2, tp=2, microbatches=4, num_layers=4, steps=steps,
                     activation_checkpointing=ac, config={key: dropout for key in _DROPOUT_KEYS[family]})


CASES: dict[str, dict[str, Any]] = {
    "generic": dict(family="generic", style="1f1b", dropout=0.1),
    "generic-nodrop": dict(family="generic", style="1f1b", dropout=0.0),
    "generic-ac": dict(family="generic", style="1f1b", dropout=0.1, ac=True),
    "generic-zbv": dict(family="generic", style="zbv", dropout=0.1),
    "generic-zbv-ac": dict(family="generic", style="zbv", dropout=0.1, ac=True),
    "gpt2": dict(family="gpt2", style="1f1b", dropout=0.1),
    "gpt2-nodrop": dict(family="gpt2", style="1f1b", dropout=0.0),
    "bert": dict(family="bert", style="1f1b", dropout=0.1),  # a region without a row layer
}
RESUME_AT = 2  # the resume case: generic, 1f1b, dropout 0.1, STEPS + 1 steps, reloaded here


def _replicated(trainer: Any) -> dict[str, np.ndarray]:
    """This rank's parameters that are replicated over tp, by name (as numpy arrays: a tensor
    sent through the result queue would be shared by a file descriptor, gone once the child
    exits)."""
    from ppdsl.runtime.stage.params import is_tp_sharded, owner_modules

    owners: dict[int, Any] = {}
    for stage in trainer.stages:
        owners.update(owner_modules(stage))
    out = {}
    for name, p in trainer.named_params:
        owner, local = owners[id(p)]
        if not is_tp_sharded(p, owner, local, trainer.plan.mesh.tp):
            out[name] = p.detach().numpy().copy()
    return out


def dropout_worker(rank: int, world: int, cases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    from ppdsl.runtime.checkpoint.store import Checkpointer
    from ppdsl.runtime.parallel.groups import build_process_groups, tie_pp_ranks_of
    from ppdsl.runtime.train.trainer import Trainer

    def trainer_for(plan: Plan) -> Trainer:
        groups = build_process_groups(plan.mesh, "cpu", tie_pp_ranks_of(plan.schedule.stage_ranks))
        return Trainer(plan, groups, torch.device("cpu"))

    out: dict[str, Any] = {}
    coords = None
    for key, case in cases.items():
        trainer = trainer_for(plan_for(**case))
        coords = trainer.groups.coords
        losses = [trainer.step(i)[0] for i in range(STEPS)]
        rng = getattr(trainer, "tp_rng", None)
        out[key] = dict(losses=losses, params=_replicated(trainer),
                        regions=None if rng is None else rng.entered)

    # resume: a checkpoint saved after RESUME_AT steps, loaded into a fresh trainer (same mesh:
    # the RNG states come back too)
    plan = plan_for("generic", "1f1b", 0.1, steps=STEPS + 1)
    straight = trainer_for(plan)
    root = Path(tempfile.gettempdir()) / f"ppdsl-dropout-resume-{os.getppid()}"  # shared by the spawned ranks
    checkpointer = Checkpointer(root, plan, dist.get_rank())
    saved = None
    for i in range(plan.train.steps):
        if i == RESUME_AT:
            saved = checkpointer.save(straight, i)
        straight.step(i)
    resumed = trainer_for(plan)
    start = checkpointer.load(resumed, saved)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(root, ignore_errors=True)
    assert start == RESUME_AT
    for i in range(start, plan.train.steps):
        resumed.step(i)
    a, b = dict(straight.named_params), dict(resumed.named_params)
    out["resume"] = dict(equal=all(torch.equal(a[n], b[n]) for n in a) and a.keys() == b.keys(),
                         params=_replicated(resumed))
    out["coords"] = coords
    return out


_result: list[Any] = []


def _results() -> list[dict[str, Any]]:
    """The spawned run, once per session (a failure too: every test reports it, none reruns it)."""
    if not _result:
        try:
            _result.append(run_distributed(dropout_worker, 4, CASES, timeout=TIMEOUT_S))
        except AssertionError as exc:
            _result.append(exc)
    if isinstance(_result[0], AssertionError):
        raise _result[0]
    return _result[0]


def _tp_pairs(results: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(tp rank 0, tp rank 1) results of each pipeline rank."""
    by = {(r["coords"]["pp"], r["coords"]["tp"]): r for r in results}
    assert sorted(by) == [(0, 0), (0, 1), (1, 0), (1, 1)], sorted(by)
    return [(by[(pp, 0)], by[(pp, 1)]) for pp in (0, 1)]


@pytest.mark.distributed
@pytest.mark.parametrize("key", [*CASES, "resume"])
def test_replicated_parameters_stay_identical_over_tp(key: str) -> None:
    for r0, r1 in _tp_pairs(_results()):
        p0, p1 = r0[key]["params"], r1[key]["params"]
        assert p0.keys() == p1.keys() and p0, (sorted(p0), sorted(p1))
        differ = {n: float(np.abs(p0[n] - p1[n]).max()) for n in p0 if not np.array_equal(p0[n], p1[n])}
        assert not differ, f"{key}: replicated parameters differ between tp ranks: {differ}"


@pytest.mark.distributed
@pytest.mark.parametrize("family", ["generic", "gpt2"])
def test_dropout_is_active_and_losses_finite(family: str) -> None:
    results = _results()
    with_dropout = results[0][family]["losses"]
    without = results[0][f"{family}-nodrop"]["losses"]
    assert all(math.isfinite(x) for x in with_dropout + without), (with_dropout, without)
    assert all(a != b for a, b in zip(with_dropout, without)), (with_dropout, without)
    assert all(r[family]["losses"] == with_dropout for r in results)  # every rank reports the mean
    for r in results:  # every rank ran its attention / MLP under its tp rank's own stream
        assert r[family]["regions"] and r[family]["regions"] > 0, r[family]


@pytest.mark.distributed
@pytest.mark.parametrize("plain,checkpointed", [("generic", "generic-ac"), ("generic-zbv", "generic-zbv-ac")])
def test_activation_checkpointing_recomputes_the_same_masks(plain: str, checkpointed: str) -> None:
    for r in _results():
        assert r[checkpointed]["losses"] == r[plain]["losses"]
        p, q = r[plain]["params"], r[checkpointed]["params"]
        assert all(np.array_equal(p[n], q[n]) for n in p)


@pytest.mark.distributed
def test_resume_continues_the_uninterrupted_run() -> None:
    for r in _results():
        assert r["resume"]["equal"], r["coords"]
