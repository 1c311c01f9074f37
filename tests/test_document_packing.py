"""`train.packing = documents`: packed windows whose documents do not see each other.

The positions restart at each document (the EOS keeps its document's), the plan carries the
choice in each hf_dataset source's options, check's refusals (E0470 to E0473), the masking is
real in one process on both model paths (a family's stages and the model's own forward: a
token's logits do not move when an earlier document of its window is altered), and `ppdsl
verify` equals one process on both paths: at pp 2 (2 gloo ranks, default suite) and at pp 2 x
tp 2 (4 ranks, slow: about 80 s on a loaded 2-core machine).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("pyarrow")

from ppdsl.dsl.check import check_file  # noqa: E402
from ppdsl.lowering.lower import lower  # noqa: E402
from ppdsl.runtime.data import source as D  # noqa: E402
from ppdsl.runtime.data import docs as DD  # noqa: E402
from test_hf_dataset import DOCS, corpus, verify_worker  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

GPT2 = """model tiny {
  source = hf("GPT2LMHeadModel")
  config { n_layer = 2, n_embd = 32, n_head = 2, n_positions = 16, vocab_size = 32,
           resid_pdrop = 0.0, embd_pdrop = 0.0, attn_pdrop = 0.0 }
}"""
OLMO = """model tiny {
  source = hf("OlmoForCausalLM")
  config { num_hidden_layers = 2, hidden_size = 32, num_attention_heads = 2, intermediate_size = 64,
           vocab_size = 32, max_position_embeddings = 16 }
}"""
LLAMA = """model tiny {
  source = hf("LlamaForCausalLM")
  config { num_hidden_layers = 2, hidden_size = 32, num_attention_heads = 2, num_key_value_heads = 1,
           intermediate_size = 64, vocab_size = 32, max_position_embeddings = 16 }
}"""
# forwards that take position ids but build their masks without them: ppdsl's document masks
OPT = """model tiny {
  source = hf("OPTForCausalLM")
  config { num_hidden_layers = 2, hidden_size = 32, num_attention_heads = 2, ffn_dim = 64, vocab_size = 32,
           word_embed_proj_dim = 32, max_position_embeddings = 16, dropout = 0.0, attention_dropout = 0.0 }
}"""
BIOGPT = """model tiny {
  source = hf("BioGptForCausalLM")
  config { num_hidden_layers = 2, hidden_size = 32, num_attention_heads = 2, intermediate_size = 64,
           vocab_size = 32, max_position_embeddings = 16, hidden_dropout_prob = 0.0,
           attention_probs_dropout_prob = 0.0, activation_dropout = 0.0 }
}"""
OLMO_TP = "tensor_parallel { hf_plan = true }"
GPT2_TP = """tensor_parallel {
  transformer.h[*].attn.c_attn : column(fused = 3)
  transformer.h[*].attn.c_proj : row
  transformer.h[*].mlp.c_fc : column
  transformer.h[*].mlp.c_proj : row
}"""


def spec_text(model: str, *, packing: str | None = "documents", data: str = 'hf_dataset("shards", tokenizer = "tok")',
              pp: int = 1, tp: int = 1, extra: str = "", mesh: str = "") -> str:
    pipeline = "pipeline { style = 1f1b, microbatches = 2 }\n"
    return (f"ppspec 1\n{model}\nmesh {{ pp = {pp}, tp = {tp}{mesh} }}\n{extra}\n{pipeline}"
            f"train {{\n  global_batch = 4\n  seq_len = 8\n  seed = 3\n  steps = 2\n"
            f"  optimizer = adamw(lr = 1e-2, weight_decay = 0.0)\n"
            + (f"  packing = {packing}\n" if packing else "") + f"  data = {data}\n}}\n")


def checked(tmp_path: Path, text: str, world: int | None = None, model: bool = False):
    path = tmp_path / "spec.ppspec"
    path.write_text(text, encoding="utf-8")
    return check_file(path, world=world, model=model)


def plan_of(tmp_path: Path, text: str, world: int = 1, model: bool = True):
    r = checked(tmp_path, text, world, model)
    assert r.ok, [(d.code, d.message) for d in r.diagnostics]
    return lower(r.spec, world, r.model_info)


def test_positions_restart_after_each_eos() -> None:
    starts = np.array([0, 3, 7, 12, 20])  # documents of 3, 4, 5 and 8 tokens (each ending with its EOS)
    got = DD.document_positions(starts, [0, 8], 8)
    assert got.tolist() == [[0, 1, 2, 0, 1, 2, 3, 0],  # the window starts a document
                            [0, 1, 2, 3, 0, 1, 2, 3]]  # the window cuts into one: its positions start at 0


def test_check_refuses_what_cannot_be_packed_by_documents(tmp_path: Path) -> None:
    corpus(tmp_path)

    def codes(text: str) -> list[str]:
        return [d.code for d in checked(tmp_path, text).diagnostics]

    assert codes(spec_text(GPT2)) == []
    assert codes(spec_text(GPT2, packing="none")) == []
    assert codes(spec_text(GPT2, data='hf_dataset("shards", tokenizer = "tok", packing = true)')) == ["E0471"]
    assert codes(spec_text(GPT2, data="synthetic(seed = 1)")) == ["E0470"]
    assert codes(spec_text(GPT2, packing="windows", data="synthetic(seed = 1)")) == []
    chat = 'hf_dataset("docs.jsonl", tokenizer = "tok", messages = "messages")'
    assert "E0470" in codes(spec_text(GPT2, packing="windows", data=chat))  # conversations pack by documents only
    r = checked(tmp_path, spec_text(GPT2, mesh=", cp = 2"))
    assert "E0473" in [d.code for d in r.diagnostics]
    r = checked(tmp_path, spec_text(GPT2, mesh=", cp = world / 2"))  # more than 1 at some world size
    assert "E0473" in [d.code for d in r.diagnostics]
    # the mixture's parts and the eval data take train.packing too
    mixed = 'mix(hf_dataset("shards", tokenizer = "tok"), hf_dataset("docs.jsonl", tokenizer = "tok"))'
    r = checked(tmp_path, spec_text(GPT2, data=mixed))
    assert r.ok, [(d.code, d.message) for d in r.diagnostics]
    parts = dict(r.spec.train.data.options)["parts"]
    assert [dict(o)["packing"] for _, o in parts] == ["documents", "documents"]


def test_a_model_without_position_ids_is_refused_with_the_model(tmp_path: Path) -> None:
    corpus(tmp_path)
    bloom = """model tiny {
  source = hf("BloomForCausalLM")
  config { n_layer = 2, hidden_size = 32, n_head = 2, vocab_size = 32 }
}"""
    r = checked(tmp_path, spec_text(bloom), model=True)
    (d,) = [d for d in r.diagnostics if d.is_error]
    assert d.code == "E0472" and d.span == r.spec.span("train.packing") and "position_ids" in d.message
    # RoBERTa's position embeddings count from padding_idx + 1: position 1 would read the padding row
    roberta = """model tiny {
  source = hf("RobertaForCausalLM")
  config { num_hidden_layers = 2, hidden_size = 32, num_attention_heads = 2, intermediate_size = 64,
           vocab_size = 32, max_position_embeddings = 20, is_decoder = true }
}"""
    r = checked(tmp_path, spec_text(roberta), model=True)
    assert [d.code for d in r.diagnostics if d.is_error] == ["E0472"]
    assert "padding_idx + 1" in next(d.message for d in r.diagnostics if d.is_error)


def test_document_masks_only_where_the_mask_builders_do_not_read_the_positions(tmp_path: Path) -> None:
    corpus(tmp_path)
    assert [plan_of(tmp_path, spec_text(m)).model.document_masks for m in (GPT2, OLMO, OPT, BIOGPT)] == [
        False, False, True, True]
    assert not plan_of(tmp_path, spec_text(OPT, packing="windows")).model.document_masks
    # `ppdsl plan` says which of the two keeps the documents apart (a mixture's parts too)
    from ppdsl.views.report import plan_report

    assert "ppdsl's document masks" in plan_report(plan_of(tmp_path, spec_text(OPT))).render()
    mixed = 'mix(hf_dataset("shards", tokenizer = "tok"), hf_dataset("docs.jsonl", tokenizer = "tok"))'
    assert "the model's own mask builders" in plan_report(plan_of(tmp_path, spec_text(GPT2, data=mixed))).render()
    assert "packed documents" not in plan_report(plan_of(tmp_path, spec_text(GPT2, packing="windows"))).render()
    # flash attention's mask builder takes no mask function: no document mask can be anded in
    # (not installed here: the rule on check's facts of the model, as a machine with it finds them)
    import attrs

    from ppdsl.dsl.packing_check import check_packing_model

    info = checked(tmp_path, spec_text(OPT), model=True).model_info
    assert info.document_masks and info.packed_documents == ""
    for implementation, refused in (("flash_attention_2", True), ("sdpa", False)):
        written = OPT.replace("dropout = 0.0,", f'dropout = 0.0, attn_implementation = "{implementation}",')
        spec = checked(tmp_path, spec_text(written)).spec
        found = [d.code for d in check_packing_model(spec, info)]
        assert found == (["E0472"] if refused else []), implementation
    assert not list(check_packing_model(spec, attrs.evolve(info, document_masks=False)))


def _logits(plan, mb: object) -> torch.Tensor:
    """The logits of one microbatch through ppdsl's stages of a one-rank plan."""
    from ppdsl.runtime.stage.build import build_stages

    (stage,) = build_stages(plan, 0, torch.device("cpu"), seed=0)
    stage.eval()
    with torch.no_grad():
        return stage(None, mb)


@pytest.mark.parametrize("model", [GPT2, LLAMA, OLMO, OPT, BIOGPT],
                         ids=["gpt2-family", "llama-family", "olmo-own-forward", "opt-family-document-masks",
                              "biogpt-own-forward-document-masks"])
def test_a_token_does_not_see_the_documents_before_it(tmp_path: Path, model: str) -> None:
    corpus(tmp_path, DOCS * 4)
    plan = plan_of(tmp_path, spec_text(model))
    assert plan.train.data.options_dict["packing"] == "documents"
    data = D.make_data(plan)
    (mb, _) = data.microbatches(0, 0)
    pos = mb.position_ids
    assert pos is not None and pos.shape == mb.input_ids.shape
    row = next(r for r in range(pos.shape[0]) if (pos[r, 1:] == 0).any())  # a window with a boundary in it
    cut = int(torch.nonzero(pos[row, 1:] == 0)[0]) + 1  # the first token of the second document
    before = _logits(plan, mb)
    altered = mb.input_ids.clone()
    altered[row, :cut] = (altered[row, :cut] + 5) % 32  # another earlier document
    after = _logits(plan, type(mb)(input_ids=altered, labels=mb.labels, position_ids=pos))
    assert torch.equal(before[row, cut:], after[row, cut:])
    assert not torch.allclose(before[row, :cut], after[row, :cut])
    # without the document positions the later tokens do see the altered document
    plain = _logits(plan, type(mb)(input_ids=altered, labels=mb.labels))
    assert not torch.allclose(before[row, cut:], plain[row, cut:])


def _verify(tmp_path: Path, world: int, plans: list[tuple[str, str]]) -> None:
    from dist_harness import run_distributed

    corpus(tmp_path, DOCS * 6)
    jobs = [(name, plan_of(tmp_path, text, world=world).to_json()) for name, text in plans]
    results = run_distributed(verify_worker, world, jobs, timeout=240)
    assert [name for name, *_ in results[0]] == [name for name, _ in jobs]
    for name, ok, text in results[0]:
        assert ok, f"{name}:\n{text}"


@pytest.mark.distributed
def test_verify_at_pp_2_equals_one_process_on_both_model_paths(tmp_path: Path) -> None:
    _verify(tmp_path, 2, [("gpt2_family_pp2", spec_text(GPT2, pp=2)), ("olmo_own_forward_pp2", spec_text(OLMO, pp=2)),
                          ("opt_family_document_masks_pp2", spec_text(OPT, pp=2)),
                          ("biogpt_own_forward_document_masks_pp2", spec_text(BIOGPT, pp=2))])


@pytest.mark.slow
@pytest.mark.distributed
def test_verify_at_pp_2_tp_2_equals_one_process_on_both_model_paths(tmp_path: Path) -> None:
    _verify(tmp_path, 4, [("gpt2_family_pp2_tp2", spec_text(GPT2, pp=2, tp=2, extra=GPT2_TP)),
                          ("olmo_own_forward_pp2_tp2", spec_text(OLMO, pp=2, tp=2, extra=OLMO_TP))])


def test_a_mixture_and_its_held_out_side_carry_the_positions(tmp_path: Path) -> None:
    corpus(tmp_path, DOCS * 6)
    mixed = 'mix(hf_dataset("shards", tokenizer = "tok"), hf_dataset("docs.jsonl", tokenizer = "tok"))'
    text = spec_text(GPT2, data=mixed).replace("  data = mix", "  eval { data = holdout(0.25) }\n  data = mix")
    plan = plan_of(tmp_path, text)  # with the model: GPT-2 runs its own forward, lowered from its trace
    for data in (D.make_data(plan), D.make_data(plan, data=plan.train.eval.data)):
        batch = data.batch(0, 0)
        assert batch.position_ids is not None and batch.attention_mask is None
        windows = batch.input_ids.shape[0]
        assert batch.position_ids.shape == (windows, 8) and bool((batch.position_ids[:, 0] == 0).all())


def test_every_pipeline_rank_reads_the_positions(tmp_path: Path) -> None:
    corpus(tmp_path, DOCS * 6)
    plan = plan_of(tmp_path, spec_text(GPT2, pp=2), world=2)
    whole, last = D.make_data(plan).batch(0, 0), D.make_data(plan, pp_rank=1).batch(0, 0)
    # GPT-2 runs its own forward, which reads the tokens on every stage (runtime/data/source.py needs_of)
    assert last.input_ids.stride() != (0, 0) and torch.equal(last.input_ids, whole.input_ids)
    assert torch.equal(last.position_ids, whole.position_ids)  # and their blocks need the positions
