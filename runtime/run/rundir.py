"""The run directory (``ppdsl run --out``): what ppdsl writes there, and the rule that a new run
never replaces an earlier run's results unless asked (``--resume`` continues them,
``--overwrite`` replaces them, and only them: a user's other files there are never touched)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ppdsl.runtime.export.atomic_dir import EXPORT_MARKER, FINAL_DIR

METRICS_FILE = "metrics.jsonl"
PLAN_FILE = "plan.json"  # the plan the run executed (runtime.train.trace.write_plan)
TRACE_FILE = "trace.json"  # train.trace: every rank's actions (runtime.train.trace.write_trace)
MEMORY_FILE = "memory.json"  # --memory-trace: each rank's predicted and measured peak (runtime.train.memory_report)
TENSORBOARD_DIR = "tensorboard"  # train.metrics = tensorboard: event files (runtime.train.metrics)
_RUN_FILES: tuple[str, ...] = (METRICS_FILE, PLAN_FILE, TRACE_FILE, MEMORY_FILE)
# every entry ppdsl writes into a run directory; `--overwrite` removes these and nothing else
RUN_OUTPUTS: tuple[str, ...] = (*_RUN_FILES, TENSORBOARD_DIR, FINAL_DIR)
_EVENT_FILE_PREFIX = "events.out.tfevents."
# held (flock) by the live run writing the directory, and by it alone (runtime/run/lock.py); not an output
LOCK_FILE = ".ppdsl.lock"


def earlier_run(out_dir: str | os.PathLike[str]) -> list[str]:
    """The entries of an earlier run in `out_dir` (directories with a trailing ``/``)."""
    root = Path(out_dir)
    return [name + ("/" if (root / name).is_dir() else "") for name in RUN_OUTPUTS if (root / name).exists()]


def claim_run_dir(out_dir: str | os.PathLike[str], *, resume: bool, overwrite: bool) -> None:
    """ValueError when `out_dir` holds an earlier run's results and the new run would replace
    them without being asked to. Changes nothing."""
    if resume or overwrite:
        return
    found = earlier_run(out_dir)
    if found:
        raise ValueError(
            f"run directory {out_dir} already holds an earlier run ({', '.join(found)}); pass --resume to "
            "continue it, --overwrite to replace what ppdsl wrote there, or choose another --out (nothing was changed)"
        )


def clear_earlier_run(out_dir: str | os.PathLike[str]) -> list[str]:
    """``--overwrite``: remove what an earlier run wrote into `out_dir` (``final/`` only when it
    is ppdsl's own export); returns the entries removed."""
    root = Path(out_dir)
    removed = []
    for name in _RUN_FILES:
        if (root / name).is_file():
            (root / name).unlink()
            removed.append(name)
    events = root / TENSORBOARD_DIR
    if events.is_dir() and all(p.is_file() and p.name.startswith(_EVENT_FILE_PREFIX) for p in events.iterdir()):
        shutil.rmtree(events)  # only a directory of nothing but event files
        removed.append(TENSORBOARD_DIR + "/")
    final = root / FINAL_DIR
    if final.is_dir() and (final / EXPORT_MARKER).is_file():
        shutil.rmtree(final)
        removed.append(FINAL_DIR + "/")
    return removed
