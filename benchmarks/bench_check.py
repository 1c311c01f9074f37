"""Cold `ppdsl check specs/<each>.ppspec --no-model`: a fresh interpreter per run, as a user types it.

Prints, per spec, the median and minimum wall time over N runs, and the median CPU time of the
child (user + system; on a busy machine wall time includes waiting for a core, CPU time does not).
Every run must exit 0 (the shipped specs are valid).

Usage: python benchmarks/bench_check.py [--repeat N] [--specs 'specs/*.ppspec'] [--model] [--json] [--no-pyc]
       python benchmarks/bench_check.py --profile specs/gpt2.ppspec   # where the cold time goes

Python caches compiled bytecode (__pycache__, ignored by git) as it does on a user's machine;
`--no-pyc` keeps PYTHONDONTWRITEBYTECODE as the environment sets it, so that a sandbox that forbids
bytecode files measures the compile time of ppdsl's own modules too.

The DESIGN target: a spec is proven in under a second.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def command() -> list[str]:
    """The installed `ppdsl` script beside this interpreter, else `python -m ppdsl`."""
    script = Path(sys.executable).with_name("ppdsl")
    if script.exists():
        return [str(script)]
    found = shutil.which("ppdsl")
    return [found] if found else [sys.executable, "-m", "ppdsl"]


ENV = {**os.environ, "NO_COLOR": "1"}


def run_once(argv: list[str]) -> tuple[float, float]:
    """(wall seconds, child CPU seconds) of one cold run."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} exited {proc.returncode}:\n{proc.stderr}{proc.stdout}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def bench(spec: str, repeat: int, model: bool) -> dict:
    argv = [*command(), "check", spec, *([] if model else ["--no-model"])]
    run_once(argv)  # warm the OS file cache (and lark's grammar cache) once; not counted
    walls, cpus = [], []
    for _ in range(repeat):
        wall, cpu = run_once(argv)
        walls.append(wall)
        cpus.append(cpu)
    return {"spec": spec, "runs": repeat, "median_s": statistics.median(walls), "min_s": min(walls),
            "max_s": max(walls), "median_cpu_s": statistics.median(cpus)}


def profile(spec: str) -> None:
    """Import times (-X importtime, top 15 cumulative) and a cProfile of one cold check."""
    argv = [sys.executable, "-X", "importtime", "-m", "ppdsl", "check", spec, "--no-model"]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    rows = []
    for line in proc.stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            _, cumulative, name = (x.strip() for x in line[len("import time:"):].split("|"))
            if cumulative.isdigit():
                rows.append((int(cumulative), name))
    print("slowest imports (cumulative, ms):")
    for us, name in sorted(rows, reverse=True)[:15]:
        print(f"  {us / 1000:8.1f}  {name}")
    code = ("import cProfile, pstats, sys; from ppdsl.cli import main; "
            f"cProfile.run('main([\"check\", {spec!r}, \"--no-model\"])', '/tmp/ppdsl_check.prof'); "
            "pstats.Stats('/tmp/ppdsl_check.prof').sort_stats('cumulative').print_stats(25)")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=7, help="timed runs per spec (default 7)")
    ap.add_argument("--specs", default="specs/*.ppspec", help="glob, relative to the repository root")
    ap.add_argument("--model", action="store_true", help="include the model-level checks (imports torch)")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    ap.add_argument("--profile", metavar="SPEC", help="profile one cold check instead of timing")
    ap.add_argument("--no-pyc", action="store_true", help="leave PYTHONDONTWRITEBYTECODE as the environment has it")
    args = ap.parse_args()
    if not args.no_pyc:
        ENV.pop("PYTHONDONTWRITEBYTECODE", None)
    if args.profile:
        profile(args.profile)
        return
    specs = sorted(os.path.relpath(p, ROOT) for p in glob.glob(str(ROOT / args.specs)))
    if not specs:
        raise SystemExit(f"no spec matches {args.specs}")
    results = []
    for spec in specs:
        r = bench(spec, args.repeat, args.model)
        results.append(r)
        if not args.json:
            print(f"{spec:28s} median {r['median_s']:.3f} s  min {r['min_s']:.3f} s  max {r['max_s']:.3f} s  "
                  f"cpu {r['median_cpu_s']:.3f} s  ({r['runs']} cold runs)", flush=True)
    overall = statistics.median(r["median_s"] for r in results)
    if args.json:
        print(json.dumps({"command": " ".join(command()), "results": results, "median_of_medians_s": overall}, indent=2))
    else:
        print(f"median of medians: {overall:.3f} s (load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores)")


if __name__ == "__main__":
    main()
