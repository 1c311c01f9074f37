"""Every registered model family runs at pp 2 x tp 2 with the numbers of one process, and so does
every class whose family was deleted because the own forward reproduces it (its case stays here).

For each family a tiny random config of its HF class goes through the real front end (a spec
text -> `ppdsl check` -> lowering, as `ppdsl run` does) and the resulting plan trains one step
in a spawned world of 4 (gloo, CPU) against the single-process reference (runtime.verify.compare):
loss within 1e-6, first-step gradients within 1e-5 (relative). 1F1B in the default run; a
second schedule style per family behind the `slow` marker (deselected by default; run with
`-m slow`). Dropout is 0 in every config.

Adding a family: a folder under core/families/, its line in the registry, its tiny model in
tests/_tiny_models.py and one entry in ALL_CASES below.
"""

from __future__ import annotations

import re

from pathlib import Path
from typing import Any

import pytest

from _exec_harness import equivalence_worker
from _tiny_models import TINY, tiny_plan, tiny_spec
from dist_harness import run_distributed

LAYERS = 4

# case -> (tiny model (tests/_tiny_models.py), config values over the model's, its split rules
# ("all": the blocks', the embedding's and the head's; "blocks": the blocks' only; "hf_plan": the
# rules the HF class declares), second style)
ALL_CASES: dict[str, tuple[str, dict[str, Any], str, str]] = {
    "gpt2": ("gpt2", {}, "all", "zbv"),
    "bert": ("bert", {}, "blocks", "interleaved"),
    "roberta": ("roberta", {}, "blocks", "gpipe"),
    "llama": ("llama", {}, "all", "zbh1"),
    "mistral": ("mistral", {}, "all", "interleaved"),
    "qwen2": ("qwen2", {}, "all", "gpipe"),
    "qwen3": ("qwen3", {}, "all", "zbv"),
    "gemma": ("gemma", {}, "all", "interleaved"),
    "gemma2": ("gemma2", {}, "all", "gpipe"),
    "phi3": ("phi3", {}, "all", "zbh1"),
    "mixtral": ("mixtral", {}, "all", "interleaved"),
    "gpt_neox": ("gpt_neox", {}, "all", "zbv"),
    "distilbert": ("distilbert", {}, "blocks", "interleaved"),
    "gptj": ("gptj", {}, "all", "gpipe"),
    "opt": ("opt", {}, "all", "zbh1"),
    "falcon": ("falcon", {}, "all", "interleaved"),
    # more cases through the same harness
    # one kv head at tp = 2: k_proj / v_proj kept whole on both ranks (the kv head replicated)
    "llama_kv_replicated": ("llama", {"num_key_value_heads": 1}, "all", "zbv"),
    # Falcon's multi-query [all q | k | v]: each rank its query heads and the one kv head, replicated
    "falcon_multi_query": ("falcon", {"multi_query": True}, "all", "zbh1"),
    # heads of 16 features over a hidden size of 32 (q_proj 32 -> 64): Qwen2Config declares no
    # head_dim, its modeling code reads one (a known key, core/build.py)
    "qwen2_head_dim": ("qwen2", {"head_dim": 16}, "all", "zbh1"),
    # the split rules LlamaForCausalLM declares (base_model_tp_plan + lm_head colwise_gather_output)
    "llama_hf_plan": ("llama", {}, "hf_plan", "gpipe"),
    # `hf_plan = true` for every family whose HF class declares a plan: Gemma's tied head stays
    # whole with its whole embedding, Phi-3's gather-then-split pairs become column(fused) -> row
    **{f"{family}_hf_plan": (family, {}, "hf_plan", "zbv") for family in ("mistral", "qwen2", "qwen3", "gemma", "phi3")},
}
# the cases that run a tiny model as the table has it, one per family
FAMILY_CASES = tuple(name for name, (model, config, splits, _) in ALL_CASES.items()
                     if name == model and not config and splits != "hf_plan")


def spec_text(name: str, style: str, **kw: Any) -> str:
    """The case's spec at pp 2 x tp 2: one step of 4 microbatches of 1, sgd(lr = 0.1);
    `kw`: more tiny_spec arguments."""
    args = _case_args(name, style)
    return tiny_spec(**{**args, **kw, "config": {**args["config"], **kw.get("config", {})}})


def _case_args(name: str, style: str) -> dict[str, Any]:
    model, config, splits, _ = ALL_CASES[name]
    hf_plan = splits == "hf_plan"
    return dict(family=model, style=style, pp=2, tp=2, microbatches=4, steps=1, optimizer="sgd(lr = 0.1)",
                num_layers=LAYERS, config=config, splits="none" if hf_plan else splits,
                tensor_parallel=["hf_plan = true"] if hf_plan else [])


def lowered_plan(name: str, style: str) -> Any:
    plan = tiny_plan(**_case_args(name, style))
    assert plan.model.family == expected_family(name), plan.model.family
    return plan


def expected_family(name: str) -> str:
    """The family a case runs in: its own, or "own" for a class whose family was deleted because the
    own forward reproduces it (docs/families.md, benchmarks/own_forward_vs_families.py)."""
    from ppdsl.core.families import REGISTRY

    family = ALL_CASES[name][0]
    return family if any(f.name == family for f in REGISTRY) else "own"


_results: dict[str, list[Any]] = {}


def _suite(tmp_path_factory: pytest.TempPathFactory, kind: str) -> list[Any]:
    if kind not in _results:
        plans = [lowered_plan(name, "1f1b" if kind == "default" else case[3]) for name, case in ALL_CASES.items()]
        _results[kind] = run_distributed(equivalence_worker, 4, plans, timeout=60 + 60 * len(plans))[0]
    return _results[kind]


def _assert_equivalent(report: Any) -> None:
    text = report.render()
    assert not report.problems, text
    assert report.max_loss_diff <= 1e-6, text
    assert report.first_step_grad_diff <= 1e-5, text
    assert report.ok, text


@pytest.mark.distributed
@pytest.mark.parametrize("index,name", list(enumerate(ALL_CASES)))
def test_family_1f1b_pp2_tp2(tmp_path_factory: pytest.TempPathFactory, index: int, name: str) -> None:
    report, _seconds = _suite(tmp_path_factory, "default")[index]
    _assert_equivalent(report)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("index,name", list(enumerate(ALL_CASES)))
def test_family_second_style_pp2_tp2(tmp_path_factory: pytest.TempPathFactory, index: int, name: str) -> None:
    report, _seconds = _suite(tmp_path_factory, "slow")[index]
    _assert_equivalent(report)


def test_registry_is_consistent() -> None:
    from ppdsl.core.families import REGISTRY, by_name, family_of, supported_hf_classes

    assert {f.name for f in REGISTRY if f.hf_classes} <= set(FAMILY_CASES), "every HF family has a case here"
    for fam in REGISTRY:
        for cls in fam.hf_classes:
            assert family_of("hf", cls, {}) is fam
            assert fam.defaults(cls), f"{cls}: no defaults read from its HF config class"
        assert by_name(fam.name) is fam
    assert "T5ForConditionalGeneration" not in supported_hf_classes()


def test_registry_layouts_come_from_the_hf_pipeline_plans(tmp_path: Path) -> None:
    """blocks / first / last: the HF class's base_model_pp_plan + _pp_plan where it declares them
    (parameter-free entries such as GPT-NeoX's emb_dropout left out), hand-written only where it
    declares none (in some supported release); the plan check lowers from those defaults passes the stage adapter's layout check."""
    from ppdsl.dsl.check import check_file
    from ppdsl.core.families import REGISTRY
    from ppdsl.runtime.stage.adapters import stage_adapter
    from ppdsl.core.families.descriptor import Layout, hf_pp_layout
    from ppdsl.lowering.lower import lower

    derived = set()
    for fam in REGISTRY:
        declared = {hf_pp_layout(spec, cls) for cls, spec in fam.hf_classes.items()} - {None}
        if declared:
            # a hand layout stays only for releases whose class declares none (GPT-J before 5)
            # and then says the same as the declared one
            assert fam.layout is None, f"{fam.name}: HF declares its layout, do not write it by hand"
            assert declared == {fam.pipeline_layout}
            derived.add(fam.name)
        else:
            assert fam.layout is not None, fam.name
    assert {"gemma", "gemma2", "phi3"} <= derived
    assert by_name_layout("gemma") == Layout("model.layers", ("model.embed_tokens",), ("model.norm", "lm_head"))
    for name in (n for n in FAMILY_CASES if expected_family(n) != "own"):  # the own forward's layout is traced
        path = tmp_path / f"{name}.ppspec"
        path.write_text(spec_text(name, "1f1b"), encoding="utf-8")
        result = check_file(path, world=4, model=False)
        assert result.ok, (name, [f"{d.code} {d.message}" for d in result.diagnostics])
        plan = lower(result.spec, 4, None)
        stage_adapter(plan.model.family).check_layout(plan)


def by_name_layout(name: str) -> Any:
    from ppdsl.core.families import by_name

    return by_name(name).pipeline_layout


def test_positions_default_from_the_family_config_class(tmp_path: Path) -> None:
    """Mixtral's max_position_embeddings default is MixtralConfig's (131072), not Llama's 2048, with
    no family of its own."""
    from ppdsl.dsl.check import check_file

    positions = f"    max_position_embeddings = {TINY['mixtral'].config['max_position_embeddings']}\n"
    text = spec_text("mixtral", "1f1b", seq_len=4096)
    assert positions in text
    text = text.replace(positions, "")
    path = tmp_path / "m.ppspec"
    path.write_text(text, encoding="utf-8")
    result = check_file(path, world=4, model=False)
    assert result.spec is not None and result.spec.model.dims["positions"] == 131072
    assert not any(d.code == "E0216" for d in result.diagnostics), [d.code for d in result.diagnostics]


CPMANT = """ppspec 1
model cpm {
  source = hf("CpmAntForCausalLM")
  config { vocab_size = 128, hidden_size = 32, num_attention_heads = 4, dim_head = 8, dim_ff = 64, num_hidden_layers = 2 }
}
mesh { pp = 2 }
pipeline { microbatches = 2 }
train { global_batch = 2, seq_len = 8, steps = 1, optimizer = adamw(lr = 1e-3), data = synthetic(seed = 0) }
"""


@pytest.mark.parametrize("command", [["plan", "--world", "2"], ["verify", "--world", "2"], ["run", "--nproc", "2"]])
def test_uncovered_class_refused_before_launch(tmp_path: Path, command: list[str],
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """`ppdsl run / verify / plan` on a class no family runs and whose own forward cannot be cut
    (CPM-Ant: its blocks read the position bias a module before them computes from the tokens):
    check refuses it (E0420), exit 2 before any worker starts."""
    from ppdsl import cli

    path = tmp_path / "cpm.ppspec"
    path.write_text(CPMANT, encoding="utf-8")
    args = [command[0], str(path), *command[1:]]
    if command[0] == "run":
        args += ["--out", str(tmp_path / "out")]
    code = cli.main(args)
    err = capsys.readouterr().err
    assert code == 2, err
    assert re.search(r"error\[E0420\]: CpmAntForCausalLM cannot be cut into pipeline stages: .*'cpmant.position_bias'",
                     err), err
    assert not (tmp_path / "out").exists()


def test_hf_pretrained_without_config_block_reads_config_json(tmp_path: Path) -> None:
    """check and run agree on the model's vocabulary: the plan records the dims resolved from
    dir/config.json, which synthetic data reads (no config block in the spec)."""
    import json

    from ppdsl.dsl.check import check_file
    from ppdsl.lowering.lower import lower
    from ppdsl.lowering.plan import Plan
    from ppdsl.runtime.data.batch import vocab_size_of

    model_dir = tmp_path / "gpt2"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 96, "n_embd": 32, "n_layer": 4,
        "n_head": 4, "n_positions": 64}), encoding="utf-8")
    spec = tmp_path / "ft.ppspec"
    spec.write_text("""ppspec 1
model ft { source = hf_pretrained("gpt2") }
mesh { pp = 2 }
pipeline { style = 1f1b, microbatches = 2 }
train { global_batch = 2, seq_len = 16, steps = 1, data = synthetic(seed = 0) }
""", encoding="utf-8")
    result = check_file(spec, world=2)  # GPT2LMHeadModel runs its own forward: lowering takes the trace
    assert result.ok and result.spec is not None, [d.message for d in result.diagnostics]
    plan = lower(result.spec, 2, result.model_info)
    assert plan.model.family == "own" and plan.model.config == (("experts_implementation", "eager"),)
    assert vocab_size_of(plan.model) == 96
    assert vocab_size_of(Plan.from_json(json.loads(plan.dumps())).model) == 96  # as the workers get it


def test_config_json_is_parsed_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """check's resolver and the model builder read an hf_pretrained directory's config.json
    through one reader (core.locate.read_pretrained_config) that parses it once per process,
    again only when the file changes."""
    import json
    import types

    from ppdsl.core import locate
    from ppdsl.dsl.check import check_file

    parsed = []
    monkeypatch.setattr(locate, "json", types.SimpleNamespace(load=lambda fh: parsed.append(fh.name) or json.load(fh)))
    model_dir = tmp_path / "gpt2"
    model_dir.mkdir()
    config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 96, "n_embd": 32,
              "n_layer": 4, "n_head": 4, "n_positions": 64}
    (model_dir / "config.json").write_text(json.dumps(config), encoding="utf-8")
    spec = tmp_path / "ft.ppspec"
    spec.write_text("""ppspec 1
model ft {
  source = hf_pretrained("gpt2")
  config { n_positions = 32 }
}
mesh { pp = 2 }
pipeline { style = 1f1b, microbatches = 2 }
train { global_batch = 2, seq_len = 16, steps = 1, data = synthetic(seed = 0) }
""", encoding="utf-8")
    result = check_file(spec, world=2)  # resolve + the meta model build
    assert result.ok and result.spec is not None, [d.message for d in result.diagnostics]
    assert result.spec.model.dims["vocab"] == 96 and result.spec.model.dims["positions"] == 32
    assert len(parsed) == 1, parsed
    mine = locate.read_pretrained_config(model_dir)
    mine["vocab_size"] = 0  # a copy: the cache is not the caller's
    assert locate.read_pretrained_config(model_dir)["vocab_size"] == 96 and len(parsed) == 1
    (model_dir / "config.json").write_text(json.dumps({**config, "vocab_size": 128}), encoding="utf-8")
    assert locate.read_pretrained_config(model_dir)["vocab_size"] == 128 and len(parsed) == 2


def test_hf_plan_derivation_pairs_gather_then_split_and_keeps_a_tied_head_whole(tmp_path: Path) -> None:
    """Phi-3 declares qkv_proj colwise_gather_output -> o_proj rowwise_split_input: ppdsl writes
    column(fused = 3) -> row. Gemma's lm_head (colwise_gather_output) is tied to an embedding
    that HF's plan keeps whole: it stays whole (W0223), not a split half of a tied pair."""
    from ppdsl.dsl.check import check_file

    def rules(name: str) -> tuple[dict[str, tuple[str, int, bool]], list[str]]:
        path = tmp_path / f"{name}.ppspec"
        path.write_text(spec_text(name, "1f1b"), encoding="utf-8")
        result = check_file(path, world=4, model=False)
        assert result.ok, [d.message for d in result.diagnostics]
        derived = {r.text: (r.style, r.fused, r.gather_output) for r in result.spec.tensor_parallel.rules}
        return derived, [d.code + " " + d.message for d in result.diagnostics if d.code == "W0223"]

    phi3, notes = rules("phi3_hf_plan")
    assert phi3["model.layers[*].self_attn.qkv_proj"] == ("column", 3, False)
    assert phi3["model.layers[*].self_attn.o_proj"] == ("row", 1, False)
    assert phi3["model.layers[*].mlp.gate_up_proj"] == ("column", 2, False)
    assert phi3["model.layers[*].mlp.down_proj"] == ("row", 1, False)
    assert not notes
    gemma, notes = rules("gemma_hf_plan")
    assert "lm_head" not in gemma and gemma["model.layers[*].self_attn.q_proj"] == ("column", 1, False)
    assert len(notes) == 1 and "lm_head (colwise_gather_output, tied to the whole model.embed_tokens)" in notes[0]


def test_sequence_parallelism_is_refused_where_the_blocks_flatten_their_tokens(tmp_path: Path) -> None:
    """OPT's decoder layer reshapes to (batch * sequence, hidden) before fc1: no sequence dimension
    to gather the split hidden states along, so check's run of its own forward on meta as the
    stages run it fails there, and check refuses it (E0426) rather than the run."""
    from ppdsl.dsl.check import check_file

    path = tmp_path / "opt_sp.ppspec"
    path.write_text(spec_text("opt", "1f1b", sequence_parallel=True), encoding="utf-8")
    result = check_file(path, world=4)
    (e,) = [d for d in result.diagnostics if d.is_error]
    assert e.code == "E0426" and "fc1" in e.message and e.span == result.spec.span("tensor_parallel.sequence_parallel")


def test_a_norm_over_a_replicated_kv_head_takes_it_whole(tmp_path: Path) -> None:
    """Qwen3 with one key / value head at tp 2: k_proj is kept whole on both ranks (its head
    replicated), so k_norm, which normalises that head, is not fed a split output (no E0219);
    tests/test_fp64.py verifies the layout against one process."""
    from ppdsl.dsl.check import check_file

    path = tmp_path / "qwen3_one_kv_head.ppspec"
    path.write_text(spec_text("qwen3", "1f1b", config={"num_key_value_heads": 1}), encoding="utf-8")
    assert "num_key_value_heads = 1" in path.read_text(encoding="utf-8")
    result = check_file(path, world=4)
    assert result.ok, [f"{d.code} {d.message}" for d in result.diagnostics]
