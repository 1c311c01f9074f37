"""Expert parallelism (mesh.ep, runtime/parallel/expert.py): the experts of each MoE layer divided
over ep of the data-parallel ranks, tokens exchanged by all-to-all. Tiny Mixtral, Qwen2-MoE
(shared expert replicated), Qwen3-MoE and OLMoE (all their own forward) train two steps in a spawned
world of 4 (gloo) against the single-process reference: ep 2 alone, with pp 2, with tp 2 and with
interleaved + activation checkpointing. check refuses the wrong specs at the right place; a
checkpoint saved at ep 2 resumes at ep 1 with the uninterrupted run's losses.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from _exec_harness import equivalence_worker
from _run_helpers import full_tensors, resume_resharded
from dist_harness import run_distributed

pytest.importorskip("transformers")

_ATTN = dict(vocab_size=128, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=64, num_experts_per_tok=2)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "mixtral": ("MixtralForCausalLM", {**_ATTN, "intermediate_size": 48, "num_local_experts": 8}),
    "qwen2_moe": ("Qwen2MoeForCausalLM", {**_ATTN, "intermediate_size": 48, "moe_intermediate_size": 24,
                                          "shared_expert_intermediate_size": 40, "num_experts": 4}),
    "qwen3_moe": ("Qwen3MoeForCausalLM", {**_ATTN, "intermediate_size": 48, "moe_intermediate_size": 24,
                                          "num_experts": 4}),
    "olmoe": ("OlmoeForCausalLM", {**_ATTN, "intermediate_size": 24, "num_experts": 4}),
}
_TP = """tensor_parallel {
  model.layers[*].self_attn.q_proj : column
  model.layers[*].self_attn.k_proj : column
  model.layers[*].self_attn.v_proj : column
  model.layers[*].self_attn.o_proj : row
}
"""


def spec_text(case: str, mesh: str = "ep = 2", pipeline: str = "microbatches = 2", train: str = "",
              extra: str = "") -> str:
    cls, config = CASES[case]
    values = ", ".join(f"{k} = {json.dumps(v)}" for k, v in config.items())
    return f"""ppspec 1
model {case} {{
  source = hf("{cls}")
  config {{ {values} }}
}}
mesh {{ {mesh} }}
{extra}pipeline {{ {pipeline} }}
train {{ global_batch = 8, seq_len = 16, steps = 2, optimizer = adamw(lr = 0.01), grad_clip = 1.0,
        data = synthetic(seed = 0){train} }}
"""


def _checked(tmp_path: Path, text: str, world: int = 4, model: bool = True) -> Any:
    from ppdsl.dsl.check import check_file

    path = tmp_path / f"spec_{len(list(tmp_path.iterdir()))}.ppspec"
    path.write_text(text, encoding="utf-8")
    return check_file(path, world=world, model=model)


def _plan(tmp_path: Path, text: str) -> Any:
    from ppdsl.lowering.lower import lower

    result = _checked(tmp_path, text)
    errors = [f"{d.code} {d.message}" for d in result.diagnostics if d.is_error]
    assert result.ok and not errors, errors
    return lower(result.spec, 4, result.model_info)


RUNS = {
    "mixtral ep 2 (dp 4)": ("mixtral", {}),
    "mixtral ep 2 x pp 2": ("mixtral", dict(mesh="pp = 2, ep = 2")),
    "mixtral ep 2 x tp 2": ("mixtral", dict(mesh="tp = 2, ep = 2", extra=_TP)),
    "mixtral ep 2 x pp 2 interleaved + activation checkpointing": (
        "mixtral", dict(mesh="pp = 2, ep = 2", pipeline="style = interleaved, chunks = 2, microbatches = 4",
                        train=", activation_checkpointing = true")),
    "qwen2_moe ep 2 (dp 4)": ("qwen2_moe", {}),
    "qwen2_moe ep 2 x pp 2": ("qwen2_moe", dict(mesh="pp = 2, ep = 2")),
    "qwen3_moe ep 2 x pp 2": ("qwen3_moe", dict(mesh="pp = 2, ep = 2")),
    "olmoe ep 2 x pp 2": ("olmoe", dict(mesh="pp = 2, ep = 2")),
}


@pytest.mark.distributed
def test_ep2_matches_one_process(tmp_path: Path) -> None:
    plans = []
    for name, (case, kw) in RUNS.items():
        plan = _plan(tmp_path, spec_text(case, **kw))
        assert plan.mesh.ep == 2 and plan.experts, name
        plans.append(plan)
    reports = run_distributed(equivalence_worker, 4, plans, timeout=90 + 30 * len(plans))[0]
    for name, (report, _seconds) in zip(RUNS, reports):
        assert report.ok, (name, report.render())
        assert abs(report.losses[0][0] - report.losses[0][1]) <= 1e-6, name


def test_the_plan_divides_the_experts_and_round_trips(tmp_path: Path) -> None:
    from ppdsl.lowering.plan import Plan
    from ppdsl.views.report import plan_report

    plan = _plan(tmp_path, spec_text("mixtral", mesh="pp = 2, ep = 2"))
    assert [e.path for e in plan.experts] == [f"model.layers.{i}.mlp.experts" for i in range(4)]
    assert {e.experts for e in plan.experts} == {8}
    assert Plan.from_json(json.loads(plan.dumps())) == plan
    with_ep = plan_report(plan, _checked(tmp_path, spec_text("mixtral", mesh="pp = 2, ep = 2")).model_info)
    without = plan_report(_plan(tmp_path, spec_text("mixtral", mesh="pp = 2")),
                          _checked(tmp_path, spec_text("mixtral", mesh="pp = 2")).model_info)
    text = with_ep.render()
    assert "each rank holds 4 of the 8 experts" in text and "ep/step" in text
    expert_params = 8 * (2 * 48 * 32 + 32 * 48)  # per layer: gate_up_proj + down_proj
    for a, b in zip(with_ep.rows, without.rows):
        assert b.params - a.params == 2 * expert_params // 2  # 2 MoE layers per rank, half their experts
        assert a.ep_bytes > 0 and b.ep_bytes == 0 and a.experts == 4


def test_mesh_groups() -> None:
    from ppdsl.lowering.plan import MeshLayout

    m = MeshLayout(8, 4, 2, 1, ep=2)  # dp 4 x pp 2
    assert m.ep_group(0) == (0, 2) and m.ep_group(4) == (4, 6) and m.ep_group(1) == (1, 3)
    assert m.expert_replicas(0) == (0, 4) and m.expert_replicas(2) == (2, 6)
    assert [m.ep_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]


@pytest.mark.parametrize("mesh, train, pipeline, code, at", [
    ("ep = 3", "", "microbatches = 2", "E0240", "ep = 3"),
    ("ep = 2", ", zero = 1", "microbatches = 2", "E0241", "zero = 1"),
    ("pp = 2, ep = 2", "", "style = zbh1, microbatches = 2", "E0241", "style = zbh1"),
    ("ep = 4", "", "microbatches = 2", "E0243", "ep = 4"),
])
def test_wrong_ep_specs_point_at_their_line(tmp_path: Path, mesh: str, train: str, pipeline: str, code: str,
                                           at: str) -> None:
    text = spec_text("qwen2_moe", mesh=mesh, train=train, pipeline=pipeline).replace("num_experts = 4", "num_experts = 6")
    result = _checked(tmp_path, text, model=False)
    found = [d for d in result.diagnostics if d.code == code]
    assert not result.ok and found, [f"{d.code} {d.message}" for d in result.diagnostics]
    line = next(i for i, s in enumerate(text.splitlines(), 1) if at in s)
    assert found[0].span.line == line, (found[0].span, line)


def test_ep_with_a_dense_model_is_refused(tmp_path: Path) -> None:
    text = """ppspec 1
model llama {
  source = hf("LlamaForCausalLM")
  config { vocab_size = 128, hidden_size = 32, intermediate_size = 48, num_hidden_layers = 2, num_attention_heads = 4 }
}
mesh { ep = 2 }
train { global_batch = 8, seq_len = 16 }
"""
    result = _checked(tmp_path, text)
    found = [d for d in result.diagnostics if d.code == "E0242"]
    assert not result.ok and found and found[0].span.line == 6, [f"{d.code} {d.message}" for d in result.diagnostics]


@pytest.mark.distributed
def test_a_checkpoint_saved_at_ep2_resumes_at_ep1(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    text = spec_text("mixtral").replace("steps = 2", f'steps = 4, checkpoint {{ dir = "{ck}", every = 2 }}')
    spec = tmp_path / "moe.ppspec"
    spec.write_text(text, encoding="utf-8")
    want, got, output = resume_resharded(tmp_path, spec, ck, 2, ["mesh.ep=1"])  # dp 2: ep 2, then ep 1
    saved = full_tensors(ck / "step-000004")
    assert saved["model/model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 96, 32)  # global coordinates
    assert "resharding checkpoint step-000002 from mesh dp=2 pp=1 tp=1 ep=2" in output
    assert sorted(got) == [3, 4]
    for step in (3, 4):
        assert abs(got[step] - want[step]) <= 1e-6, (step, got[step], want[step])
