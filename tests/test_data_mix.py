"""`mix(a, b, ..., weights = [...])` and `eval { data = holdout(fraction) }` (runtime/data/mix.py).

The proportions of the parts over many steps, each part read in its own order, determinism and
independence of the data-parallel size (the global batch at dp 1 and dp 2), an exact resume (a
source built afresh at a random step reads what the uninterrupted one reads), held-out items never
trained on (token windows, examples, padded documents, a mixture), each diagnostic with its line
and column, and one spawned gloo world (2 ranks) whose `ppdsl verify` of a mixture equals one
process.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from ppdsl.dsl.check import check_file
from ppdsl.lowering.lower import lower
from ppdsl.runtime.data import batch as DB, source as D
from ppdsl.runtime.data import mix as M

pytestmark = pytest.mark.usefixtures("one_thread")

SEQ = 8
DECODER = """model tiny {
  source = python("ppdsl.models.decoder:build_decoder")
  config { vocab_size = 4096, dim = 32, n_layers = 2, n_heads = 2, max_seq_len = 16 }
}"""
BERT = """model bert {
  source = hf("BertForSequenceClassification")
  config { num_hidden_layers = 2, hidden_size = 32, num_attention_heads = 2, intermediate_size = 64,
           vocab_size = 64, num_labels = 2 }
}"""
WORDS = ["w%d" % i for i in range(60)]


def token_file(path: Path, windows: int, base: int) -> Path:
    """`windows` windows of SEQ tokens; window i starts with id base + i (its name), then its length."""
    ids = np.full((windows, SEQ), 7, dtype=np.uint16)
    ids[:, 0] = base + np.arange(windows)
    ids.reshape(-1).tofile(path)
    return path


def make_tokenizer(directory: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    directory.mkdir(parents=True, exist_ok=True)
    vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "</s>"] + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "pad_token": "[PAD]"}))
    return directory


def spec_text(data: str, *, model: str = DECODER, global_batch: int = 8, evaluation: str = "", dp: str = "world") -> str:
    ev = f"\n  eval {{ {evaluation} }}" if evaluation else ""
    return (f"ppspec 1\n{model}\nmesh {{ dp = {dp} }}\npipeline {{ style = 1f1b, microbatches = 2 }}\n"
            f"train {{\n  global_batch = {global_batch}\n  seq_len = {SEQ}\n  seed = 3\n  steps = 2\n"
            f"  optimizer = adamw(lr = 1e-2, weight_decay = 0.0)\n  data = {data}{ev}\n}}\n")


def check(tmp_path: Path, data: str, world: int | None = 1, build: bool = False, **kw):
    path = tmp_path / "spec.ppspec"
    path.write_text(spec_text(data, **kw), encoding="utf-8")
    return check_file(path, world=world, model=build)


def plan_of(tmp_path: Path, data: str, world: int = 1, **kw):
    """The plan a run executes: lowered with check's facts of the model."""
    r = check(tmp_path, data, world=world, build=True, **kw)
    assert r.ok, [(d.code, d.message) for d in r.diagnostics if d.is_error]
    return lower(r.spec, world, r.model_info)


MIX = 'mix(tokens("a.bin"), tokens("b.bin"), weights = [0.7, 0.3])'


@pytest.fixture()
def two_files(tmp_path: Path) -> Path:
    token_file(tmp_path / "a.bin", 50, 0)
    token_file(tmp_path / "b.bin", 40, 1000)
    return tmp_path


def names(batch: DB.Batch) -> list[int]:
    return batch.input_ids[:, 0].tolist()


def global_batch(source: DB.DataSource, step: int, dp: int) -> list[int]:
    return [n for r in range(dp) for n in names(source.batch(step, r))]


# ---- the mixture ---------------------------------------------------------------------------------


def test_each_sample_is_drawn_by_weight(two_files: Path) -> None:
    source = D.make_data(plan_of(two_files, MIX))
    drawn = [n for step in range(400) for n in names(source.batch(step, 0))]
    share = sum(n >= 1000 for n in drawn) / len(drawn)
    assert abs(share - 0.3) < 0.025, share  # 3,200 draws: 3 standard deviations are 0.024
    other = D.make_data(plan_of(two_files, MIX.replace("0.7, 0.3", "1, 3")))
    drawn = [n for step in range(100) for n in names(other.batch(step, 0))]
    assert abs(sum(n >= 1000 for n in drawn) / len(drawn) - 0.75) < 0.05  # normalised


def test_each_part_is_read_in_its_own_order(two_files: Path) -> None:
    """The k-th sample drawn from a part is the sample the part alone reads at position k."""
    plan = plan_of(two_files, MIX)
    source = D.make_data(plan)
    alone = {0: D.make_data(plan_of(two_files, 'tokens("a.bin")')), 1: D.make_data(plan_of(two_files, 'tokens("b.bin")'))}
    seen = {0: [], 1: []}
    for step in range(30):  # 240 draws: past one epoch of each part
        for n in names(source.batch(step, 0)):
            seen[int(n >= 1000)].append(n)
    for p, got in seen.items():
        own = [n for step in range(60) for n in names(alone[p].batch(step, 0))][: len(got)]
        assert got == own and len(got) > 50
    assert sorted(seen[1][:40]) == list(range(1000, 1040))  # an epoch of b: each window once


def test_global_batch_is_the_same_at_dp_1_and_dp_2(two_files: Path) -> None:
    one = D.make_data(plan_of(two_files, MIX, world=1))
    two = D.make_data(plan_of(two_files, MIX, world=2))
    assert two.batch_size == one.batch_size // 2
    for step in (0, 1, 7, 33):
        assert global_batch(one, step, 1) == global_batch(two, step, 2)
    again = D.make_data(plan_of(two_files, MIX, world=1))
    assert [global_batch(again, s, 1) for s in range(5)] == [global_batch(one, s, 1) for s in range(5)]


def test_a_resume_at_a_random_step_reads_what_the_uninterrupted_run_reads(two_files: Path) -> None:
    plan = plan_of(two_files, MIX, world=2)
    through = D.make_data(plan)
    steps = [global_batch(through, s, 2) for s in range(60)]
    for at in random.Random(5).sample(range(1, 55), 3):
        resumed = D.make_data(plan)  # a fresh process: nothing counted yet
        assert [global_batch(resumed, s, 2) for s in range(at, at + 5)] == steps[at:at + 5]
    other_dp = D.make_data(plan_of(two_files, MIX, world=1))  # and under another dp size
    assert global_batch(other_dp, 41, 1) == steps[41]


def test_draws_are_a_pure_function_of_seed_and_position() -> None:
    a = M.draw_parts(3, (0.5, 0.25, 0.25), 1000, 3000)
    assert (a == M.draw_parts(3, (0.5, 0.25, 0.25), 0, 3000)[1000:]).all()
    assert not (a == M.draw_parts(4, (0.5, 0.25, 0.25), 1000, 3000)).all()
    assert set(a.tolist()) == {0, 1, 2}


def test_examples_are_mixed_for_a_classifier(tmp_path: Path) -> None:
    make_tokenizer(tmp_path / "tok")
    for name, base in (("a.jsonl", 0), ("b.jsonl", 30)):
        rows = [{"text": f"w{base + i % 30} w1", "label": i % 2} for i in range(40)]
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = 'mix(jsonl("a.jsonl", tokenizer = "tok"), jsonl("b.jsonl", tokenizer = "tok"), weights = [1, 1])'
    source = D.make_data(plan_of(tmp_path, data, model=BERT))
    batch = source.batch(4, 0)
    assert batch.labels.shape == (8,) and batch.attention_mask is not None and batch.attention_mask[:, :2].all()
    first = [int(i) for s in range(50) for i in source.batch(s, 0).input_ids[:, 0]]  # w0..w29: 3..32, else b's
    assert all(3 <= i < 63 for i in first)
    assert abs(sum(i >= 33 for i in first) / len(first) - 0.5) < 0.06


def test_padded_documents_are_mixed_with_their_masks(tmp_path: Path) -> None:
    make_tokenizer(tmp_path / "tok")
    for name, words in (("a.jsonl", range(3, 30)), ("b.jsonl", range(30, 60))):
        rows = [{"text": " ".join(f"w{w}" for w in range(i, i + 1 + i % 5))} for i in words]
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = ('mix(hf_dataset("a.jsonl", tokenizer = "tok", packing = false), '
            'hf_dataset("b.jsonl", tokenizer = "tok", packing = false), weights = [1, 2])')
    source = D.make_data(plan_of(tmp_path, data))
    seen = set()
    for step in range(10):
        b = source.batch(step, 0)
        assert b.attention_mask is not None
        real = b.attention_mask.bool()
        assert (b.labels[~real] == -100).all() and (b.labels[real] == b.input_ids[real]).all()
        seen |= {int(i) >= 33 for i in b.input_ids[:, 0]}  # w30.. are ids 33..
    assert seen == {True, False}


# ---- held out ------------------------------------------------------------------------------------


def _all_trained(source: DB.DataSource, steps: int) -> set[int]:
    return {n for s in range(steps) for n in names(source.batch(s, 0))}


def test_holdout_of_a_token_file_is_never_trained_on(two_files: Path) -> None:
    plan = plan_of(two_files, 'tokens("a.bin")', evaluation="data = holdout(0.2), every = 1")
    trained = _all_trained(D.make_data(plan), 40)  # 320 samples: 8 epochs of the 40 kept windows
    held = _all_trained(D.make_data(plan, data=plan.train.eval.data), 5)
    assert len(held) == 10 and len(trained) == 40
    assert not trained & held and trained | held == set(range(50))
    again = plan_of(two_files, 'tokens("a.bin")', evaluation="data = holdout(0.2), every = 1")
    assert _all_trained(D.make_data(again, data=again.train.eval.data), 5) == held  # deterministic
    seeded = plan_of(two_files, 'tokens("a.bin", seed = 9)', evaluation="data = holdout(0.2), every = 1")
    assert _all_trained(D.make_data(seeded, data=seeded.train.eval.data), 5) != held  # seeded


def test_holdout_of_a_mixture_holds_out_of_each_part(two_files: Path) -> None:
    plan = plan_of(two_files, MIX, evaluation="data = holdout(0.25), batches = 2", world=2)
    trained = {n for s in range(60) for n in global_batch(D.make_data(plan), s, 2)}
    evaluation = D.make_data(plan, data=plan.train.eval.data)
    held = {n for s in range(20) for n in global_batch(evaluation, s, 2)}
    assert not trained & held
    assert len({n for n in held if n < 1000}) == 12 and len({n for n in held if n >= 1000}) == 10
    assert trained | held == set(range(50)) | set(range(1000, 1040))


def test_holdout_of_examples_and_documents(tmp_path: Path) -> None:
    make_tokenizer(tmp_path / "tok")
    rows = [{"text": " ".join(WORDS[(i + j) % 60] for j in range(3)) + f" w{i % 60}", "label": i % 2} for i in range(60)]
    (tmp_path / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    docs = [{"text": f"w{i} w{i} w1"} for i in range(3, 60)]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in docs))
    for data, model, key in (('jsonl("r.jsonl", tokenizer = "tok")', BERT, lambda ids: tuple(ids.tolist())),
                             ('hf_dataset("docs.jsonl", tokenizer = "tok", packing = false)', DECODER,
                              lambda ids: int(ids[0]))):
        plan = plan_of(tmp_path, data, model=model, evaluation="data = holdout(0.3)")
        train, held = D.make_data(plan), D.make_data(plan, data=plan.train.eval.data)
        seen = {key(r) for s in range(30) for r in train.batch(s, 0).input_ids}
        out = {key(r) for s in range(10) for r in held.batch(s, 0).input_ids}
        assert seen and out and not seen & out, data
        assert len(out) == int(0.3 * (60 if model is BERT else 57))


# ---- check: each diagnostic, with its line and column ---------------------------------------------


def _diag(tmp_path: Path, data: str, code: str, text: str, **kw) -> None:
    r = check(tmp_path, data, **kw)
    found = [d for d in r.diagnostics if d.code == code]
    assert found, [(d.code, d.message) for d in r.diagnostics]
    lines = spec_text(data, **kw).splitlines()
    span = found[0].span
    assert span is not None
    line = lines[span.line - 1]
    assert line[span.column - 1:].startswith(text), (line, span.column, text)


def test_diagnostics(two_files: Path) -> None:
    t = two_files
    _diag(t, 'mix(tokens("a.bin"), weights = [1])', "E0454", "mix(")
    _diag(t, 'mix(tokens("a.bin"), tokens("b.bin"), weights = [0.7, -0.3])', "E0454", "-0.3")
    _diag(t, 'mix(tokens("a.bin"), tokens("b.bin"), weights = [0.7, 0])', "E0454", "0]")
    _diag(t, 'mix(tokens("a.bin"), tokens("b.bin"), weights = [1])', "E0454", "[1]")
    _diag(t, 'mix(tokens("a.bin"), synthetic(seed = 1))', "E0454", "synthetic(")
    make_tokenizer(t / "tok")
    (t / "d.jsonl").write_text("".join(json.dumps({"text": f"w{i} w2"}) + "\n" for i in range(20)))
    _diag(t, 'mix(tokens("a.bin"), hf_dataset("d.jsonl", tokenizer = "tok", packing = false))', "E0455", "hf_dataset(")
    _diag(t, 'tokens("a.bin")', "E0456", "1.5", evaluation="data = holdout(1.5)")
    _diag(t, 'tokens("a.bin")', "E0456", "0.1", evaluation="data = holdout(0.1)", global_batch=16)  # 5 windows < 16
    _diag(t, 'tokens("a.bin")', "E0456", "0.9", evaluation="data = holdout(0.9)", global_batch=8)  # keeps 5 < 8
    _diag(t, 'holdout(0.1)', "E0456", "holdout(")
    _diag(t, 'synthetic(seed = 1)', "E0456", "synthetic(", evaluation="data = holdout(0.1)")
    _diag(t, 'mix(tokens("a.bin"), tokens("missing.bin"))', "E0410", '"missing.bin"')  # each part is checked
    assert check(t, MIX, evaluation="data = holdout(0.2)").ok


def test_the_runtime_refuses_what_check_refuses(two_files: Path) -> None:
    plan = plan_of(two_files, 'tokens("a.bin")', evaluation="data = holdout(0.2)", global_batch=8)
    bad = plan.train.eval.data.__class__("holdout", (("fraction", 0.01),))
    with pytest.raises(ValueError, match="holds out"):
        D.make_data(plan, data=bad).batch(0, 0)


# ---- distributed: ppdsl verify of a mixture equals one process ------------------------------------


def verify_worker(rank: int, world: int, plan_json: dict) -> tuple[bool, str]:
    from ppdsl.lowering.plan import Plan
    from ppdsl.runtime.parallel.groups import build_process_groups, tie_pp_ranks_of
    from ppdsl.runtime.verify.world import verify_in_process

    plan = Plan.from_json(plan_json)
    groups = build_process_groups(plan.mesh, "cpu", tie_pp_ranks_of(plan.schedule.stage_ranks))
    report = verify_in_process(plan, groups, torch.device("cpu"), plan.train.steps)
    return (True, "") if report is None else (report.ok, report.render())


@pytest.mark.distributed
def test_verify_of_a_mixture_at_dp_2_equals_one_process(two_files: Path) -> None:
    from dist_harness import run_distributed

    plan = plan_of(two_files, MIX, world=2, evaluation="data = holdout(0.2)")
    results = run_distributed(verify_worker, 2, plan.to_json(), timeout=150)
    ok, text = results[0]
    assert ok, text
