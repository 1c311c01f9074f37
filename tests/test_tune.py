"""ppdsl tune: the cost model (lowering.costs), the layout enumeration, the spec rewriting."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ppdsl.dsl.check import check_text
from ppdsl.dsl.parse import parse
from ppdsl.lowering.costs import (
    CommModel, CostProfile, Layout, Linear, PartCost, calibration_factor, measured_split, predict,
)
from ppdsl.core.schedules import generate, style_problem
from ppdsl.core.schedules.simulate import simulate
from ppdsl.tune import LAYOUT_KEYS, best_spec_text, candidate_layouts, layout_overrides, rewrite_layout, valid_layouts

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "specs" / "tiny_cpu.ppspec"
NO_COMM = CommModel(0.0, 0.0, 0.0, 0.0)


def part(f: float, b: float, w: float, params: int = 1000, act: float = 100.0) -> PartCost:
    return PartCost(Linear(0.0, f), Linear(0.0, b), Linear(0.0, w), Linear(0.0, act), params)


def profile(blocks: int = 4, first: PartCost | None = None, last: PartCost | None = None,
            comm: CommModel = NO_COMM, cpus: int = 64) -> CostProfile:
    zero = part(0.0, 0.0, 0.0, 0, 0.0)
    return CostProfile("test", 32, (1, 8), tuple(part(1.0, 1.0, 1.0) for _ in range(blocks)), first or zero,
                       last or zero, Linear(0.0, 10.0), 0.0, comm, cpus, "cpu")


def test_linear_fit_passes_through_both_points_and_never_goes_negative() -> None:
    line = Linear.fit(1, 3.0, 8, 10.0)
    assert line.at(1) == pytest.approx(3.0) and line.at(8) == pytest.approx(10.0)
    assert Linear.fit(1, 5.0, 8, 1.0).per_sample == 0.0  # noise made it fall: flat, not negative
    assert Linear(-1.0, 0.1).at(1) == 0.0


def test_allreduce_model_is_the_benchmark_at_two_and_a_ring_above() -> None:
    comm = CommModel(0.0, 0.0, 1e-3, 1e-9)
    assert comm.allreduce(1e6, 1) == 0.0
    assert comm.allreduce(1e6, 2) == pytest.approx(1e-3 + 1e-3)
    assert comm.allreduce(1e6, 4) == pytest.approx(3e-3 + 1.5e-3)


def test_unit_profile_predicts_the_unit_cost_simulation() -> None:
    # one block per stage, F = B = W = 1 per sample, microbatch size 1: the simulator's unit costs
    prof = profile()
    for style, chunks in (("1f1b", 1), ("zbh1", 1), ("gpipe", 1)):
        layout = Layout(1, 4, 1, style, chunks, 8)
        pred = predict(prof, layout, global_batch=8, world=4)
        schedule = generate(style, 4, 8, chunks)
        unit = simulate(schedule, lambda a: 2.0 if (a.op.value == "B" and not schedule.split_backward) else 1.0)
        assert pred.pipeline_s == pytest.approx(unit.makespan)
        assert pred.bubble == pytest.approx(unit.bubble)
        assert pred.split == ((0, 1), (1, 2), (2, 3), (3, 4))


def test_measured_split_moves_blocks_off_a_heavy_head() -> None:
    prof = profile(blocks=8, last=part(3.0, 3.0, 3.0))
    split = measured_split(prof, 4, samples=1)
    assert split[-1] == (7, 8) and max(b - a for a, b in split) == 3  # the head's stage holds one block
    even = predict(prof, Layout(1, 4, 1, "1f1b", 1, 8), 8, 4, balance="even")
    measured = predict(prof, Layout(1, 4, 1, "1f1b", 1, 8), 8, 4)
    assert measured.step_s < even.step_s


def test_oversubscribed_cpu_slows_compute_and_tp_pays_its_allreduces() -> None:
    fast = predict(profile(cpus=4), Layout(1, 4, 1, "1f1b", 1, 8), 8, 4)
    slow = predict(profile(cpus=2), Layout(1, 4, 1, "1f1b", 1, 8), 8, 4)
    assert slow.pipeline_s == pytest.approx(2 * fast.pipeline_s)
    comm = CommModel(0.0, 0.0, 0.5, 0.0)
    tp = predict(profile(comm=comm), Layout(2, 2, 1, "1f1b", 1, 8), 8, 4)
    no_tp = predict(profile(comm=NO_COMM), Layout(2, 2, 1, "1f1b", 1, 8), 8, 4)
    assert tp.pipeline_s > no_tp.pipeline_s


def test_tune_memory_is_the_plans_rank_memory() -> None:
    # each candidate's memory column is its lowered plan's largest rank (lowering/rank_memory.py), at the
    # split tune predicts: the figure `ppdsl plan` prints for the same layout
    from ppdsl.lowering.lower import lower
    from ppdsl.tune import render_table, with_memory
    from ppdsl.views.report import plan_report

    text = TINY.read_text()
    layouts = [Layout(1, 2, 2, "1f1b", 1, 2), Layout(1, 2, 2, "1f1b", 1, 2, activation_checkpointing=True)]
    checked: dict = {}
    valid, refused = valid_layouts(text, str(TINY), 4, layouts, checked=checked)
    assert valid == layouts and refused == 0
    prof = profile(last=part(3.0, 3.0, 3.0))  # a heavy head: the measured split is not the even one
    preds = with_memory([predict(prof, layout, 8, 4) for layout in valid], valid, checked, 4, {})
    plain, ac = preds
    assert plain.split == ((0, 3), (3, 4))
    for p in preds:
        assert p.layout.split == p.split  # layout_overrides writes it as pipeline.split
        result = check_text(text, str(TINY), 4, layout_overrides(p.layout), model=True)
        assert result.ok, result.diagnostics
        rows = plan_report(lower(result.spec, 4, result.model_info), result.model_info,
                           result.spec.model.dims.get("hidden")).rows
        assert p.memory_bytes == max(r.memory_bytes for r in rows)
    assert ac.memory_bytes < plain.memory_bytes and ac.step_s > plain.step_s
    assert f"{plain.memory_bytes / 2**20:.1f} MiB" in render_table(preds, 2)


def test_calibration_scales_compute_by_the_traced_over_the_predicted_action_time() -> None:
    prof = profile(cpus=2)
    pred = predict(prof, Layout(1, 2, 1, "1f1b", 1, 2), 2, 2)  # two blocks per stage: F 2, B 4, W 2 per sample
    assert pred.action_s == ((2.0, 2.0, 2.0), (2.0, 2.0, 2.0))
    traced = [("F", 0, 3.0), ("B", 0, 6.0), ("F", 1, 3.0), ("B", 1, 6.0)]  # unsplit B counts B + W
    assert calibration_factor(pred, traced) == pytest.approx(1.5)
    calibrated = predict(CostProfile.from_json({**prof.to_json(), "contention": {"2": 1.5}}), pred.layout, 2, 2)
    assert calibrated.pipeline_s == pytest.approx(1.5 * pred.pipeline_s)


def test_profile_round_trips_through_json(tmp_path: Path) -> None:
    prof = profile(comm=CommModel(1e-4, 1e-9, 2e-4, 2e-9))
    assert CostProfile.load(prof.save(tmp_path / "p.json")) == prof
    data = json.loads((tmp_path / "p.json").read_text())
    data["version"] = 99
    with pytest.raises(ValueError, match="version"):
        CostProfile.from_json(data)


def test_candidates_obey_the_schedule_rules_and_cover_the_mesh_shapes() -> None:
    layouts = list(candidate_layouts(4, 8))
    assert all(style_problem(c.style, c.pp, c.microbatches, c.chunks) is None for c in layouts)
    assert all(c.tp * c.pp * c.dp == 4 and 8 % (c.dp * c.microbatches) == 0 for c in layouts)
    assert {(c.tp, c.pp, c.dp) for c in layouts} == {(1, 1, 4), (1, 2, 2), (1, 4, 1), (2, 1, 2), (2, 2, 1), (4, 1, 1)}
    assert any(c.sequence_parallel for c in layouts) and any(c.activation_checkpointing for c in layouts)


def test_valid_layouts_are_the_ones_check_accepts() -> None:
    text = TINY.read_text()
    some = [Layout(2, 2, 1, "1f1b", 1, 4), Layout(1, 4, 1, "zbv", 2, 4), Layout(1, 2, 2, "interleaved", 2, 4),
            Layout(1, 4, 1, "interleaved", 2, 4)]  # zbv: 8 stages on 4 blocks; interleaved needs m % pp == 0
    ok, refused = valid_layouts(text, str(TINY), 4, some, model=False)
    assert ok == [some[0], some[2]] and refused == 2
    for layout in ok:
        assert check_text(text, str(TINY), 4, layout_overrides(layout)).ok


def _entries(text: str) -> dict[tuple[str, str], str]:
    """(block, key) -> value text, for the top-level blocks' assignments."""
    doc = parse(text, "x")
    lines = text.splitlines()
    out = {}
    for b in doc.items:
        for e in getattr(b, "entries", ()):
            if hasattr(e, "key"):
                v = e.value.span
                out[(b.kind, e.key)] = lines[v.line - 1][v.column - 1: v.end_column - 1] if v.line == v.end_line else "..."
            else:
                out[(b.kind, lines[e.span.line - 1].strip())] = ""
    return out


def test_the_written_spec_differs_only_in_layout_keys_and_checks() -> None:
    text = TINY.read_text()
    layout = Layout(1, 2, 2, "zbh1", 1, 2, activation_checkpointing=True, split=((0, 3), (3, 4)))
    out = best_spec_text(text, str(TINY), layout)
    assert check_text(out, "best", 4).ok
    before, after = _entries(text), _entries(out)
    changed = {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}
    assert changed and changed <= set(LAYOUT_KEYS)
    assert after[("pipeline", "split")] == "[0:3, 3:4]" and after[("mesh", "tp")] == "1"
    # comments and the unchanged lines are kept byte for byte
    kept = [line for line in text.splitlines() if line.lstrip().startswith("#") or "tok_embeddings" in line]
    assert all(line in out.splitlines() for line in kept)


def test_rewrite_adds_to_one_line_blocks_and_adds_missing_blocks() -> None:
    text = "ppspec 1\nmesh { tp = 2 }\n"
    out = rewrite_layout(text, "x", {("mesh", "tp"): "1", ("mesh", "pp"): "2", ("train", "activation_checkpointing"): "true"})
    assert "mesh { tp = 1, pp = 2 }" in out
    assert "train {\n  activation_checkpointing = true\n}" in out
    assert parse(out, "x")


def test_tune_cli_ranks_writes_a_valid_spec_from_a_given_profile(tmp_path: Path) -> None:
    prof = profile(blocks=4, first=part(0.1, 0.0, 0.1), last=part(2.0, 1.0, 1.0),
                   comm=CommModel(1e-4, 1e-9, 1e-4, 1e-9), cpus=2)
    path = prof.save(tmp_path / "profile.json")
    best = tmp_path / "best.ppspec"
    proc = subprocess.run([sys.executable, "-m", "ppdsl", "tune", str(TINY), "--world", "4", "--profile", str(path),
                           "--memory", "1", "-o", str(best), "--top", "3", "--no-calibrate"],
                          capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "proved valid by check" in proc.stdout and "why the top ones win" in proc.stdout
    assert check_text(best.read_text(), str(best), 4).ok


@pytest.mark.slow
@pytest.mark.distributed
def test_tune_measures_the_top_layout(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "ppdsl", "tune", str(TINY), "--world", "2", "--measure", "1",
                           "--steps", "2", "--profile", str(tmp_path / "profile.json")],
                          capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    assert "prediction error: median" in proc.stdout
    assert "memory error (the largest rank, predicted against the peak of live tensor bytes)" in proc.stdout
    assert (tmp_path / "profile.json").exists()


def test_candidates_with_context_and_expert_parallel_sizes() -> None:
    layouts = list(candidate_layouts(4, 8, cp_sizes=(1, 2), ep_sizes=(1, 2)))
    assert all(c.tp * c.pp * c.cp * c.dp == 4 and c.dp % c.ep == 0 for c in layouts)
    assert {(c.tp, c.pp, c.cp, c.dp) for c in layouts if c.cp == 2} == {(1, 1, 2, 2), (1, 2, 2, 1), (2, 1, 2, 1)}
    assert any(c.ep == 2 and c.cp == 1 for c in layouts) and "cp2" in Layout(1, 1, 2, "1f1b", 1, 1, cp=2).label()


def test_context_parallelism_divides_each_ranks_work_and_adds_the_key_value_gathers() -> None:
    comm = CommModel(0.0, 0.0, 1e-3, 1e-6)
    prof = profile(comm=comm)
    plain = predict(prof, Layout(1, 1, 1, "1f1b", 1, 1), 4, 2)
    split = predict(prof, Layout(1, 1, 1, "1f1b", 1, 1, cp=2), 4, 2)
    free = predict(profile(), Layout(1, 1, 1, "1f1b", 1, 1, cp=2), 4, 2)
    assert free.pipeline_s == pytest.approx(predict(profile(), Layout(1, 1, 1, "1f1b", 1, 1), 4, 2).pipeline_s / 2)
    assert split.pipeline_s > free.pipeline_s and split.dp_sync_s > plain.dp_sync_s  # gathers; grads over cp


def test_search_axes_try_cp_for_causal_decoders_and_ep_for_experts(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from ppdsl.tune import search_axes

    decoder = """ppspec 1
model llama {
  source = hf("LlamaForCausalLM")
  config { vocab_size = 128, hidden_size = 32, intermediate_size = 48, num_hidden_layers = 2, num_attention_heads = 4 }
}
train { global_batch = 8, seq_len = 16 }
"""
    assert search_axes(decoder, "llama.ppspec", 4) == ([1, 2, 4], [1])
    assert search_axes(decoder.replace("seq_len = 16", "seq_len = 12"), "llama.ppspec", 4) == ([1, 2], [1])
    moe = decoder.replace("LlamaForCausalLM", "MixtralForCausalLM").replace(
        "num_attention_heads = 4", "num_attention_heads = 4, num_local_experts = 4, num_experts_per_tok = 2")
    assert search_axes(moe, "moe.ppspec", 4)[1] == [1, 2, 4]
    bloom = decoder.replace("LlamaForCausalLM", "BloomForCausalLM").replace(
        "hidden_size = 32, intermediate_size = 48, num_hidden_layers = 2, num_attention_heads = 4",
        "hidden_size = 32, n_layer = 2, n_head = 4")
    assert search_axes(bloom, "bloom.ppspec", 4)[0] == [1]
    best = best_spec_text(decoder, "llama.ppspec", Layout(1, 1, 2, "1f1b", 1, 1, cp=2))
    assert "cp = 2" in best and "ep" not in best
    assert "cp" not in best_spec_text(decoder, "llama.ppspec", Layout(1, 1, 4, "1f1b", 1, 1))


def test_each_candidate_passes_the_model_level_rules_of_its_own_chunks_and_sequence_parallelism() -> None:
    # BART's own forward cuts its 2 encoder blocks: interleaved (4 virtual stages) is E0308 and
    # sequence parallelism is E0423, though 1f1b at the same mesh is accepted; each memory
    # figure lowers the candidate with the traced layout (it crashed on an own forward before)
    from ppdsl.tune import with_memory

    spec = ROOT / "specs" / "bart.ppspec"
    text = spec.read_text()
    some = [Layout(1, 2, 2, "1f1b", 1, 2), Layout(1, 2, 2, "interleaved", 2, 2),
            Layout(2, 2, 1, "1f1b", 1, 2), Layout(2, 2, 1, "1f1b", 1, 2, sequence_parallel=True)]
    checked: dict = {}
    ok, refused = valid_layouts(text, str(spec), 4, some, checked=checked)
    assert ok == [some[0], some[2]] and refused == 2
    for layout in some:
        assert check_text(text, str(spec), 4, layout_overrides(layout), model=True).ok == (layout in ok)
    preds = with_memory([predict(profile(blocks=2), layout, 8, 4) for layout in ok], ok, checked, 4, {})
    assert all(p.memory_bytes for p in preds)
