"""`train.eval`, `train.metrics` and `train.peak_tflops`: the language, check's diagnostics, the
plan, and the metrics people read (progress line with MFU and ETA, terminal vs log file,
metrics.jsonl, TensorBoard event files). No process group: fast."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import numpy as np
import pytest

from _run_helpers import ROOT, run_cmd
from ppdsl.dsl.check import check_file
from ppdsl.lowering.lower import lower
from ppdsl.lowering.plan import DataPlan, EvalPlan, Plan

SPEC = """ppspec 1
model tiny {{
  source = python("ppdsl.models.decoder:build_decoder")
  config {{ vocab_size = 128, dim = 32, n_layers = 4, n_heads = 4, max_seq_len = 64 }}
}}
mesh {{ pp = 2 }}
pipeline {{ style = 1f1b, microbatches = 2 }}
train {{
  global_batch = 8
  seq_len = 8
  steps = 4
  data = synthetic(seed = 5)
{extra}
}}
"""


def check(tmp_path: Path, extra: str, world: int | None = 2):
    path = tmp_path / "spec.ppspec"
    path.write_text(SPEC.format(extra=extra), encoding="utf-8")
    return check_file(path, world=world, model=False)


def codes(result) -> list[str]:
    return [d.code for d in result.diagnostics]


# ---------------------------------------------------------------------------------------------
# the language and the plan
# ---------------------------------------------------------------------------------------------


def test_eval_block_lowers_into_the_plan(tmp_path: Path) -> None:
    r = check(tmp_path, "  eval { data = synthetic(), every = 2, batches = 3 }\n  metrics = tensorboard\n"
                        "  peak_tflops = 312")
    assert r.ok, r.diagnostics
    plan = lower(r.spec, 2)
    assert plan.train.eval == EvalPlan(DataPlan("synthetic", (("seed", 6),)), 2, 3)  # default: data seed + 1
    assert plan.train.metrics == "tensorboard" and plan.train.peak_tflops == 312.0
    assert Plan.from_json(json.loads(plan.dumps())) == plan


def test_eval_defaults_and_no_eval(tmp_path: Path) -> None:
    plan = lower(check(tmp_path, '  eval { data = synthetic(seed = 9) }').spec, 2)
    assert plan.train.eval == EvalPlan(DataPlan("synthetic", (("seed", 9),)), 0, 1)
    plan = lower(check(tmp_path, "").spec, 2)
    assert plan.train.eval is None and plan.train.metrics == "jsonl" and plan.train.peak_tflops is None


@pytest.mark.parametrize(
    ("extra", "code", "where", "text"),
    [
        ("  eval { data = synthetic(), evry = 2 }", "E0101", (13, 30), "unknown key 'evry' in train.eval"),
        ("  eval { every = 2 }", "E0102", (13, 3), "train.eval has no 'data'"),
        ("  eval { data = synthetic(), batches = 0 }", "E0103", (13, 40), "eval.batches must be at least 1"),
        ("  eval { data = synthetic(), every = -1 }", "E0103", (13, 38), "eval.every must be at least 0"),
        ("  eval { data = tokenz(\"x.bin\") }", "E0107", (13, 17), "data must be one of"),
        ("  eval = 3", "E0103", (13, 3), "'eval' is a block"),
        ("  metrics = wandb", "E0107", (13, 13), "unknown metrics 'wandb'"),
        ("  peak_tflops = -1", "E0103", (13, 17), "peak_tflops must be positive"),
    ],
)
def test_invalid_eval_and_metrics_keys(tmp_path: Path, extra: str, code: str, where: tuple[int, int], text: str) -> None:
    r = check(tmp_path, extra)
    assert code in codes(r), r.diagnostics
    d = next(d for d in r.diagnostics if d.code == code)
    assert (d.span.line, d.span.column) == where and text in d.message


def test_eval_data_files_are_checked_like_the_training_data(tmp_path: Path) -> None:
    r = check(tmp_path, '  eval { data = tokens("missing.bin") }')
    assert codes(r) == ["E0410"] and (r.diagnostics[0].span.line, r.diagnostics[0].span.column) == (13, 24)
    np.arange(100, dtype=np.uint16).tofile(tmp_path / "held.bin")  # 100 tokens: 12 windows of 8
    assert check(tmp_path, '  eval { data = tokens("held.bin") }').ok  # one global batch: 64 tokens
    r = check(tmp_path, '  eval { data = tokens("held.bin"), batches = 2 }')
    assert codes(r) == ["E0414"] and "2 eval batches need (eval.batches * global_batch * seq_len = 2 * 8 * 8 = 128)" in r.diagnostics[0].message
    np.full(64, 500, dtype=np.uint16).tofile(tmp_path / "big.bin")
    assert codes(check(tmp_path, '  eval { data = tokens("big.bin") }')) == ["E0413"]
    (tmp_path / "ex.jsonl").write_text('{"text": "a", "label": 0}\n', encoding="utf-8")
    r = check(tmp_path, '  eval { data = jsonl("ex.jsonl", tokenizer = ".") }')
    assert "E0418" in codes(r)  # labelled examples for a causal language model


def test_tensorboard_without_the_package_is_a_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ppdsl.dsl import metrics_check

    monkeypatch.setattr(metrics_check, "tensorboard_installed", lambda: False)
    r = check(tmp_path, "  metrics = tensorboard")
    assert r.ok and codes(r) == ["W0419"]
    assert (r.diagnostics[0].span.line, r.diagnostics[0].span.column) == (13, 3)
    monkeypatch.setattr(metrics_check, "tensorboard_installed", lambda: True)
    assert codes(check(tmp_path, "  metrics = tensorboard")) == []


def test_eval_schedule(tmp_path: Path) -> None:
    from ppdsl.runtime.train.evaluate import due

    every3 = lower(check(tmp_path, "  eval { data = synthetic(), every = 3 }").spec, 2).train.eval
    assert [s for s in range(1, 11) if due(every3, s, 10)] == [3, 6, 9, 10]
    at_the_end = lower(check(tmp_path, "  eval { data = synthetic() }").spec, 2).train.eval
    assert [s for s in range(1, 11) if due(at_the_end, s, 10)] == [10]


# ---------------------------------------------------------------------------------------------
# metrics
# ---------------------------------------------------------------------------------------------


def record(step: int = 3, **kw):
    from ppdsl.runtime.train.metrics import StepRecord

    values = dict(step=step, loss=4.5, lr=1e-3, grad_norm=0.5, step_time_s=0.25, tokens_per_s=1024.0,
                  peak_memory_mib=300.0)
    values.update(kw)
    return StepRecord(**values)


def test_flops_mfu_and_eta() -> None:
    from ppdsl.runtime.train.metrics import eta_seconds, flops_per_token, format_duration, mfu

    # GPT-2 124M: 85M non-embedding parameters, 12 layers, 768 wide, 1024 tokens of context
    fpt = flops_per_token(85_000_000, 12, 768, 1024)
    assert fpt == 6 * 85_000_000 + 12 * 12 * 768 * 1024
    assert mfu(1e5, fpt, 989.0, 8) == pytest.approx(1e5 * fpt / (989e12 * 8))
    assert mfu(1e5, fpt, None, 8) is None  # no peak (CPU unless given): no MFU
    assert eta_seconds(10.0, 5, 15) == 30.0 and eta_seconds(0.0, 0, 5) is None
    assert [format_duration(s) for s in (7, 75, 3725)] == ["7s", "1m15s", "1h02m"]


def test_progress_line_shows_mfu_and_eta() -> None:
    from ppdsl.runtime.train.metrics import format_progress

    line = format_progress(record(mfu=0.4213, eta_s=95.0), 10)
    assert line.endswith("| peak 300 MiB | mfu 42.1% | eta 1m35s")
    assert "eta" not in format_progress(record(step=10, eta_s=0.0), 10)
    assert "mfu" not in format_progress(record(), 10)


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_log_file_gets_plain_lines_and_a_terminal_a_status_line(tmp_path: Path) -> None:
    from ppdsl.runtime.train.evaluate import EvalResult
    from ppdsl.runtime.train.metrics import MetricsLogger

    result = EvalResult(step=4, loss=2.0, batches=2, samples=16, perplexity=math.exp(2.0), time_s=0.5)
    plain = io.StringIO()
    with MetricsLogger(tmp_path / "m.jsonl", 10, stream=plain) as logger:
        logger.status(1, 9.0)
        logger.log(record(step=2, eta_s=20.0))
        logger.log_eval(result)
    text = plain.getvalue()
    assert "\r" not in text and "\x1b" not in text
    assert text.splitlines() == [
        "step  2/10 | loss 4.5000 | lr 1.00e-03 | gnorm 0.500 | 1,024 tok/s | 250 ms | peak 300 MiB | eta 20s",
        "eval  4/10 | loss 2.0000 | ppl 7.389 | 16 samples | 500 ms",
    ]
    lines = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [line["kind"] for line in lines] == ["train", "eval"]
    assert lines[1]["eval_loss"] == 2.0 and lines[1]["eval_perplexity"] == pytest.approx(math.exp(2.0))
    assert "eval_accuracy" not in lines[1]

    tty = Tty()
    with MetricsLogger(None, 10, stream=tty) as logger:
        logger.status(1, 9.0)
        logger.note("checkpoint: here")
    assert tty.getvalue() == "\rstep  1/10 | eta 9s\x1b[K\r\x1b[Kcheckpoint: here\n"


def test_tensorboard_event_files_are_written_and_readable(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from ppdsl.runtime.train.evaluate import EvalResult
    from ppdsl.runtime.train.metrics import MetricsLogger

    with MetricsLogger(tmp_path / "metrics.jsonl", 10, stream=io.StringIO()) as logger:
        assert logger.enable_tensorboard() == tmp_path / "tensorboard"
        logger.log(record(step=1, loss=5.0, mfu=0.25))
        logger.log(record(step=2, loss=4.0))
        logger.log_eval(EvalResult(step=2, loss=3.5, batches=1, samples=8, accuracy=0.75))
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 5.0), (2, 4.0)]
    assert [(e.step, e.value) for e in events.Scalars("train/mfu")] == [(1, 0.25)]
    assert [(e.step, e.value) for e in events.Scalars("eval/accuracy")] == [(2, 0.75)]
    assert "eval/perplexity" not in events.Tags()["scalars"]


def test_a_resumed_run_replaces_the_event_records_after_its_checkpoint(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    import time

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from ppdsl.runtime.train.metrics import MetricsLogger

    with MetricsLogger(tmp_path / "metrics.jsonl", 4, stream=io.StringIO()) as logger:
        logger.enable_tensorboard()
        for step in (1, 2, 3):
            logger.log(record(step=step, loss=10.0 + step))
    time.sleep(1.1)  # event file names hold the second they were made
    with MetricsLogger(tmp_path / "metrics.jsonl", 4, stream=io.StringIO(), resume_after=2) as logger:
        logger.enable_tensorboard()
        for step in (3, 4):
            logger.log(record(step=step, loss=20.0 + step))
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 11.0), (2, 12.0), (3, 23.0), (4, 24.0)]
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]


def test_tensorboard_missing_is_a_warning_at_run_time(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import builtins

    from ppdsl.runtime.train.metrics import MetricsLogger

    real_import = builtins.__import__

    def no_tensorboard(name: str, *args, **kwargs):
        if name.startswith("torch.utils.tensorboard"):
            raise ImportError("no tensorboard")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    out = io.StringIO()
    with MetricsLogger(tmp_path / "metrics.jsonl", 10, stream=out) as logger:
        assert logger.enable_tensorboard() is None
        logger.log(record())
    assert "tensorboard package is not installed" in out.getvalue()
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 1


# ---------------------------------------------------------------------------------------------
# end to end: `ppdsl run` with evaluation and TensorBoard (2 processes)
# ---------------------------------------------------------------------------------------------


@pytest.mark.distributed
def test_run_with_eval_writes_eval_lines_and_event_files(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    out = tmp_path / "out"
    proc, _ = run_cmd(["run", str(ROOT / "specs" / "tiny_eval.ppspec"), "--set", "mesh.tp=1", "--set", "train.steps=4",
                       "--set", "train.log_every=2", "--set", "train.metrics=tensorboard", "--set",
                       "train.peak_tflops=0.1", "--set", "train.save_final=false", "--nproc", "2", "--out", str(out)])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "\r" not in proc.stdout  # stdout is a pipe: plain lines
    assert "eval 4/4 | loss" in proc.stdout and "| ppl " in proc.stdout and "| mfu " in proc.stdout
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in lines] == [("train", 2), ("train", 4), ("eval", 4)]
    assert lines[0]["mfu"] > 0 and lines[0]["eta_s"] >= 0 and lines[2]["eval_perplexity"] > 1
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
