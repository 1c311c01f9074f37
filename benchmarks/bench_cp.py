"""A long-sequence Llama, one sequence per step: whole on one rank (cp = 1, world 1) against split
over two (cp = 2, world 2: each rank 2 of the 4 head-tail chunks). Per rank:

- activations: the bytes the forward saves for backward (each tensor storage counted once,
  through ``torch.autograd.graph.saved_tensors_hooks``), with one microbatch and no pipeline
  their peak: what context parallelism divides. The model is built with eager attention, whose
  saved softmax is (heads, queries, keys): S x S at cp 1, S / cp x S at cp 2;
- peak RSS of the training steps (``VmHWM`` reset after the build, minus the resident set
  before it; ``MALLOC_MMAP_THRESHOLD_=65536`` so RSS follows the live bytes);
- the key/value all-gather bytes per step against `ppdsl plan`'s prediction (`cp/step`);
- step time: the median of the steps after the first.

    OMP_NUM_THREADS=1 python benchmarks/bench_cp.py [--seq-len 2048] [--steps 3]
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
from bench_fsdp_memory import _peak_rss_bytes, _reset_peak_rss, _rss_bytes  # noqa: E402

MIB = 2**20
SPEC = """ppspec 1
model llama {{
  source = hf("LlamaForCausalLM")
  config {{
    vocab_size = 1024, hidden_size = 256, intermediate_size = 688, num_hidden_layers = 4
    num_attention_heads = 8, num_key_value_heads = 4, max_position_embeddings = {seq_len}
  }}
}}
mesh {{ cp = {cp} }}
train {{ global_batch = 1, seq_len = {seq_len}, steps = {steps}, optimizer = adamw(lr = 1e-3),
        data = synthetic(seed = 0) }}
"""


def _checked(cp: int, seq_len: int, steps: int) -> Any:
    from ppdsl.dsl.check import check_file

    path = Path(tempfile.mkdtemp()) / f"llama_cp{cp}.ppspec"
    path.write_text(SPEC.format(cp=cp, seq_len=seq_len, steps=steps), encoding="utf-8")
    result = check_file(str(path), world=cp)
    assert result.ok, [f"{d.code} {d.message}" for d in result.diagnostics]
    return result


def predicted_cp_bytes(cp: int, seq_len: int, steps: int) -> list[int]:
    from ppdsl.lowering.lower import lower
    from ppdsl.views.report import plan_report

    r = _checked(cp, seq_len, steps)
    return [row.cp_bytes for row in plan_report(lower(r.spec, cp, r.model_info), r.model_info).rows]


class _Saved:
    """Bytes of the distinct storages autograd saves for backward while installed."""

    def __init__(self) -> None:
        self.storages: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        self.storages[s.data_ptr()] = s.nbytes()
        return t

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())


class _Gathered:
    """Bytes this rank sends in the key/value all-gathers (forward) and their all-reduces (backward)."""

    def __init__(self) -> None:
        self.sent = 0

    def install(self) -> None:
        import torch.distributed as dist

        from ppdsl.runtime.parallel import context as cpm

        counter, gather, reduce = self, dist.all_gather, dist.all_reduce

        def all_gather(parts: Any, t: torch.Tensor, group: Any = None, **kw: Any) -> Any:
            n = dist.get_world_size(group)
            counter.sent += t.numel() * t.element_size() * (n - 1)  # what a ring sends: (n - 1) / n of the whole
            return gather(parts, t, group=group, **kw)

        def all_reduce(t: torch.Tensor, *a: Any, group: Any = None, **kw: Any) -> Any:
            n = dist.get_world_size(group)
            counter.sent += 2 * t.numel() * t.element_size() * (n - 1) // n
            return reduce(t, *a, group=group, **kw)

        cpm.dist = type("dist", (), {"all_gather": staticmethod(all_gather), "all_reduce": staticmethod(all_reduce)})


def measure(rank: int, world: int, seq_len: int, steps: int) -> dict[str, Any]:
    from ppdsl.lowering.lower import lower
    from ppdsl.runtime.parallel.groups import build_process_groups, tie_pp_ranks_of
    from ppdsl.runtime.train.trainer import Trainer

    r = _checked(world, seq_len, steps)
    plan = lower(r.spec, world, r.model_info)
    groups = build_process_groups(plan.mesh, "cpu", tie_pp_ranks_of(plan.schedule.stage_ranks))
    counter = _Gathered()
    if world > 1:
        counter.install()
    before = _rss_bytes()
    trainer = Trainer(plan, groups, torch.device("cpu"))
    _reset_peak_rss()
    times, sent, saved = [], [], []
    for i in range(steps):
        counter.sent = 0
        hooks = _Saved()
        t0 = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(hooks.pack, lambda t: t):
            trainer.step(i)
        times.append(time.perf_counter() - t0)
        sent.append(counter.sent)
        saved.append(hooks.bytes)
    return {"saved": max(saved), "step_peak_rss": _peak_rss_bytes() - before,
            "step_s": statistics.median(times[1:] or times), "gathered": statistics.median(sent)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seq-len", type=int, default=2048)
    args = ap.parse_args(argv)
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    print(f"Llama (hidden 256, 4 layers, 8 heads / 4 kv heads, eager attention), one sequence of "
          f"{args.seq_len} tokens per step, AdamW; per rank")
    print(f"{'mode':<18} {'activations':>12} {'peak RSS':>9} {'step ms':>8} {'kv/step':>9} {'predicted':>10}")
    for cp in (1, 2):
        predicted = predicted_cp_bytes(cp, args.seq_len, args.steps)
        got = run_ranks(cp, measure, (args.seq_len, args.steps))
        if got is None:
            return 1
        for rank in sorted(got):
            g = got[rank]
            print(f"{f'cp = {cp} rank {rank}':<18} {g['saved'] / MIB:>11.1f}M {g['step_peak_rss'] / MIB:>8.1f}M "
                  f"{g['step_s'] * 1e3:>8.1f} {g['gathered'] / MIB:>8.2f}M {predicted[rank] / MIB:>9.2f}M")
    return 0


if __name__ == "__main__":
    sys.exit(main())
