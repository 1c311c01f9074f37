"""Step time of the model's own forward against a registered family's hand-written stages.

The same HF class (LlamaForCausalLM by default: 4 layers, hidden 256, 8 heads, seq 128, batch 8
in 4 microbatches) at pp 2 x tp 2 with sequence parallelism, 1F1B, on 4 spawned CPU processes
(gloo, one thread each): once as its family runs it, once through its own forward (the plan check
makes with the family registry emptied). Both train step after step, alternating so that machine
noise hits both alike; the median step time of each and the median of their per-step ratio are
printed. Issue 30 asks that the own forward be no slower than the family path before a family is
deleted.

    OMP_NUM_THREADS=1 python benchmarks/bench_own_vs_family.py [--steps 20] [--warmup 3] [--no-sp]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from _spawn import run_ranks

SPEC = """ppspec 1
model bench {{
  source = hf("LlamaForCausalLM")
  config {{ vocab_size = 1024, hidden_size = 256, intermediate_size = 688, num_hidden_layers = 4,
           num_attention_heads = 8, num_key_value_heads = 4, tie_word_embeddings = false }}
}}
mesh {{ pp = 2, tp = 2 }}
tensor_parallel {{
  model.layers[*].self_attn.q_proj : column
  model.layers[*].self_attn.k_proj : column
  model.layers[*].self_attn.v_proj : column
  model.layers[*].self_attn.o_proj : row
  model.layers[*].mlp.gate_proj : column
  model.layers[*].mlp.up_proj : column
  model.layers[*].mlp.down_proj : row
  sequence_parallel = {sp}
}}
pipeline {{ style = 1f1b, microbatches = 4 }}
train {{ global_batch = 8, seq_len = 128, steps = 1, optimizer = sgd(lr = 0.01), data = synthetic(seed = 0) }}
"""


def plans(sp: bool) -> tuple[Any, Any]:
    """(the family's plan, the own forward's plan) of the same spec."""
    import ppdsl.core.families as families
    from ppdsl.dsl.check import check_text
    from ppdsl.lowering.lower import lower

    def one() -> Any:
        result = check_text(SPEC.format(sp="true" if sp else "false"), "<bench>", world=4, model=True)
        if not result.ok:
            raise SystemExit(f"benchmark spec rejected: {[d.message for d in result.diagnostics if d.is_error]}")
        return lower(result.spec, 4, result.model_info)

    family = one()
    families._BY_HF_CLASS.clear()  # every HF class now runs its own forward
    own = one()
    assert family.model.family != "own" and own.model.family == "own", (family.model.family, own.model.family)
    return family, own


def _measure(rank: int, world: int, pair: tuple[Any, Any], steps: int, warmup: int) -> dict[str, list[float]]:
    from ppdsl.runtime.parallel.groups import build_process_groups, tie_pp_ranks_of
    from ppdsl.runtime.train.trainer import Trainer

    sides = {}
    for name, plan in zip(("family", "own"), pair):
        groups = build_process_groups(plan.mesh, "cpu", tie_pp_ranks_of(plan.schedule.stage_ranks))
        trainer = Trainer(plan, groups, torch.device("cpu"))
        sides[name] = (trainer, trainer.data.microbatches(0, 0, "cpu"))
    times: dict[str, list[float]] = {name: [] for name in sides}
    for i in range(warmup + steps):
        for name, (trainer, mbs) in sides.items():
            dist.barrier()
            start = time.perf_counter()
            for p in trainer.params:
                p.grad = None
            trainer.executor.train_step(mbs)
            dist.barrier()
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--no-sp", action="store_true", help="tensor parallelism without sequence parallelism")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    pair = plans(not args.no_sp)
    got = run_ranks(4, _measure, (pair, args.steps, args.warmup))
    if got is None:
        return 1
    family = [max(got[r]["family"][i] for r in got) for i in range(args.steps)]  # a step ends with its slowest rank
    own = [max(got[r]["own"][i] for r in got) for i in range(args.steps)]
    print(f"LlamaForCausalLM, pp 2 x tp 2{'' if args.no_sp else ' + sequence parallelism'}, 1F1B, 4 CPU processes; "
          f"median of {args.steps} steps after {args.warmup} warm-up")
    print(f"family stages {statistics.median(family):.4f} s | own forward {statistics.median(own):.4f} s | "
          f"own / family per step (median) {statistics.median(o / f for o, f in zip(own, family)):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
