"""Per-step training metrics: a progress line on rank 0 and JSON lines in a metrics file."""

from __future__ import annotations

import json
import math
import resource
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

import torch


@dataclass(frozen=True)
class StepRecord:
    step: int  # 1-based
    loss: float
    lr: float
    grad_norm: float | None  # None when no clipping ran and the norm was not computed
    step_time_s: float
    tokens_per_s: float
    peak_memory_mib: float  # the largest over all ranks
    skipped: bool = False  # fp16: the step was skipped after an overflow
    loss_scale: float | None = None
    # train.trace: each global rank's pipeline bubble this step (runtime.trace); absent when off
    bubble: list[float] | None = None

    def to_json(self) -> dict[str, Any]:
        out = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in asdict(self).items()}
        if out["bubble"] is None:
            del out["bubble"]
        return out


def peak_memory_mib(device: torch.device) -> float:
    """Peak memory of this process: allocated CUDA memory, or the peak resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def format_progress(record: StepRecord, total_steps: int) -> str:
    width = len(str(total_steps))
    parts = [
        f"step {record.step:>{width}}/{total_steps}",
        f"loss {record.loss:.4f}",
        f"lr {record.lr:.2e}",
    ]
    if record.grad_norm is not None:
        parts.append(f"gnorm {record.grad_norm:.3f}")
    parts += [
        f"{record.tokens_per_s:,.0f} tok/s",
        f"{record.step_time_s * 1000:.0f} ms",
        f"peak {record.peak_memory_mib:,.0f} MiB",
    ]
    if record.skipped:
        parts.append("skipped (overflow)")
    return " | ".join(parts)


class MetricsLogger:
    """Writes what rank 0 sees; every other rank gets a disabled logger."""

    def __init__(
        self, path: str | Path | None, total_steps: int, *, enabled: bool = True, stream: IO[str] | None = None,
        resume_after: int | None = None,
    ) -> None:
        """`resume_after`: a resumed run continues the existing file, keeping its records up to
        that step (later ones were not in the checkpoint and are run again)."""
        self.total_steps = total_steps
        self.enabled = enabled
        self.stream = sys.stdout if stream is None else stream
        self._file: IO[str] | None = None
        if enabled and path is not None:
            path = Path(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            kept: list[str] = []
            if resume_after is not None and path.is_file():
                for line in path.read_text(encoding="utf-8").splitlines():
                    try:
                        if json.loads(line)["step"] <= resume_after:
                            kept.append(line + "\n")
                    except (ValueError, KeyError, TypeError):
                        pass
            self._file = path.open("w", encoding="utf-8")
            self._file.writelines(kept)
            self._file.flush()

    def log(self, record: StepRecord) -> None:
        if not self.enabled:
            return
        print(format_progress(record, self.total_steps), file=self.stream, flush=True)
        if self._file is not None:
            self._file.write(json.dumps(record.to_json()) + "\n")
            self._file.flush()

    def note(self, message: str) -> None:
        if self.enabled:
            print(message, file=self.stream, flush=True)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
