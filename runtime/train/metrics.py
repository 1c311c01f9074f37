"""Training metrics on rank 0: a progress line people read, metrics.jsonl for programs, and
TensorBoard event files when the spec asks for them (``train.metrics = tensorboard``).

The progress line of a logged step gives loss, LR, gradient norm, throughput, step time, the
time the step waited for its data, peak memory, MFU (when a peak is known) and the ETA. On a
terminal, the steps between two logged ones update a transient status line in place (carriage
return); when stdout is a file or a pipe only whole lines are written, so a log stays plain text.

metrics.jsonl holds one JSON object per line: ``"kind": "train"`` for a logged step (the fields
of `StepRecord`), ``"kind": "eval"`` for an evaluation (``runtime.train.evaluate.EvalResult``).
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

import torch

from ppdsl.runtime.run.rundir import TENSORBOARD_DIR


@dataclass(frozen=True)
class StepRecord:
    step: int  # 1-based
    loss: float
    lr: float
    grad_norm: float | None  # None when no clipping ran and the norm was not computed
    step_time_s: float
    tokens_per_s: float
    peak_memory_mib: float  # the largest over all ranks
    skipped: bool = False  # the loss or a gradient was not finite: no update (train.on_nonfinite)
    loss_scale: float | None = None
    mfu: float | None = None  # model FLOPs utilisation, 0..1; None without a peak (train.peak_tflops)
    eta_s: float | None = None  # estimated seconds to the end of training
    # train.trace: each global rank's pipeline bubble this step (runtime.train.trace); absent when off
    bubble: list[float] | None = None
    skipped_steps: int = 0  # steps skipped so far in the run (this one included)
    # train.compile: this rank's torch.compile figures so far (`compile_stats`); absent when off
    compile: dict[str, int] | None = None
    # seconds the step waited for its data (the longest over the ranks; runtime.data.prefetch); absent: not measured
    data_wait_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        fields = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in asdict(self).items()}
        for optional in ("bubble", "compile", "data_wait_s"):
            if fields[optional] is None:
                del fields[optional]
        return {"kind": "train", **fields}


# ---------------------------------------------------------------------------------------------
# Figures: memory, FLOPs, MFU, ETA
# ---------------------------------------------------------------------------------------------


def peak_memory_mib(device: torch.device) -> float:
    """Peak memory of this process: allocated CUDA memory, or the peak resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def flops_per_token(params: int, layers: int, hidden: int, seq_len: int) -> float:
    """Training FLOPs per token (forward and backward), PaLM's estimate (Chowdhery et al. 2022,
    appendix B): 6 N for the matmuls with the N non-embedding parameters, plus 12 L H T for
    the attention scores and their use (L layers, hidden size H, T tokens of context)."""
    return 6.0 * params + 12.0 * layers * hidden * seq_len


def mfu(tokens_per_s: float, flops_per_token: float, peak_tflops: float | None, devices: int) -> float | None:
    """Achieved model FLOP/s over the peak of `devices` devices; None without a peak."""
    if peak_tflops is None or peak_tflops <= 0 or devices < 1:
        return None
    return tokens_per_s * flops_per_token / (peak_tflops * 1e12 * devices)


def eta_seconds(elapsed_s: float, done: int, remaining: int) -> float | None:
    """The remaining steps at the mean wall time of the steps done so far (evaluations and
    checkpoints included); None before the first step."""
    if done <= 0:
        return None
    return elapsed_s / done * max(0, remaining)


def format_duration(seconds: float) -> str:
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


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
        *([] if record.data_wait_s is None else [f"data {record.data_wait_s * 1000:.0f} ms"]),
        f"peak {record.peak_memory_mib:,.0f} MiB",
    ]
    if record.mfu is not None:
        parts.append(f"mfu {record.mfu * 100:.3g}%")
    if record.eta_s is not None and record.step < total_steps:
        parts.append(f"eta {format_duration(record.eta_s)}")
    if record.skipped:
        parts.append(f"skipped: not finite ({record.skipped_steps} so far)")
    if record.compile is not None:
        c = record.compile
        parts.append(f"compiled {c['graphs']} graph(s), {c['graph_breaks']} break(s), "
                     f"cache {c['cache_hits']} hit(s) / {c['cache_misses']} miss(es)")
    return " | ".join(parts)


def compile_stats() -> dict[str, int]:
    """torch.compile's counters in this process: graphs compiled, graph breaks, and inductor's
    on-disk FX graph cache (reused across runs) hits and misses."""
    from torch._dynamo.utils import counters

    return {"graphs": int(counters["stats"]["unique_graphs"]),
            "graph_breaks": int(sum(counters["graph_break"].values())),
            "cache_hits": int(counters["inductor"]["fxgraph_cache_hit"]),
            "cache_misses": int(counters["inductor"]["fxgraph_cache_miss"])}


def format_eval(result: Any, total_steps: int) -> str:
    """The line of an evaluation (``runtime.train.evaluate.EvalResult``)."""
    width = len(str(total_steps))
    parts = [f"eval {result.step:>{width}}/{total_steps}", f"loss {result.loss:.4f}"]
    if result.perplexity is not None:
        parts.append(f"ppl {result.perplexity:.3f}")
    if result.accuracy is not None:
        parts.append(f"acc {result.accuracy * 100:.2f}%")
    parts.append(f"{result.samples} samples")
    parts.append(f"{result.time_s * 1000:.0f} ms")
    return " | ".join(parts)


# ---------------------------------------------------------------------------------------------
# Sinks
# ---------------------------------------------------------------------------------------------


class TensorBoardSink:
    """Scalars as TensorBoard event files (torch.utils.tensorboard; needs the `tensorboard`
    package, the optional extra ``ppdsl[tensorboard]``)."""

    def __init__(self, log_dir: Path, purge_step: int | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter  # ImportError without tensorboard

        self.log_dir = log_dir
        self._writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)

    def step(self, record: StepRecord) -> None:
        scalars = {
            "train/loss": record.loss, "train/lr": record.lr, "train/grad_norm": record.grad_norm,
            "train/tokens_per_s": record.tokens_per_s, "train/step_time_s": record.step_time_s,
            "train/peak_memory_mib": record.peak_memory_mib, "train/mfu": record.mfu,
            "train/loss_scale": record.loss_scale, "train/skipped_steps": float(record.skipped_steps),
            "train/data_wait_s": record.data_wait_s,
        }
        self._add(scalars, record.step)

    def eval(self, result: Any) -> None:
        scalars = {"eval/loss": result.loss, "eval/perplexity": result.perplexity, "eval/accuracy": result.accuracy}
        self._add(scalars, result.step)

    def _add(self, scalars: dict[str, float | None], step: int) -> None:
        for tag, value in scalars.items():
            if value is not None and math.isfinite(value):
                self._writer.add_scalar(tag, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


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
        self.path = None if path is None else Path(path)
        self.resume_after = resume_after
        self.skipped_before = 0  # a resumed run: the skipped steps its kept records count
        self.tensorboard: TensorBoardSink | None = None
        self._transient = False  # a status line is on the terminal, not yet ended
        self._file: IO[str] | None = None
        if enabled and self.path is not None:
            path = self.path
            path.parent.mkdir(parents=True, exist_ok=True)
            kept: list[str] = []
            if resume_after is not None and path.is_file():
                for line in path.read_text(encoding="utf-8").splitlines():
                    try:
                        record = json.loads(line)
                        if record["step"] <= resume_after:
                            kept.append(line + "\n")
                            self.skipped_before = max(self.skipped_before, int(record.get("skipped_steps", 0)))
                    except (ValueError, KeyError, TypeError):
                        pass
            # the kept records replace the file in one rename: a run killed now loses none of them
            tmp = path.with_name(f".{path.name}.tmp")
            with tmp.open("w", encoding="utf-8") as f:
                f.writelines(kept)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            self._file = path.open("a", encoding="utf-8")

    @property
    def interactive(self) -> bool:
        """Whether the stream is a terminal (transient status lines) rather than a log file."""
        isatty = getattr(self.stream, "isatty", None)
        try:
            return bool(isatty and isatty())
        except ValueError:  # a closed stream
            return False

    def enable_tensorboard(self, log_dir: str | Path | None = None) -> Path | None:
        """Also write TensorBoard event files, to `log_dir` (default: ``tensorboard/`` beside
        metrics.jsonl). Without the tensorboard package, or without a run directory, a warning
        line says so and metrics.jsonl stays the only record; returns the directory or None."""
        if not self.enabled:
            return None
        if log_dir is None:
            if self.path is None:
                self.note("ppdsl: warning: metrics = tensorboard needs a run directory (--out); no event files")
                return None
            log_dir = self.path.parent / TENSORBOARD_DIR
        try:
            purge = None if self.resume_after is None else self.resume_after + 1
            self.tensorboard = TensorBoardSink(Path(log_dir), purge_step=purge)
        except ImportError:
            self.note("ppdsl: warning: metrics = tensorboard, but the tensorboard package is not installed "
                      "(pip install 'ppdsl[tensorboard]'); writing metrics.jsonl only")
            return None
        return Path(log_dir)

    def log(self, record: StepRecord) -> None:
        if not self.enabled:
            return
        self._line(format_progress(record, self.total_steps))
        self._write(record.to_json())
        if self.tensorboard is not None:
            self.tensorboard.step(record)

    def log_eval(self, result: Any) -> None:
        if not self.enabled:
            return
        self._line(format_eval(result, self.total_steps))
        self._write(result.to_json())
        if self.tensorboard is not None:
            self.tensorboard.eval(result)

    def status(self, step: int, eta_s: float | None) -> None:
        """A step that is not logged: on a terminal, a status line updated in place; nothing
        in a log file."""
        if not self.enabled or not self.interactive:
            return
        width = len(str(self.total_steps))
        text = f"step {step:>{width}}/{self.total_steps}"
        if eta_s is not None and step < self.total_steps:
            text += f" | eta {format_duration(eta_s)}"
        self.stream.write("\r" + text + "\x1b[K")
        self.stream.flush()
        self._transient = True

    def note(self, message: str) -> None:
        if self.enabled:
            self._line(message)

    def _line(self, text: str) -> None:
        if self._transient:
            self.stream.write("\r\x1b[K")
            self._transient = False
        print(text, file=self.stream, flush=True)

    def _write(self, obj: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(obj) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._transient:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._transient = False
        if self._file is not None:
            self._file.close()
            self._file = None
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
