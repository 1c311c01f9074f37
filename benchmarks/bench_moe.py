"""A small Mixtral at world 4 (dp 4, pp = tp = 1, AdamW): experts replicated (ep = 1) against
expert parallelism (ep = 2: each rank holds 4 of the 8 experts of every layer). Per rank:

- held: bytes of the parameters, gradients and optimizer state the rank holds (exact), and the
  experts' share of them;
- peak RSS of the training steps (``VmHWM`` reset after the build, minus the resident set
  before the model is built; workers run with ``MALLOC_MMAP_THRESHOLD_=65536`` so RSS follows
  the live bytes, as in bench_fsdp_memory.py);
- step time: the median of the steps after the first;
- all-to-all bytes per step this rank sent to other ranks, counted at the collectives the
  expert layers call (the hidden states there and back with their gradients, the expert ids;
  the token counts left out), against `ppdsl plan`'s prediction (`ep/step`, routing taken as
  uniform).

    OMP_NUM_THREADS=1 python benchmarks/bench_moe.py [--steps 4] [--seq-len 128]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _spawn import run_ranks  # noqa: E402
from bench_fsdp_memory import _held_bytes, _peak_rss_bytes, _reset_peak_rss, _rss_bytes  # noqa: E402

MIB = 2**20
SPEC = """ppspec 1
model mixtral {{
  source = hf("MixtralForCausalLM")
  config {{
    vocab_size = 1024, hidden_size = 256, intermediate_size = 512, num_hidden_layers = 4
    num_attention_heads = 8, num_key_value_heads = 4, num_local_experts = 8, num_experts_per_tok = 2
    max_position_embeddings = 512
  }}
}}
mesh {{ ep = {ep} }}
pipeline {{ microbatches = 2 }}
train {{ global_batch = 8, seq_len = {seq_len}, steps = {steps}, optimizer = adamw(lr = 1e-3),
        data = synthetic(seed = 0) }}
"""


def _checked(ep: int, seq_len: int, steps: int) -> Any:
    from ppdsl.dsl.check import check_file

    path = Path(tempfile.mkdtemp()) / f"moe_ep{ep}.ppspec"
    path.write_text(SPEC.format(ep=ep, seq_len=seq_len, steps=steps), encoding="utf-8")
    result = check_file(str(path), world=4)
    assert result.ok, [f"{d.code} {d.message}" for d in result.diagnostics]
    return result


def predicted_ep_bytes(ep: int, seq_len: int, steps: int) -> list[int]:
    from ppdsl.lowering.lower import lower
    from ppdsl.views.report import plan_report

    r = _checked(ep, seq_len, steps)
    return [row.ep_bytes for row in plan_report(lower(r.spec, 4, r.model_info), r.model_info).rows]


class _Counter:
    """Bytes this rank sends to the other ranks of each all-to-all (forward and backward)."""

    def __init__(self) -> None:
        self.sent = 0

    def install(self) -> None:
        import torch.distributed as dist
        import torch.distributed._functional_collectives as fc

        counter, plain, autograd = self, dist.all_to_all_single, fc.all_to_all_single_autograd

        def others(sizes: Any, group: Any, row_bytes: int) -> int:
            me = dist.get_group_rank(group, dist.get_rank())
            return sum(n for i, n in enumerate(sizes) if i != me) * row_bytes

        def counted_autograd(t: torch.Tensor, out_sizes: Any, in_sizes: Any, group: Any, *a: Any) -> torch.Tensor:
            row = t[0].numel() * t.element_size() if t.numel() else t.shape[-1] * t.element_size()
            counter.sent += others(in_sizes, group, row) + others(out_sizes, group, row)  # forward + its backward
            return autograd(t, out_sizes, in_sizes, group, *a)

        def counted_plain(out: torch.Tensor, inp: torch.Tensor, out_sizes: Any = None, in_sizes: Any = None,
                          group: Any = None, *a: Any, **kw: Any) -> Any:
            if in_sizes is not None:  # the expert ids (the counts go with no sizes)
                counter.sent += others(in_sizes, group, inp.element_size())
            return plain(out, inp, out_sizes, in_sizes, group, *a, **kw)

        fc.all_to_all_single_autograd = counted_autograd
        dist.all_to_all_single = counted_plain


def measure(rank: int, world: int, ep: int, seq_len: int, steps: int) -> dict[str, Any]:
    from ppdsl.lowering.lower import lower
    from ppdsl.runtime.parallel.expert import expert_parameters
    from ppdsl.runtime.parallel.groups import build_process_groups, tie_pp_ranks_of
    from ppdsl.runtime.train.trainer import Trainer

    r = _checked(ep, seq_len, steps)
    plan = lower(r.spec, 4, r.model_info)
    groups = build_process_groups(plan.mesh, "cpu", tie_pp_ranks_of(plan.schedule.stage_ranks))
    counter = _Counter()
    counter.install()
    before = _rss_bytes()
    trainer = Trainer(plan, groups, torch.device("cpu"))
    _reset_peak_rss()
    times, sent = [], []
    for i in range(steps):
        counter.sent = 0
        t0 = time.perf_counter()
        trainer.step(i)
        times.append(time.perf_counter() - t0)
        sent.append(counter.sent)
    experts = sum(p.numel() * p.element_size() for p in expert_parameters(trainer.stages))
    if not experts:  # ep = 1: the experts are plain parameters
        experts = sum(p.numel() * p.element_size() for n, p in trainer.named_params if ".experts." in n)
    return {"held": _held_bytes(trainer), "experts": experts, "step_peak_rss": _peak_rss_bytes() - before,
            "step_s": statistics.median(times[1:] or times), "a2a": statistics.median(sent)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    args = ap.parse_args(argv)
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    print(f"Mixtral (hidden 256, 8 experts x 4 layers, top-2) at world 4 = dp 4, AdamW, global batch 8 x "
          f"seq_len {args.seq_len}; per rank")
    print(f"{'mode':<22} {'held MiB':>9} {'experts':>8} {'peak RSS':>9} {'step ms':>8} {'a2a/step':>10} "
          f"{'predicted':>10} {'meas/pred':>9}")
    for ep in (1, 2):
        predicted = predicted_ep_bytes(ep, args.seq_len, args.steps)
        got = run_ranks(4, measure, (ep, args.seq_len, args.steps))
        if got is None:
            return 1
        for rank in sorted(got):
            g = got[rank]
            held = sum(g["held"].values())
            ratio = f"{g['a2a'] / predicted[rank]:.3f}" if predicted[rank] else "-"
            print(f"{f'ep = {ep} rank {rank}':<22} {held / MIB:>9.1f} {g['experts'] / MIB:>8.1f} "
                  f"{g['step_peak_rss'] / MIB:>9.1f} {g['step_s'] * 1e3:>8.1f} {g['a2a'] / MIB:>9.2f}M "
                  f"{predicted[rank] / MIB:>9.2f}M {ratio:>9}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
