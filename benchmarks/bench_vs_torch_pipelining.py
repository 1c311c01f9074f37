"""ppdsl's pipeline executor against torch.distributed.pipelining on the same model and data.

A tiny GPT-like decoder (ppdsl.models.decoder: 8 layers, d = 128, 4 heads, seq 64, batch 16,
4 microbatches of 4) on 2 CPU processes with gloo and one thread each. For every schedule pair
(ours / torch's: 1f1b / Schedule1F1B, interleaved / ScheduleInterleaved1F1B, zbv /
ScheduleZBVZeroBubble) both run forward + backward of one batch, alternating step by step so
that machine noise hits both alike; the median step time of each and their ratio are printed.
Our side is built from a .ppspec text through check and lowering, like ``ppdsl run`` does.

    OMP_NUM_THREADS=1 python benchmarks/bench_vs_torch_pipelining.py [--steps 30] [--warmup 5] [--trace]

--trace: our side records every action as `ppdsl run --trace` does (runtime.train.trace), and each
rank's median measured pipeline bubble is printed.
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
import torch.nn.functional as F
from torch import nn

from _spawn import run_ranks

VOCAB, DIM, LAYERS, HEADS, SEQ, BATCH, MICRO = 512, 128, 8, 4, 64, 16, 4
PAIRS = (("1f1b", "Schedule1F1B"), ("interleaved", "ScheduleInterleaved1F1B"), ("zbv", "ScheduleZBVZeroBubble"))

SPEC = """ppspec 1
model bench {{
  source = python("ppdsl.models.decoder:build_decoder")
  config {{ vocab_size = {vocab}, dim = {dim}, n_layers = {layers}, n_heads = {heads}, max_seq_len = {seq} }}
}}
mesh {{
  tp = 1
  pp = 2
}}
pipeline {{
  style = {style}
  chunks = {chunks}
  microbatches = {micro}
  blocks = layers
  first = [tok_embeddings, pos_embeddings]
  last = [norm, output]
  split = {split}
}}
train {{
  global_batch = {batch}
  seq_len = {seq}
  steps = 1
  optimizer = sgd(lr = 0.1)
  data = synthetic(seed = 0)
}}
"""


def our_plan(style: str) -> Any:
    from ppdsl.dsl.check import check_text
    from ppdsl.lowering.lower import lower

    chunks = 1 if style == "1f1b" else 2
    per = LAYERS // (2 * chunks)
    split = "[" + ", ".join(f"{i * per}:{(i + 1) * per}" for i in range(2 * chunks)) + "]"
    text = SPEC.format(vocab=VOCAB, dim=DIM, layers=LAYERS, heads=HEADS, seq=SEQ, style=style, chunks=chunks,
                       micro=MICRO, split=split, batch=BATCH)
    result = check_text(text, f"<bench {style}>", world=2, model=True)
    if not result.ok:
        raise SystemExit(f"benchmark spec rejected: {[d.message for d in result.diagnostics]}")
    return lower(result.spec, 2, result.model_info)


# ---------------------------------------------------------------------------------------------
# torch.distributed.pipelining side: the same decoder cut into the same stages
# ---------------------------------------------------------------------------------------------


class TorchStage(nn.Module):
    """Blocks [start, stop) of the decoder, with the embeddings first / the head last."""

    def __init__(self, model: nn.Module, start: int, stop: int, first: bool, last: bool) -> None:
        super().__init__()
        self.tok_embeddings = model.tok_embeddings if first else None
        self.pos_embeddings = model.pos_embeddings if first else None
        self.layers = nn.ModuleList(model.layers[start:stop])
        self.norm = model.norm if last else None
        self.output = model.output if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok_embeddings is not None:
            positions = torch.arange(x.shape[1], device=x.device)
            x = self.tok_embeddings(x) + self.pos_embeddings(positions)
        for layer in self.layers:
            x = layer(x)
        if self.output is not None:
            x = self.output(self.norm(x))
        return x


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    shifted = F.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), shifted.view(-1), ignore_index=-100)


def torch_schedule(name: str, rank: int, ours: dict[str, nn.Parameter]) -> tuple[Any, list[nn.Module]]:
    """torch's schedule `name` on this rank, its stages holding copies of our parameters."""
    from torch.distributed import pipelining

    from ppdsl.models.decoder import build_decoder

    model = build_decoder(vocab_size=VOCAB, dim=DIM, n_layers=LAYERS, n_heads=HEADS, max_seq_len=SEQ)
    with torch.no_grad():
        for pname, p in ours.items():  # the same stages hold the same blocks: same init, same losses
            model.get_parameter(pname).copy_(p)
    chunks = 1 if name == "Schedule1F1B" else 2
    num_stages = 2 * chunks
    per = LAYERS // num_stages
    if name == "ScheduleZBVZeroBubble":
        mine = [rank, num_stages - 1 - rank]
    else:
        mine = [rank + 2 * c for c in range(chunks)]
    example = torch.zeros(BATCH // MICRO, SEQ, DIM)
    modules, stages = [], []
    for s in sorted(mine):
        module = TorchStage(model, s * per, (s + 1) * per, s == 0, s == num_stages - 1)
        modules.append(module)
        inp = torch.zeros(BATCH // MICRO, SEQ, dtype=torch.long) if s == 0 else example.clone().requires_grad_(True)
        out = torch.zeros(BATCH // MICRO, SEQ, VOCAB) if s == num_stages - 1 else example.clone().requires_grad_(True)
        stages.append(pipelining.PipelineStage(module, s, num_stages, torch.device("cpu"), input_args=(inp,), output_args=out))
    cls = getattr(pipelining, name)
    schedule = cls(stages[0], MICRO, loss_fn=lm_loss) if chunks == 1 else cls(stages, MICRO, loss_fn=lm_loss)
    return schedule, modules


def torch_step(schedule: Any, tokens: torch.Tensor, labels: torch.Tensor, holds_first: bool,
               holds_last: bool) -> float | None:
    losses: list[torch.Tensor] = []
    kwargs: dict[str, Any] = {}
    if holds_last:
        kwargs = {"target": labels, "losses": losses}
    if holds_first:
        schedule.step(tokens, **kwargs)
    else:
        schedule.step(**kwargs)
    return float(torch.stack(losses).detach().mean()) if losses else None


# ---------------------------------------------------------------------------------------------
# One worker: both executors, alternating
# ---------------------------------------------------------------------------------------------


def _measure(rank: int, world: int, steps: int, warmup: int, lookahead: int | None, trace: bool) -> list[Any]:
    from ppdsl.runtime.parallel.groups import build_process_groups, tie_pp_ranks_of
    from ppdsl.core.trace_format import pipeline_bubble
    from ppdsl.runtime.train.trace import Recorder
    from ppdsl.runtime.train.trainer import Trainer

    rows = []
    for ours, theirs in PAIRS:
        plan = our_plan(ours)
        groups = build_process_groups(plan.mesh, "cpu", tie_pp_ranks_of(plan.schedule.stage_ranks))
        trainer = Trainer(plan, groups, torch.device("cpu"), lookahead=lookahead)
        recorder = Recorder(rank, plan.mesh.coords(rank), torch.device("cpu")) if trace else None
        trainer.executor.recorder = recorder
        mbs = trainer.data.microbatches(0, 0, "cpu")
        # this rank's data: our Trainer reads the inputs only on the first stage's rank, the
        # labels only on the last's; torch's schedule wants the same there
        tokens = torch.cat([mb.input_ids for mb in mbs])
        labels = torch.cat([mb.labels for mb in mbs])
        schedule, modules = torch_schedule(theirs, rank, dict(trainer.named_params))
        holds_first = any(m.tok_embeddings is not None for m in modules)
        holds_last = any(m.output is not None for m in modules)
        t_ours, t_theirs, first = [], [], {}
        for i in range(warmup + steps):
            for side in ("ours", "theirs"):
                dist.barrier()
                start = time.perf_counter()
                if side == "ours":
                    for p in trainer.params:
                        p.grad = None
                    if recorder is not None:
                        recorder.begin_step(i + 1)
                    loss: float | None = trainer.executor.train_step(mbs)
                    if recorder is not None:
                        recorder.end_step()
                else:
                    for m in modules:
                        m.zero_grad(set_to_none=True)
                    loss = torch_step(schedule, tokens, labels, holds_first, holds_last)
                dist.barrier()
                elapsed = time.perf_counter() - start
                if i == 0 and loss is not None:
                    first[side] = loss
                if i >= warmup:
                    (t_ours if side == "ours" else t_theirs).append(elapsed)
        # --trace: this rank's median pipeline bubble over the measured steps (runtime.train.trace)
        bubble = None if recorder is None else statistics.median(pipeline_bubble(s) for s in recorder.steps[warmup:])
        rows.append((ours, theirs, t_ours, t_theirs, first, bubble))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--lookahead", type=int, default=None,
                        help="ppdsl: post receives this many actions ahead (default: the Trainer's, 2 on CPU)")
    parser.add_argument("--trace", action="store_true", help="ppdsl: record every action (runtime.train.trace)")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    world = 2
    got = run_ranks(world, _measure, (args.steps, args.warmup, args.lookahead, args.trace))
    if got is None:
        return 1
    print(f"decoder: {LAYERS} layers, d={DIM}, seq {SEQ}, batch {BATCH}, {MICRO} microbatches; "
          f"2 processes, gloo, 1 thread each; median of {args.steps} steps (after {args.warmup} warm-up)"
          + ("; ppdsl traced" if args.trace else ""))
    print(f"{'ppdsl':<12} {'torch.distributed.pipelining':<29} {'ppdsl s':>8} {'torch s':>8} {'ratio':>6} "
          f"{'paired':>7}  first-step loss (ppdsl / torch)")
    for r0, r1 in zip(got[0], got[1]):
        ours, theirs, a0, b0, first0, bubble0 = r0
        _, _, a1, b1, first1, bubble1 = r1
        # a step ends when the slower rank ends; "paired": median of ours / theirs per
        # alternation, robust to load that drifts during the run
        t_ours = [max(x, y) for x, y in zip(a0, a1)]
        t_theirs = [max(x, y) for x, y in zip(b0, b1)]
        ours_t, theirs_t = statistics.median(t_ours), statistics.median(t_theirs)
        paired = statistics.median(x / y for x, y in zip(t_ours, t_theirs))
        first = {**first0, **first1}
        print(f"{ours:<12} {theirs:<29} {ours_t:>8.4f} {theirs_t:>8.4f} {ours_t / theirs_t:>6.3f} {paired:>7.3f}  "
              f"{first.get('ours', float('nan')):.7f} / {first.get('theirs', float('nan')):.7f}"
              + ("" if bubble0 is None else f"  ppdsl bubble rank 0 / 1: {bubble0:.3f} / {bubble1:.3f}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
