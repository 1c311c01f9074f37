"""Data-parallel synchronisation bytes per rank and step: plain all-reduce (zero = 0), ZeRO-1 as
torch's ZeroRedundancyOptimizer did it (all-reduce of the gradients, then each parameter
broadcast from its owner after the sharded step), and ppdsl's ZeRO-1 (reduce-scatter of the
gradients to their owners, all-gather of the updated parameters).

Every collective the trainer issues during ``sync_gradients`` and ``optimizer_step`` is
counted (the process-group calls are wrapped): the tensor bytes it is given, and the bytes a
rank sends under the ring algorithm (all-reduce 2 (n-1)/n B, reduce-scatter (n-1)/n B_in,
all-gather (n-1)/n B_out, broadcast B from the root). The trainer, model and data are
``specs/tiny_cpu.ppspec``'s at dp = 2 (pp = tp = 1), 2 CPU processes with gloo.

    OMP_NUM_THREADS=1 python benchmarks/bench_zero_sync_bytes.py [--steps 2]
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "specs" / "tiny_cpu.ppspec"
WRAPPED = ("all_reduce", "reduce_scatter_tensor", "reduce_scatter_single", "all_gather_into_tensor",
           "all_gather_single", "broadcast", "_broadcast_coalesced")


def _plan(zero: int) -> Any:
    from ppdsl.dsl.check import check_file
    from ppdsl.lowering.lower import lower

    r = check_file(str(SPEC), world=2, overrides=["mesh.tp=1", "mesh.pp=1", "mesh.dp=2", f"train.zero={zero}"], model=False)
    assert r.ok, r.diagnostics
    return lower(r.spec, 2, r.model_info)


class Counter:
    """Wraps torch.distributed's collectives; counts while `on`."""

    def __init__(self) -> None:
        self.on = False
        self.given: dict[str, int] = defaultdict(int)
        self.sent: dict[str, float] = defaultdict(float)
        self.n = dist.get_world_size()
        for name in WRAPPED:
            if hasattr(dist, name):
                setattr(dist, name, self._wrap(name, getattr(dist, name)))

    def _wrap(self, name: str, fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            if self.on:
                self._count(name, args, kwargs)
            return fn(*args, **kwargs)

        return call

    def _count(self, name: str, args: Any, kwargs: dict[str, Any]) -> None:
        n = self.n
        names = {"all_reduce": ("tensor",), "broadcast": ("tensor", "src")}.get(name, ("output", "input"))
        args = (*args, *[kwargs[k] for k in names[len(args):] if k in kwargs])
        if name == "all_reduce":
            b = args[0].numel() * args[0].element_size()
            self.sent[name] += 2 * (n - 1) / n * b
        elif name.startswith("reduce_scatter"):
            b = args[1].numel() * args[1].element_size()
            self.sent[name] += (n - 1) / n * b
        elif name.startswith("all_gather"):
            b = args[0].numel() * args[0].element_size()
            self.sent[name] += (n - 1) / n * b
        elif name == "broadcast":
            b = args[0].numel() * args[0].element_size()
            self.sent[name] += b if args[1] == dist.get_rank() else 0
        else:
            return
        self.given[name] += b


def worker(rank: int, world: int, steps: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533", RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from ppdsl.runtime.parallel.groups import build_process_groups, tie_pp_ranks_of
    from ppdsl.runtime.train.optim import param_groups
    from ppdsl.runtime.train.trainer import Trainer

    counter = Counter()
    rows = []
    for label, zero, zero_redundancy in (("zero = 0: all-reduce", 0, False),
                                         ("ZeRO-1 as ZeroRedundancyOptimizer (before)", 0, True),
                                         ("ZeRO-1 over reduce-scatter (now)", 1, False)):
        plan = _plan(zero)
        groups = build_process_groups(plan.mesh, "cpu", tie_pp_ranks_of(plan.schedule.stage_ranks))
        t = Trainer(plan, groups, torch.device("cpu"))
        if zero_redundancy:
            opt = plan.train.optimizer
            t.optimizer = ZeroRedundancyOptimizer(param_groups(t.params, opt.weight_decay), optimizer_class=torch.optim.AdamW,
                                                  process_group=groups.dp, lr=opt.lr, betas=opt.betas, eps=opt.eps)
            t.scheduler = torch.optim.lr_scheduler.LambdaLR(t.optimizer, lambda i: 1.0)
        counter.given.clear()
        counter.sent.clear()
        numel = sum(p.numel() for p in t.params)
        for i in range(steps):
            loss = t.forward_backward(i)
            counter.on = True
            t.sync_gradients()
            t.optimizer_step()
            counter.on = False
        rows.append((label, numel, {k: v // steps for k, v in counter.given.items()},
                     {k: v / steps for k, v in counter.sent.items()}, loss))
    if rank == 0:
        for label, numel, given, sent, loss in rows:
            parts = ", ".join(f"{k} of {v:,} B sends {sent[k]:,.0f} B" for k, v in sorted(given.items()))
            print(f"{label}: {numel:,} parameters ({numel * 4:,} B fp32); per rank and step: {parts}; "
                  f"total sent {sum(sent.values()):,.0f} B (last loss {loss:.6f})")
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args(argv)
    mp.spawn(worker, args=(2, args.steps), nprocs=2, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
