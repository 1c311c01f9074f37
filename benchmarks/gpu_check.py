"""A prepared check for a machine with CUDA (issue 13 item 4). NOT YET RUN ON CUDA.

1. World 1, bf16: a real-size decoder (ppdsl.models.decoder, ~0.5 B parameters by default)
   trained for a few steps through `ppdsl run --nproc 1` and through a plain torch loop on
   the same model (same init), the same batches (ppdsl's synthetic data) and the same optimizer;
   reported: each one's median step time and the ratio ppdsl / plain torch (1.00 = no overhead).
2. With more than one GPU: the same spec at world N = min(GPUs, 4) with tp and pp (`ppdsl run
   --nproc N`), its per-step losses against the world-1 run's (the promise: the numbers one
   process would get; bf16 needs a loose tolerance). `ppdsl verify` itself runs on CPU with
   gloo, so it is run on a small layer count (it proves the same plan bit for bit on CPU).

    python benchmarks/gpu_check.py                 # on a CUDA machine
    OMP_NUM_THREADS=1 python benchmarks/gpu_check.py --tiny [--cpu-world 4]   # dry run on CPU: tiny model, fp32

Exit 0 when every part ran (and, on several GPUs, the losses agree), 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
REAL = dict(vocab_size=32000, dim=2048, n_layers=8, n_heads=16, max_seq_len=1024)
TINY = dict(vocab_size=128, dim=64, n_layers=4, n_heads=4, max_seq_len=64)


def spec_text(config: dict, seq_len: int, global_batch: int, steps: int, precision: str, tp: int = 1, pp: int = 1) -> str:
    cfg = ", ".join(f"{k} = {v}" for k, v in config.items())
    return f"""ppspec 1
model decoder {{
  source = python("ppdsl.models.decoder:build_decoder")
  config {{ {cfg} }}
}}
mesh {{ tp = {tp}, pp = {pp} }}
tensor_parallel {{
  tok_embeddings            : vocab
  layers[*].attention.wq    : column
  layers[*].attention.wk    : column
  layers[*].attention.wv    : column
  layers[*].attention.wo    : row
  layers[*].feed_forward.w1 : column
  layers[*].feed_forward.w2 : row
  output                    : column
}}
pipeline {{
  style = 1f1b
  microbatches = {max(1, pp)}
  blocks = layers
  first = [tok_embeddings, pos_embeddings]
  last = [norm, output]
}}
train {{
  global_batch = {global_batch}
  seq_len = {seq_len}
  steps = {steps}
  log_every = 1
  precision = {precision}
  optimizer = adamw(lr = 1e-4, weight_decay = 0.0)
  data = synthetic(seed = 0)
}}
"""


def ppdsl_run(spec: Path, nproc: int, out: Path) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    cmd = [sys.executable, "-m", "ppdsl", "run", str(spec), "--nproc", str(nproc), "--out", str(out), "--overwrite"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]


def plain_loop(spec: Path, steps: int, device: torch.device) -> list[float]:
    """The same model, batches and optimizer as `ppdsl run` at world 1, in a loop of plain torch."""
    from ppdsl.dsl.check import check_file
    from ppdsl.lowering.lower import lower
    from ppdsl.runtime.data.source import make_data
    from ppdsl.runtime.train.optim import autocast_factory, build_optimizer
    from ppdsl.runtime.stage.build import build_reference_model
    from ppdsl.runtime.verify.reference_loss import reference_loss

    result = check_file(spec, world=1)
    assert result.ok, [d.message for d in result.diagnostics]
    plan = lower(result.spec, 1, result.model_info)
    model = build_reference_model(plan.model, device, plan.train.seed)
    model.train()
    optimizer = build_optimizer([p for p in model.parameters() if p.requires_grad], plan.train.optimizer)
    autocast = autocast_factory(plan.train.precision, device)
    data = make_data(plan)
    times = []
    for step in range(steps):
        mbs = data.microbatches(step, 0, device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        for mb in mbs:
            with autocast():
                loss = reference_loss(plan, model, mb) / len(mbs)
            loss.backward()
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return times


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="dry run on CPU: the tiny decoder in fp32")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--cpu-world", type=int, default=0,
                    help="with --tiny: also dry-run the several-device part with this many CPU processes")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.tiny
    if not cuda and not args.tiny:
        print("no CUDA device: run with --tiny for the CPU dry run", file=sys.stderr)
        return 1
    device = torch.device("cuda" if cuda else "cpu")
    config = TINY if args.tiny else REAL
    seq_len = args.seq_len or (32 if args.tiny else 1024)
    precision = "fp32" if args.tiny else "bf16"
    warm = 2
    ok = True
    with tempfile.TemporaryDirectory(prefix="ppdsl-gpu-check-") as tmp:
        spec = Path(tmp) / "decoder.ppspec"
        spec.write_text(spec_text(config, seq_len, args.global_batch, args.steps, precision), encoding="utf-8")
        print(f"device {device} ({torch.cuda.get_device_name(0) if cuda else 'CPU dry run'}), {precision}, "
              f"decoder {config}, seq_len {seq_len}, global batch {args.global_batch}, {args.steps} steps")
        records = ppdsl_run(spec, 1, Path(tmp) / "w1")
        ours = statistics.median(r["step_time_s"] for r in records[warm:])
        plain = statistics.median(plain_loop(spec, args.steps, device)[warm:])
        print(f"world 1: ppdsl run {ours * 1e3:.1f} ms/step, plain torch loop {plain * 1e3:.1f} ms/step, "
              f"ratio {ours / plain:.3f}")
        gpus = torch.cuda.device_count() if cuda else args.cpu_world
        if gpus > 1:
            n = min(gpus, 4)
            tp, pp = (2, n // 2) if n >= 4 else (n, 1)
            spec_n = Path(tmp) / "decoder_n.ppspec"
            spec_n.write_text(spec_text(config, seq_len, args.global_batch, args.steps, precision, tp, pp))
            one = [r["loss"] for r in records]
            many = [r["loss"] for r in ppdsl_run(spec_n, n, Path(tmp) / "wn")]
            worst = max(abs(a - b) / max(abs(a), 1e-6) for a, b in zip(one, many))
            agree = worst <= 2e-2  # bf16: the reduction order differs between layouts
            ok &= agree
            print(f"world {n} (tp {tp}, pp {pp}) on {device.type}: losses vs world 1, largest relative difference "
                  f"{worst:.2e} ({'ok' if agree else 'DIFFERS'})")
            small = dict(config, n_layers=4)
            spec_v = Path(tmp) / "decoder_v.ppspec"
            spec_v.write_text(spec_text(small, min(seq_len, 128), args.global_batch, 2, "fp32", tp, pp))
            proc = subprocess.run([sys.executable, "-m", "ppdsl", "verify", str(spec_v), "--world", str(n)],
                                  capture_output=True, text=True, timeout=3600)
            ok &= proc.returncode == 0
            print(f"ppdsl verify (CPU, gloo) of the same layout: exit {proc.returncode}\n{proc.stdout[-1500:]}")
        else:
            print("one device: the multi-GPU part is skipped")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
