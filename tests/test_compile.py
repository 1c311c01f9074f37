"""train.compile: each block through torch.compile (runtime.parallel.parallelize.apply_compile)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ppdsl.core.schedules import STYLES
from ppdsl.dsl.check import check_file
from ppdsl.lowering.lower import lower

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "specs" / "tiny_cpu.ppspec")


@pytest.mark.parametrize("style", sorted(s for s, info in STYLES.items() if info.split_backward))
def test_compile_with_a_split_backward_style_is_refused_at_its_line(style: str) -> None:
    chunks = 1 if STYLES[style].chunks == "== 1" else 2
    r = check_file(TINY, world=4, model=False, overrides=["train.compile=true", f"pipeline.style={style}",
                                                          f"pipeline.chunks={chunks}", "pipeline.microbatches=4"])
    bad = [d for d in r.diagnostics if d.is_error]
    assert [d.code for d in bad] == ["E0332"], [d.message for d in bad]
    assert bad[0].span is not None and (bad[0].span.line, bad[0].span.column) == (1, 13)  # the --set, as written


def test_the_plan_carries_compile() -> None:
    r = check_file(TINY, world=4, model=False, overrides=["train.compile=true"])
    assert r.ok
    assert lower(r.spec, 4).train.compile is True
    assert lower(check_file(TINY, world=4, model=False).spec, 4).train.compile is False


def test_the_step_line_counts_graphs_breaks_and_cache() -> None:
    from ppdsl.runtime.train.metrics import StepRecord, format_progress

    rec = StepRecord(1, 4.0, 1e-3, None, 1.0, 10.0, 100.0,
                     compile={"graphs": 9, "graph_breaks": 12, "cache_hits": 15, "cache_misses": 0})
    assert "compiled 9 graph(s), 12 break(s), cache 15 hit(s) / 0 miss(es)" in format_progress(rec, 10)
    assert "compile" not in StepRecord(1, 4.0, 1e-3, None, 1.0, 10.0, 100.0).to_json()


@pytest.mark.slow
@pytest.mark.distributed
def test_compiled_blocks_verify_at_pp2_tp2() -> None:
    """Compiling takes about 30 s a rank on 2 cores: a slow test."""
    out = subprocess.run([str(Path(sys.executable).with_name("ppdsl")), "verify", TINY, "--world", "4", "--steps", "2",
                          "--set", "train.compile=true"], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0 and out.stdout.rstrip().endswith("OK"), out.stdout[-2000:] + out.stderr[-2000:]
