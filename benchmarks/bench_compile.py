"""train.compile: step time of the shipped Llama spec with its blocks compiled against eager.

specs/llama.ppspec runs zbv, a split-backward style compile refuses (E0332), so both runs use
1f1b with one chunk, the same world (4 processes: pp 2 x tp 2), the same steps. The first steps
pay for compiling; the median of the steps after them is compared.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_compile.py [--spec specs/llama.ppspec] [--steps 6] [--nproc 4]
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

ROOT = Path(__file__).resolve().parent.parent
PPDSL = str(Path(sys.executable).with_name("ppdsl"))


def run(spec: str, nproc: int, steps: int, compiled: bool, out: Path) -> dict[str, float]:
    sets = ["pipeline.style=1f1b", "pipeline.chunks=1", f"train.steps={steps}", f"train.compile={str(compiled).lower()}",
            "train.save_final=false"]
    cmd = [PPDSL, "run", spec, "--nproc", str(nproc), "--out", str(out)] + [a for s in sets for a in ("--set", s)]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=dict(os.environ, OMP_NUM_THREADS="1"))
    wall = time.perf_counter() - t0
    steps_s = [r["step_time_s"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
               if r.get("kind") == "train"]
    return {"first_s": steps_s[0], "median_s": statistics.median(steps_s[2:]), "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default=str(ROOT / "specs" / "llama.ppspec"))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--nproc", type=int, default=4)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        eager = run(args.spec, args.nproc, args.steps, False, Path(tmp) / "eager")
        compiled = run(args.spec, args.nproc, args.steps, True, Path(tmp) / "compiled")
    print(f"{Path(args.spec).name}, {args.nproc} processes, 1f1b, steps 3-{args.steps} (cores: {os.cpu_count()})")
    print("| | step 1 (s) | median step (s) | wall (s) |")
    print("| --- | --- | --- | --- |")
    for name, r in (("eager", eager), ("compile", compiled)):
        print(f"| {name} | {r['first_s']:.2f} | {r['median_s']:.3f} | {r['wall_s']:.0f} |")
    print(f"speed-up of the median step: {eager['median_s'] / compiled['median_s']:.2f}x")


if __name__ == "__main__":
    main()
