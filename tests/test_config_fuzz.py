"""Config fuzz with the model (benchmarks/config_fuzz.py), small: slow tests, deselected by
default (run with `-m slow`).

- A seeded fuzz of 40 mutants of the shipped and test specs' config values, each checked with the
  model (in a worker process a timeout restarts), and 3 of the accepted ones verified against one
  process: no traceback, no internal error, no verify FAILED that fp64 confirms. About 4 minutes
  on two busy cores. The full run (at least 500 mutants, 30 verifies) is the benchmark; its
  figures are in docs/config_fuzz.md.
- Every failing mutant the benchmark saved under tests/config_fuzz_cases/ is run again by the
  command its header names: it must end in a verdict (check: exit 0 or 2 with diagnostics placed
  at a line and column, never an internal error or a traceback; verify and run: exit 0, or check
  refusing the spec before launch). A case whose header says
  `# status: open` is an expected failure (strict: once it passes, change its status to
  `# status: fixed`, and it stays as a golden).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CASES = sorted((ROOT / "tests" / "config_fuzz_cases").glob("*.ppspec"))


def _benchmark():
    # benchmarks/ on sys.path: the worker process (spawn) imports the module by that name
    if str(ROOT / "benchmarks") not in sys.path:
        sys.path.insert(0, str(ROOT / "benchmarks"))
    if "config_fuzz" in sys.modules:
        return sys.modules["config_fuzz"]
    spec = importlib.util.spec_from_file_location("config_fuzz", ROOT / "benchmarks" / "config_fuzz.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["config_fuzz"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_config_fuzz_small(tmp_path: Path) -> None:
    cf = _benchmark()
    result = cf.fuzz(mutants=40, verifies=3, seed=7, check_timeout=90, verify_timeout=420, log=print, tmp=tmp_path)
    mutants = result["mutants"]
    assert len(mutants) == 40
    verdicts = Counter(m["check"]["verdict"] for m in mutants)
    bad = [m for m in mutants if m["check"]["verdict"] in ("traceback", "internal-error")]
    assert not bad, "\n".join(f"{m['base']}: {m['new'] or 'remove ' + m['key']}: {m['check']}" for m in bad)
    verified = [m for m in mutants if m.get("verify")]
    assert len(verified) == 3, (verdicts, result["eligible_for_verify"])
    failed = [m for m in verified if m["verify"]["outcome"] == "FAILED (fp64 confirms)"]
    assert not failed, "\n".join(f"{m['base']}: {m['new']}: {m['verify']}" for m in failed)
    print(dict(verdicts), Counter(m["verify"]["outcome"] for m in verified))


def _limit_memory() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))


def _header(path: Path) -> dict[str, str]:
    head = path.read_text(encoding="utf-8").split("ppspec 1", 1)[0]
    return {m.group(1): m.group(2).strip() for m in re.finditer(r"^# (command|status|signature): (.*)$", head, re.M)}


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[p.stem for p in CASES])
def test_saved_case_ends_in_a_verdict(case: Path, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    header = _header(case)
    if header.get("status", "open").startswith("open"):
        request.applymarker(pytest.mark.xfail(reason=f"open: {header.get('signature', '')}", strict=True))
    words = [str(tmp_path / "run") if w == "RUN_DIR" else w for w in header["command"].split()]
    assert words[0] == "ppdsl" and words[1] in ("check", "plan", "verify", "run"), header["command"]
    if words[1] == "check":
        words.append("--format=json")  # every error placed: a line and a column
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NO_COLOR": "1"}
    env.pop("PPDSL_DEBUG", None)
    # a check gets the fuzz's time (a case that timed out fails here the same way), and no command
    # more than 6 GiB of address space (a config that makes a library allocate without end)
    p = subprocess.run([sys.executable, "-m", "ppdsl", *words[1:]], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120 if words[1] in ("check", "plan") else 900, preexec_fn=_limit_memory)
    out = p.stdout + p.stderr
    assert "Traceback (most recent call last)" not in out and "internal error" not in out, out[-3000:]
    if words[1] in ("verify", "run"):  # runs as one process would, or check refuses it before launch
        assert p.returncode == 0 or (p.returncode == 2 and "error[" in out), out[-3000:]
    else:
        assert p.returncode in (0, 2), out[-3000:]
        if words[1] == "check" and p.returncode == 2:
            errors = [d for d in json.loads(p.stdout)["diagnostics"] if d["severity"] == "error"]
            assert errors and all((d["span"] or {}).get("line") and d["span"].get("column") for d in errors), errors
