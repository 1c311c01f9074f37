"""Memory per rank at dp = 2: replicated (zero = 0), ZeRO-1 (optimizer state sharded), ZeRO-3
(FSDP2: parameters, gradients and optimizer state sharded) and ZeRO-3 with
reshard_after_forward (each block's gathered weights freed after its forward and backward).

The model is ``specs/decoder.ppspec``'s (vocab 8192, dim 512, 16 layers: about 59 M parameters)
at dp = 2, pp = tp = 1, with AdamW; the batch is small (``--seq-len``, 2 microbatches of 1 per
replica) so that the model's state, not the activations, decides the peak. Each mode runs in
its own 2 spawned CPU processes (gloo), ``--steps`` training steps. Per rank:

- at rest (after the last optimizer step): bytes of the parameters, gradients and optimizer
  state this rank holds, summed over its local tensors (a DTensor's local shard); exact;
- peak RSS: ``resource.getrusage(RUSAGE_SELF).ru_maxrss`` at the end minus the resident set
  before the model is built (torch imported, process group up): the whole run, building
  included; and the peak of the training steps alone (``VmHWM`` of /proc/self/status, reset
  through /proc/self/clear_refs after the build), minus the same baseline. On CPU torch has no
  allocator statistics. glibc would keep freed tensor memory in its heap (so RSS would not come
  down when FSDP frees the unsharded parameters and gradients after the reduce-scatter): the
  workers run with ``MALLOC_MMAP_THRESHOLD_=65536`` (unless set), so every allocation of 64 KiB
  or more is its own mapping, returned on free, and RSS follows the live bytes.

    OMP_NUM_THREADS=1 python benchmarks/bench_fsdp_memory.py [--steps 2] [--seq-len 64]
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _spawn import run_ranks  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "specs" / "decoder.ppspec"
MIB = 2**20


def _plan(zero: int, seq_len: int, reshard: bool = False) -> Any:
    from ppdsl.dsl.check import check_file
    from ppdsl.lowering.lower import lower

    overrides = ["mesh.tp=1", "mesh.pp=1", "mesh.dp=2", f"train.zero={zero}", "train.global_batch=4",
                 "pipeline.microbatches=2", f"train.seq_len={seq_len}",
                 f"train.reshard_after_forward={str(reshard).lower()}"]
    r = check_file(str(SPEC), world=2, overrides=overrides, model=False)
    assert r.ok, [d.message for d in r.diagnostics]
    return lower(r.spec, 2, r.model_info)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _held_bytes(trainer: Any) -> dict[str, int]:
    from ppdsl.runtime.parallel.fsdp import local

    def size(t: torch.Tensor) -> int:
        t = local(t)
        return t.numel() * t.element_size()

    state = 0
    for p in trainer.params:
        for v in trainer.optimizer_state(p).values():
            if isinstance(v, torch.Tensor):
                state += size(v)
    return {
        "params": sum(size(p) for p in trainer.params),
        "grads": sum(size(p.grad) for p in trainer.params if p.grad is not None),
        "optimizer": state,
    }


def measure(rank: int, world: int, zero: int, steps: int, seq_len: int, reshard: bool = False) -> dict[str, Any]:
    from ppdsl.runtime.parallel.groups import build_process_groups, tie_pp_ranks_of
    from ppdsl.runtime.train.trainer import Trainer

    plan = _plan(zero, seq_len, reshard)
    groups = build_process_groups(plan.mesh, "cpu", tie_pp_ranks_of(plan.schedule.stage_ranks))
    before = _rss_bytes()
    trainer = Trainer(plan, groups, torch.device("cpu"))
    _reset_peak_rss()
    losses = [trainer.step(i)[0] for i in range(steps)]
    step_peak = _peak_rss_bytes()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {"held": _held_bytes(trainer), "peak_rss": peak - before, "step_peak_rss": step_peak - before,
            "losses": losses, "numel": sum(p.numel() for p in trainer.params)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=64)
    args = ap.parse_args(argv)
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # read by glibc in the spawned workers
    print(f"{SPEC.name} at dp = 2 (pp = tp = 1), AdamW, {args.steps} step(s), seq_len {args.seq_len}; MiB per rank "
          f"(MALLOC_MMAP_THRESHOLD_={os.environ['MALLOC_MMAP_THRESHOLD_']})")
    print(f"{'mode':<36} {'params':>8} {'grads':>8} {'adam':>8} {'at rest':>8} {'peak RSS':>9} {'in steps':>9}  losses")
    for zero, reshard, label in ((0, False, "zero = 0 (replicated)"), (1, False, "zero = 1 (optimizer)"),
                                 (3, False, "zero = 3 (FSDP2)"), (3, True, "zero = 3 + reshard_after_forward")):
        got = run_ranks(2, measure, (zero, args.steps, args.seq_len, reshard))
        if got is None:
            return 1
        for rank in sorted(got):
            r = got[rank]
            h = r["held"]
            total = sum(h.values())
            losses = ", ".join(f"{x:.6f}" for x in r["losses"])
            print(f"{label + f' rank {rank}':<36} {h['params'] / MIB:>8.1f} {h['grads'] / MIB:>8.1f} "
                  f"{h['optimizer'] / MIB:>8.1f} {total / MIB:>8.1f} {r['peak_rss'] / MIB:>9.1f} "
                  f"{r['step_peak_rss'] / MIB:>9.1f}  {losses}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
