"""Helpers for tests that run `ppdsl run --nproc N` as a subprocess (checkpoint, failure)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ppdsl.dsl.check import check_file
from ppdsl.lowering.lower import lower
from ppdsl.lowering.plan import Plan

ROOT = Path(__file__).resolve().parent.parent
TINY_CPU = ROOT / "specs" / "tiny_cpu.ppspec"
HARD_TIMEOUT_S = 240  # per launch; a normal one takes 20-50 s on 2 cores


def tiny_cpu_spec(tmp_path: Path, name: str, *, steps: int, every: int | None, ckpt_dir: Path | None = None) -> Path:
    """tiny_cpu.ppspec with `steps` steps and (unless every is None) a checkpoint block."""
    text = TINY_CPU.read_text(encoding="utf-8")
    block = f'steps = {steps}'
    if every is not None:
        block += f'\n  checkpoint {{ dir = "{ckpt_dir or tmp_path / "ckpt"}", every = {every} }}'
    text = text.replace("steps = 40", block)
    path = tmp_path / f"{name}.ppspec"
    path.write_text(text, encoding="utf-8")
    return path


def spec_plan(spec: Path, world: int = 2, overrides: Sequence[str] = ("mesh.tp=1",)) -> Plan:
    """The plan `ppdsl run --set ...` gets from a spec file at this world size (by default
    tiny_cpu as a 2-stage pipeline: dp = world / 2)."""
    r = check_file(str(spec), world=world, overrides=list(overrides), model=True)
    assert r.ok, [d for d in r.diagnostics if d.is_error]
    return lower(r.spec, world, r.model_info)


def env(**extra: str) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("PPDSL_TEST_", "TORCHELASTIC_", "RANK", "WORLD_SIZE"))}
    e.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return e


def run_cmd(args: list[str], timeout: float = HARD_TIMEOUT_S, **extra: str) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "ppdsl", *args], capture_output=True, text=True,
                          timeout=timeout, env=env(**extra), cwd=ROOT)
    return proc, time.monotonic() - t0


def losses(out: Path) -> list[tuple[int, float]]:
    """The training lines' (step, loss) of a run's metrics.jsonl (evaluation lines left out)."""
    lines = map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
    return [(r["step"], r["loss"]) for r in lines if r.get("kind", "train") == "train"]


def resume_resharded(tmp_path: Path, spec: Path, ck: Path, nproc: int, sets: Sequence[str]) -> tuple[
        dict[int, float], dict[int, float], str]:
    """Run `spec` (4 steps, a checkpoint every 2 in `ck`) uninterrupted, then resume a copy of its
    step-2 checkpoint with `sets` (another mesh): (the run's losses, the resumed run's, its output)."""
    proc, _ = run_cmd(["run", str(spec), "--nproc", str(nproc), "--out", str(tmp_path / "ref")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed_ck = tmp_path / "ck_resumed"
    shutil.copytree(ck / "step-000002", resumed_ck / "step-000002")
    (resumed_ck / "latest").write_text("step-000002\n")
    args = ["run", str(spec), "--nproc", str(nproc), "--out", str(tmp_path / "resumed"), "--resume",
            "--set", f'train.checkpoint.dir="{resumed_ck}"']
    for s in sets:
        args += ["--set", s]
    resumed, _ = run_cmd(args)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return dict(losses(tmp_path / "ref")), dict(losses(tmp_path / "resumed")), resumed.stdout + resumed.stderr


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """path -> (size, mtime_ns) of every file under `root`."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


def full_tensors(checkpoint: Path) -> dict[str, Any]:
    """A checkpoint's tensors, whole (torch.distributed.checkpoint's own conversion)."""
    import torch  # here: several modules using these helpers run without torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = checkpoint.with_name(checkpoint.name + ".pt")
    dcp_to_torch_save(checkpoint, out)
    return torch.load(out, weights_only=False)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (a rendezvous endpoint for torchrun)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants (torchrun starts each worker in a session of its own, so a
    process group does not hold them)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out
