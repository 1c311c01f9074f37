"""What each registered family still gives over the model's own forward, measured.

For every case of tests/test_families.py (each family's HF class on a tiny config, its split rules,
pp 2 x tp 2, 1F1B, one step against one process) this runs

- the family with ``sequence_parallel = true``,
- the same spec through the own forward: the family registry emptied, so check gives the class
  the family "own" (its own forward, cut between blocks; check's verdict where it refuses), and
- the own forward with ``sequence_parallel = true``.

and prints a markdown table (docs/families.md "Why the families remain" is its output):

    OMP_NUM_THREADS=1 python benchmarks/own_forward_vs_families.py [--out table.md]

About three minutes on 2 CPU cores (three spawned gloo worlds of 4).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def _verdicts(names: list[str], plans: list[Any]) -> dict[str, str]:
    from _exec_harness import equivalence_worker
    from dist_harness import run_distributed

    out = {}
    for name, (report, _s) in zip(names, run_distributed(equivalence_worker, 4, plans, timeout=60 + 60 * len(plans))[0]):
        ok = report.ok and not report.problems and report.max_loss_diff <= 1e-6 and report.first_step_grad_diff <= 1e-5
        out[name] = "match" if ok else f"MISMATCH (loss {report.max_loss_diff:.1e}, grad {report.first_step_grad_diff:.1e})"
    return out


def _run(tmp: Path, cases: list[str], text_of: Any) -> dict[str, str]:
    from ppdsl.dsl.check import check_file
    from ppdsl.lowering.lower import lower

    names, plans, verdicts = [], [], {}
    for name in cases:
        path = tmp / f"{name}.ppspec"
        path.write_text(text_of(name), encoding="utf-8")
        result = check_file(path, world=4)
        errors = [d for d in result.diagnostics if d.is_error]
        if errors:
            verdicts[name] = f"refused {errors[0].code}: {errors[0].message.split(': ', 1)[-1][:140]}"
            continue
        names.append(name)
        plans.append(lower(result.spec, 4, result.model_info))
    verdicts.update(_verdicts(names, plans) if plans else {})
    return verdicts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="write the markdown table here (default: stdout)")
    args = ap.parse_args()
    import test_families as tf

    import ppdsl.core.families as families

    cases = list(tf.FAMILY_CASES)

    def with_sp(n: str) -> str:
        return tf.spec_text(n, "1f1b", sequence_parallel=True)

    registered = [n for n in cases if tf.expected_family(n) != "own"]
    with tempfile.TemporaryDirectory() as tmp:
        sp = {n: "deleted: the own forward runs it" for n in cases}
        sp.update(_run(Path(tmp), registered, with_sp))
        families._BY_HF_CLASS.clear()  # every HF class now runs its own forward
        own = _run(Path(tmp), cases, lambda n: tf.spec_text(n, "1f1b"))
        own_sp = _run(Path(tmp), cases, with_sp)
    lines = ["| family | HF class | the family with sequence parallelism | the own forward (no family) | "
             "the own forward with sequence parallelism |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {n} | {tf.TINY[tf.ALL_CASES[n][0]].hf_class} | {sp[n]} | {own[n]} | {own_sp[n]} |" for n in cases]
    text = "\n".join(lines) + "\n"
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
