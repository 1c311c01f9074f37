"""Context parallelism (mesh.cp, runtime/parallel/context.py): each sequence split over cp ranks in
head-tail chunks, attention over the whole sequence by an all-gather of keys and values. Tiny Llama
(family), GPT-2 (absolute positions), Qwen3 and OLMo-2 (its own forward) train two steps in a
spawned world of 4 (gloo) against the single-process reference: cp 2 with pp 2, with tp 2 (vocab-
parallel loss), with dp 2, and interleaved with activation checkpointing. check refuses the wrong
specs at the right place; a checkpoint saved at cp 2 resumes at cp 1 with the uninterrupted losses.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from _exec_harness import equivalence_worker
from _tiny_models import TINY
from _run_helpers import resume_resharded
from dist_harness import run_distributed

pytest.importorskip("transformers")

# the cases' tiny models (tests/_tiny_models.py) at 4 blocks, attending to the whole sequence
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    name: (TINY[name].hf_class, {**TINY[name].config, TINY[name].layers: 4, **override})
    for name, override in {
        "llama": {}, "qwen3": dict(use_sliding_window=False), "olmo2": {}, "gpt2": {},
        "mistral": dict(sliding_window=8), "opt": {}, "bloom": {},
    }.items()
}
_TP = """tensor_parallel {
  model.embed_tokens : vocab
  model.layers[*].self_attn.q_proj : column
  model.layers[*].self_attn.k_proj : column
  model.layers[*].self_attn.v_proj : column
  model.layers[*].self_attn.o_proj : row
  model.layers[*].mlp.gate_proj : column
  model.layers[*].mlp.up_proj : column
  model.layers[*].mlp.down_proj : row
  lm_head : column
}
"""


def spec_text(case: str, mesh: str = "cp = 2, pp = 2", pipeline: str = "microbatches = 2", train: str = "",
              extra: str = "", seq_len: int = 16, optimizer: str = "adamw(lr = 0.01)") -> str:
    cls, config = CASES[case]
    values = ", ".join(f"{k} = {json.dumps(v)}" for k, v in config.items())
    return f"""ppspec 1
model {case} {{
  source = hf("{cls}")
  config {{ {values} }}
}}
mesh {{ {mesh} }}
{extra}pipeline {{ {pipeline} }}
train {{ global_batch = 8, seq_len = {seq_len}, steps = 2, optimizer = {optimizer}, grad_clip = 1.0,
        data = synthetic(seed = 0){train} }}
"""


def _checked(tmp_path: Path, text: str, world: int = 4, model: bool = True) -> Any:
    from ppdsl.dsl.check import check_file

    path = tmp_path / f"spec_{len(list(tmp_path.iterdir()))}.ppspec"
    path.write_text(text, encoding="utf-8")
    return check_file(path, world=world, model=model)


def _plan(tmp_path: Path, text: str, world: int = 4) -> Any:
    from ppdsl.lowering.lower import lower

    result = _checked(tmp_path, text, world)
    errors = [f"{d.code} {d.message}" for d in result.diagnostics if d.is_error]
    assert result.ok and not errors, errors
    return lower(result.spec, world, result.model_info)


RUNS = {
    "llama cp 2 x pp 2": ("llama", {}),
    "llama cp 2 x tp 2 (vocab-parallel loss)": ("llama", dict(mesh="cp = 2, tp = 2", extra=_TP)),
    "llama cp 2 x dp 2": ("llama", dict(mesh="cp = 2")),
    "llama cp 2 x pp 2 interleaved + activation checkpointing": (
        "llama", dict(pipeline="style = interleaved, chunks = 2, microbatches = 4",
                      train=", activation_checkpointing = true")),
    # sgd: GPT-2's zero-initialised biases get near-zero first gradients, whose sign adam's first
    # update turns into +-lr (fp32 noise in step 1, 3e-7 relative, becomes 2e-4 in the parameters)
    "gpt2 cp 2 x pp 2 (absolute positions)": ("gpt2", dict(optimizer="sgd(lr = 0.1)")),
    "qwen3 cp 2 x pp 2": ("qwen3", {}),
    "opt cp 2 x pp 2 (learned positions offset by 2)": ("opt", dict(optimizer="sgd(lr = 0.1)")),
    # sgd as above: Olmo2's q / k norms get near-zero first gradients (fp32 drift 2e-4 under adam, 1e-14 in fp64)
    "olmo2 cp 2 x pp 2 (own forward)": ("olmo2", dict(optimizer="sgd(lr = 0.1)")),
}


@pytest.mark.distributed
def test_cp2_matches_one_process(tmp_path: Path) -> None:
    plans = []
    for name, (case, kw) in RUNS.items():
        plan = _plan(tmp_path, spec_text(case, **kw))
        assert plan.mesh.cp == 2 and len(plan.context_attention) == 4, name
        plans.append(plan)
    reports = run_distributed(equivalence_worker, 4, plans, timeout=90 + 30 * len(plans))[0]
    for name, (report, _seconds) in zip(RUNS, reports):
        assert report.ok, (name, report.render())
        for parallel, reference in report.losses:
            assert abs(parallel - reference) <= 1e-6, (name, report.losses)


def test_shards_put_back_together_are_the_sequence() -> None:
    import torch

    from ppdsl.core.task_loss import shifted_labels
    from ppdsl.runtime.parallel.context import local_positions, shard_microbatch
    from ppdsl.runtime.stage.build import MicroBatch

    ids = torch.arange(2 * 24).view(2, 24)
    mb = MicroBatch(input_ids=ids, labels=ids.clone())
    assert local_positions(24, 3, 0).tolist() == [0, 1, 2, 3, 20, 21, 22, 23]  # chunks 0 and 5 of 6
    assert local_positions(24, 3, 2).tolist() == [8, 9, 10, 11, 12, 13, 14, 15]  # chunks 2 and 3
    shards = [shard_microbatch(mb, 3, r) for r in range(3)]
    order = torch.cat([s.sequence_shard.position_ids[0] for s in shards])
    assert sorted(order.tolist()) == list(range(24))
    back = torch.empty_like(ids)
    targets = torch.empty_like(ids)
    for s in shards:
        back[:, s.sequence_shard.position_ids[0]] = s.input_ids
        targets[:, s.sequence_shard.position_ids[0]] = s.sequence_shard.targets
    assert torch.equal(back, ids) and torch.equal(targets, shifted_labels(ids))
    assert {s.sequence_shard.scale for s in shards} == {3 / (2 * 23)}  # cp / (the microbatch's targets)


def test_mesh_layout_with_cp() -> None:
    from ppdsl.lowering.plan import MeshLayout, Plan

    m = MeshLayout(8, 2, 2, 1, cp=2)  # dp 2 x cp 2 x pp 2
    assert [m.coords(r)["cp"] for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [m.coords(r)["dp"] for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert all(m.rank_of(**{k: v for k, v in m.coords(r).items()}) == r for r in range(8))
    assert m.group("cp", 0) == (0, 2) and m.group("pp", 2) == (2, 3) and m.group("dp", 2) == (2, 6)
    assert m.replica_group(0) == (0, 2, 4, 6) and m.replicas == 4
    assert MeshLayout(4, 4, 1, 1).coords(3) == {"dp": 3, "cp": 0, "pp": 0, "tp": 0}  # cp = 1: as before
    assert Plan is not None


def test_the_plan_shows_the_tokens_each_rank_holds_and_round_trips(tmp_path: Path) -> None:
    from ppdsl.lowering.plan import Plan
    from ppdsl.views.report import plan_report

    text = spec_text("llama", seq_len=32)
    plan = _plan(tmp_path, text)
    assert plan.context_attention == tuple(f"model.layers.{i}.self_attn" for i in range(4))
    assert Plan.from_json(json.loads(plan.dumps())) == plan
    with_cp = plan_report(plan, _checked(tmp_path, text).model_info)
    one = spec_text("llama", mesh="pp = 2", seq_len=32)  # the same replica on 2 ranks
    without = plan_report(_plan(tmp_path, one, 2), _checked(tmp_path, one, 2).model_info)
    rendered = with_cp.render()
    assert "world 4 = dp 1 x cp 2 x pp 2 x tp 1" in rendered and "16 of 32 tokens" in rendered
    assert "cp/step" in rendered
    for a, b in zip(with_cp.rows, without.rows * 2):
        assert a.activation_bytes * 2 == b.activation_bytes and a.p2p_bytes * 2 == b.p2p_bytes
        # 2 layers x 2 microbatches x (forward + backward 2x) x keys+values of 4 x 32 tokens x 16 features
        assert a.cp_bytes == 2 * 2 * 3 * (2 * 4 * 32 * 16 * 4) // 2


@pytest.mark.parametrize("case, mesh, train, pipeline, code, at", [
    ("llama", "cp = 2", ", zero = 1", "microbatches = 2", "E0244", "zero = 1"),
    ("llama", "cp = 2, pp = 2", "", "style = zbh1, microbatches = 2", "E0244", "style = zbh1"),
    ("llama", "cp = 4", "", "microbatches = 1", "E0245", "seq_len = 12"),
    ("llama", "cp = 3, ep = 1", "", "microbatches = 1", "E0201", "mesh {"),
])
def test_wrong_cp_specs_point_at_their_line(tmp_path: Path, case: str, mesh: str, train: str, pipeline: str,
                                           code: str, at: str) -> None:
    text = spec_text(case, mesh=mesh, train=train, pipeline=pipeline, seq_len=12 if code == "E0245" else 16)
    result = _checked(tmp_path, text, model=False)
    found = [d for d in result.diagnostics if d.code == code]
    assert not result.ok and found, [f"{d.code} {d.message}" for d in result.diagnostics]
    line = next(i for i, s in enumerate(text.splitlines(), 1) if at in s)
    assert found[0].span.line == line, (found[0].span, line)


def test_sequence_parallel_with_cp_is_refused(tmp_path: Path) -> None:
    text = spec_text("llama", mesh="cp = 2, tp = 2",
                     extra=_TP.replace("tensor_parallel {", "tensor_parallel {\n  sequence_parallel = true"))
    result = _checked(tmp_path, text, model=False)
    found = [d for d in result.diagnostics if d.code == "E0244"]
    assert found and "sequence_parallel" in found[0].message


@pytest.mark.parametrize("case, why", [
    ("mistral", "sliding window of 8 tokens"),
    ("bloom", "takes no position_ids"),
])
def test_cp_with_an_attention_it_cannot_split_is_refused_before_launch(tmp_path: Path, case: str, why: str) -> None:
    text = spec_text(case)
    result = _checked(tmp_path, text)
    found = [d for d in result.diagnostics if d.code == "E0246"]
    assert not result.ok and found, [f"{d.code} {d.message}" for d in result.diagnostics]
    assert why in found[0].message
    assert found[0].span.line == next(i for i, s in enumerate(text.splitlines(), 1) if "cp = 2" in s)


@pytest.mark.distributed
def test_a_checkpoint_saved_at_cp2_resumes_at_cp1(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    text = spec_text("llama", mesh="cp = 2").replace("steps = 2", f'steps = 4, checkpoint {{ dir = "{ck}", every = 2 }}')
    spec = tmp_path / "cp.ppspec"
    spec.write_text(text, encoding="utf-8")
    want, got, output = resume_resharded(tmp_path, spec, ck, 2, ["mesh.cp=1"])  # world 2: cp 2, then dp 2
    assert "resharding checkpoint step-000002 from mesh dp=1 pp=1 tp=1 cp=2" in output
    assert sorted(got) == [3, 4]
    for step in (3, 4):
        assert abs(got[step] - want[step]) <= 1e-6, (step, got[step], want[step])
