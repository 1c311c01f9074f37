"""Data sources of `train.data`: the language, check-time diagnostics, the runtime readers.

Every source kind is exercised on small files made in tmp_path (a uint16 .bin, a uint32 .npy, a
WordLevel tokenizer trained offline with the `tokenizers` library, a text corpus, a JSON-lines
and a CSV file): determinism per (seed, step, replica), disjoint replica shards, the placeholder
tensors of ranks that need no inputs or labels, every E0410..E0418 diagnostic, and the
ValueErrors of a bad file found only when it is read.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from ppdsl.dsl.check import check_file
from ppdsl.dsl.data_check import SAMPLE_TOKENS as D_SAMPLE
from ppdsl.lowering.lower import lower
from ppdsl.runtime.data import batch as DB, source as D, synthetic as DS
from ppdsl.runtime.data import examples as FE, files as F, order as FO

ROOT = Path(__file__).resolve().parent.parent

DECODER = """model tiny {{
  source = python("ppdsl.models.decoder:build_decoder")
  config {{ vocab_size = {vocab}, dim = 32, n_layers = 4, n_heads = 4, max_seq_len = 64 }}
}}"""
BERT = """model bert {{
  source = hf("BertForSequenceClassification")
  config {{ num_hidden_layers = 4, hidden_size = 32, num_attention_heads = 4, intermediate_size = 64,
           vocab_size = {vocab}, num_labels = {labels} }}
}}"""
SENTENCES = [
    "a wonderful film with a great cast", "the plot was dull and the acting bad", "i loved every minute of it",
    "a waste of time", "great music and a good story", "bad film , bad script", "the cast was wonderful",
    "dull , slow and long",
]


def spec_text(data: str, *, model: str = "decoder", vocab: int = 128, labels: int = 2, global_batch: int = 8,
              seq_len: int = 8, pp: int = 1, tp: int = 1, microbatches: int = 2) -> str:
    head = DECODER.format(vocab=vocab) if model == "decoder" else BERT.format(vocab=vocab, labels=labels)
    return (f"ppspec 1\n{head}\nmesh {{ tp = {tp}, pp = {pp} }}\npipeline {{ style = 1f1b, microbatches = {microbatches} }}\n"
            f"train {{\n  global_batch = {global_batch}\n  seq_len = {seq_len}\n  seed = 3\n  data = {data}\n}}\n")


def write_spec(tmp_path: Path, data: str, **kw) -> Path:
    path = tmp_path / "spec.ppspec"
    path.write_text(spec_text(data, **kw), encoding="utf-8")
    return path


def check(tmp_path: Path, data: str, world: int | None = None, **kw):
    return check_file(write_spec(tmp_path, data, **kw), world=world, model=False)


def codes(result) -> list[str]:
    return [d.code for d in result.diagnostics]


def plan_of(tmp_path: Path, data: str, world: int, **kw):
    # with the model: a class running its own forward is lowered from check's trace of it
    r = check_file(write_spec(tmp_path, data, **kw), world=world)
    assert r.ok, [(d.code, d.message) for d in r.diagnostics]
    return lower(r.spec, world, r.model_info)


def make_tokenizer(directory: Path, sentences: list[str] = SENTENCES) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    directory.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(sentences, trainers.WordLevelTrainer(special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]"]))
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tok.save(str(directory / "tokenizer.json"))
    return directory


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def write_csv(path: Path, columns: list[str], rows: list[dict]) -> Path:
    import csv

    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, columns, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    return path


def examples(n: int = 16) -> list[dict]:
    return [{"text": SENTENCES[i % len(SENTENCES)], "label": i % 2, "id": i} for i in range(n)]


# ---- the language -------------------------------------------------------------------------------


def test_relative_paths_are_resolved_against_the_spec_directory(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "data").mkdir()
    np.arange(1024, dtype=np.uint16).__mod__(128).astype(np.uint16).tofile(tmp_path / "data" / "train.bin")
    monkeypatch.chdir(ROOT)  # the working directory does not matter
    plan = plan_of(tmp_path, 'tokens("data/train.bin", dtype = "uint16")', world=1)
    opts = plan.train.data.options_dict
    assert plan.train.data.kind == "tokens"
    assert opts["path"] == str(tmp_path / "data" / "train.bin") and os.path.isabs(opts["path"])
    assert opts["dtype"] == "uint16" and opts["seed"] == 3  # seed: train.seed
    assert json.loads(plan.dumps())["train"]["data"]["kind"] == "tokens"  # the plan stays JSON


def test_every_kind_resolves(tmp_path: Path) -> None:
    tok = make_tokenizer(tmp_path / "tok")
    (tmp_path / "c.txt").write_text("\n".join(SENTENCES * 20), encoding="utf-8")
    write_jsonl(tmp_path / "e.jsonl", examples())
    write_csv(tmp_path / "e.csv", ["text", "label"], examples())
    r = check(tmp_path, f'text("c.txt", tokenizer = "{tok.name}", seed = 9)')
    assert r.ok and r.spec.train.data.options["seed"] == 9
    assert r.spec.train.data.options["tokenizer"] == str(tok)
    r = check(tmp_path, 'jsonl("e.jsonl", "tok", "text", "label")', model="bert")
    assert r.ok, r.diagnostics
    assert dict(r.spec.train.data.options) == {"path": str(tmp_path / "e.jsonl"), "tokenizer": str(tok), "text": "text",
                                               "label": "label", "seed": 3}
    assert check(tmp_path, 'csv("e.csv", tokenizer = "tok")', model="bert").ok


@pytest.mark.parametrize("data, code", [
    ("tokens()", "E0103"),
    ('text("c.txt")', "E0103"),
    ('jsonl("e.jsonl")', "E0103"),
    ('tokens("")', "E0103"),
    ('tokens(1)', "E0103"),
    ('tokens("x.bin", dtype = "int8")', "E0107"),
    ('tokens("x.bin", vocab = 3)', "E0107"),
    ('parquet("x")', "E0107"),
])
def test_bad_data_calls_are_resolve_errors(tmp_path: Path, data: str, code: str) -> None:
    assert code in codes(check(tmp_path, data))


# ---- check-time diagnostics ---------------------------------------------------------------------


def test_a_good_token_file_passes(tmp_path: Path) -> None:
    (np.arange(4096) % 128).astype(np.uint16).tofile(tmp_path / "t.bin")
    np.save(tmp_path / "t.npy", (np.arange(4096) % 128).astype(np.uint32))
    assert check(tmp_path, 'tokens("t.bin")').diagnostics == ()
    assert check(tmp_path, 'tokens("t.npy")').diagnostics == ()
    assert check(tmp_path, 'tokens("t.npy", dtype = "uint32")').diagnostics == ()


def test_e0410_missing_file_and_tokenizer(tmp_path: Path) -> None:
    r = check(tmp_path, 'tokens("nope.bin")')
    assert codes(r) == ["E0410"] and "nope.bin" in r.diagnostics[0].message
    assert r.diagnostics[0].span.column == spec_text('tokens("nope.bin")').splitlines()[-2].index('"nope') + 1
    (tmp_path / "c.txt").write_text("hello\n")
    assert codes(check(tmp_path, 'text("c.txt", tokenizer = "no_dir")')) == ["E0410"]


def test_e0411_not_a_regular_file(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    assert codes(check(tmp_path, 'tokens("d")')) == ["E0411"]
    (tmp_path / "c.txt").write_text("hello\n")
    (tmp_path / "tokfile").write_text("{}")
    assert codes(check(tmp_path, 'text("c.txt", tokenizer = "tokfile")')) == ["E0411"]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_e0411_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "pipe.bin")
    assert codes(check(tmp_path, 'tokens("pipe.bin")')) == ["E0411"]  # would hang if it were opened


def test_e0412_malformed_token_files(tmp_path: Path) -> None:
    (tmp_path / "odd.bin").write_bytes(bytes(7))
    np.save(tmp_path / "f.npy", np.zeros(64, dtype=np.float32))
    np.save(tmp_path / "m.npy", np.zeros((4, 64), dtype=np.uint16))
    np.save(tmp_path / "be.npy", np.zeros(64, dtype=">u2"))
    np.save(tmp_path / "u32.npy", np.zeros(512, dtype=np.uint32))
    (tmp_path / "fake.npy").write_bytes(bytes(1024))
    whole = (tmp_path / "u32.npy").read_bytes()
    (tmp_path / "cut.npy").write_bytes(whole[: len(whole) - 100])
    (tmp_path / "u32.bin").write_bytes(bytes(4 * 513 + 2))
    for name, needle in [("odd.bin", "7 bytes"), ("f.npy", "float32"), ("m.npy", "shape (4, 64)"),
                         ("be.npy", ">u2"), ("fake.npy", "not a .npy"), ("cut.npy", "cut short")]:
        r = check(tmp_path, f'tokens("{name}")')
        assert codes(r) == ["E0412"], (name, r.diagnostics)
        assert needle in r.diagnostics[0].message, (name, r.diagnostics[0].message)
    r = check(tmp_path, 'tokens("u32.npy", dtype = "uint16")')
    assert codes(r) == ["E0412"] and "dtype" in r.diagnostics[0].message
    assert codes(check(tmp_path, 'tokens("u32.bin", dtype = "uint32")')) == ["E0412"]


def test_e0413_token_ids_beyond_the_vocabulary(tmp_path: Path) -> None:
    ids = (np.arange(4096) % 128).astype(np.uint16)
    ids[1234] = 500
    ids.tofile(tmp_path / "t.bin")
    r = check(tmp_path, 'tokens("t.bin")')
    assert codes(r) == ["E0413"] and "500 at position 1234" in r.diagnostics[0].message
    assert check(tmp_path, 'tokens("t.bin")', vocab=512).ok
    # only a bounded prefix is sampled: an id beyond it is found at run time
    big = np.zeros(D_SAMPLE + 64, dtype=np.uint16)
    big[-1] = 999
    big.tofile(tmp_path / "big.bin")
    assert check(tmp_path, 'tokens("big.bin")').ok
    tok = make_tokenizer(tmp_path / "tok")  # 36 ids
    write_jsonl(tmp_path / "e.jsonl", examples())
    r = check(tmp_path, 'jsonl("e.jsonl", tokenizer = "tok")', model="bert", vocab=16)
    assert codes(r) == ["E0413"] and "tokenizer" in r.diagnostics[0].message
    assert r.diagnostics[0].span.column == spec_text('jsonl("e.jsonl", tokenizer = "tok")').splitlines()[-2].index('"tok"') + 1


def test_e0414_too_little_data(tmp_path: Path) -> None:
    (np.arange(63) % 128).astype(np.uint16).tofile(tmp_path / "t.bin")  # one batch needs 8 * 8 = 64
    r = check(tmp_path, 'tokens("t.bin")')
    assert codes(r) == ["E0414"] and "63 tokens" in r.diagnostics[0].message
    (tmp_path / "empty.bin").write_bytes(b"")
    assert codes(check(tmp_path, 'tokens("empty.bin")')) == ["E0414"]
    # a global batch that depends on the world size is checked at --world, not before
    r = check(tmp_path, 'tokens("t.bin")', global_batch="8 * dp")
    assert r.ok
    assert codes(check(tmp_path, 'tokens("t.bin")', global_batch="8 * dp", world=1)) == ["E0414"]
    make_tokenizer(tmp_path / "tok")
    write_jsonl(tmp_path / "few.jsonl", examples(5))
    r = check(tmp_path, 'jsonl("few.jsonl", tokenizer = "tok")', model="bert")
    assert codes(r) == ["E0414"] and "5 examples" in r.diagnostics[0].message
    (tmp_path / "empty.txt").write_text("")
    assert codes(check(tmp_path, 'text("empty.txt", tokenizer = "tok")')) == ["E0414"]


def test_e0415_tokenizer_directory_without_tokenizer(tmp_path: Path) -> None:
    (tmp_path / "c.txt").write_text("hello\n")
    (tmp_path / "tok").mkdir()
    assert codes(check(tmp_path, 'text("c.txt", tokenizer = "tok")')) == ["E0415"]
    (tmp_path / "tok" / "tokenizer.json").write_text("{not json")
    assert codes(check(tmp_path, 'text("c.txt", tokenizer = "tok")')) == ["E0415"]
    (tmp_path / "tok" / "tokenizer.json").write_text('{"version": "1.0"}')
    assert codes(check(tmp_path, 'text("c.txt", tokenizer = "tok")')) == ["E0415"]
    (tmp_path / "tok" / "tokenizer.json").unlink()
    (tmp_path / "tok" / "tokenizer_config.json").write_text("{}")  # AutoTokenizer's: accepted
    assert check(tmp_path, 'text("c.txt", tokenizer = "tok")').ok


def test_e0416_malformed_examples(tmp_path: Path) -> None:
    make_tokenizer(tmp_path / "tok")
    rows = examples()
    bad_json = "".join(json.dumps(r) + "\n" for r in rows[:3]) + "{oops\n"
    (tmp_path / "bad.jsonl").write_text(bad_json)
    r = check(tmp_path, 'jsonl("bad.jsonl", tokenizer = "tok")', model="bert")
    assert codes(r) == ["E0416"] and "line 4" in r.diagnostics[0].message
    (tmp_path / "list.jsonl").write_text("[1, 2]\n")
    assert codes(check(tmp_path, 'jsonl("list.jsonl", tokenizer = "tok")', model="bert")) == ["E0416"]
    write_jsonl(tmp_path / "e.jsonl", examples())
    r = check(tmp_path, 'jsonl("e.jsonl", tokenizer = "tok", label = "stars")', model="bert")
    assert codes(r) == ["E0416"] and "'stars'" in r.diagnostics[0].message
    src = spec_text('jsonl("e.jsonl", tokenizer = "tok", label = "stars")').splitlines()[-2]
    assert r.diagnostics[0].span.column == src.index('"stars"') + 1  # on the option
    write_jsonl(tmp_path / "num.jsonl", [dict(r, text=5) for r in rows])
    assert codes(check(tmp_path, 'jsonl("num.jsonl", tokenizer = "tok")', model="bert")) == ["E0416"]
    write_csv(tmp_path / "e.csv", ["review", "label"], [dict(review=r["text"], label=r["label"]) for r in rows])
    r = check(tmp_path, 'csv("e.csv", tokenizer = "tok")', model="bert")
    assert codes(r) == ["E0416"] and "no column 'text'" in r.diagnostics[0].message
    assert check(tmp_path, 'csv("e.csv", tokenizer = "tok", text = "review")', model="bert").ok
    (tmp_path / "latin.txt").write_bytes("très\n".encode("latin-1"))
    assert codes(check(tmp_path, 'text("latin.txt", tokenizer = "tok")')) == ["E0416"]


def test_e0417_labels(tmp_path: Path) -> None:
    make_tokenizer(tmp_path / "tok")
    rows = examples()
    write_jsonl(tmp_path / "e.jsonl", [dict(r, label=3) if r["id"] == 5 else r for r in rows])
    r = check(tmp_path, 'jsonl("e.jsonl", tokenizer = "tok")', model="bert", labels=2)
    assert codes(r) == ["E0417"] and "label 3 on line 6" in r.diagnostics[0].message
    assert check(tmp_path, 'jsonl("e.jsonl", tokenizer = "tok")', model="bert", labels=4).ok
    write_jsonl(tmp_path / "s.jsonl", [dict(r, label="positive") for r in rows])
    assert codes(check(tmp_path, 'jsonl("s.jsonl", tokenizer = "tok")', model="bert")) == ["E0417"]
    write_jsonl(tmp_path / "str.jsonl", [dict(r, label=str(r["label"])) for r in rows])  # "1" is class 1
    assert check(tmp_path, 'jsonl("str.jsonl", tokenizer = "tok")', model="bert").ok


def test_e0418_data_kind_must_fit_the_model(tmp_path: Path) -> None:
    (np.arange(4096) % 128).astype(np.uint16).tofile(tmp_path / "t.bin")
    make_tokenizer(tmp_path / "tok")
    write_jsonl(tmp_path / "e.jsonl", examples())
    assert codes(check(tmp_path, 'tokens("t.bin")', model="bert")) == ["E0418"]
    assert codes(check(tmp_path, 'jsonl("e.jsonl", tokenizer = "tok")')) == ["E0418"]
    assert check(tmp_path, "synthetic(seed = 1)", model="bert").ok


def test_check_stays_fast_and_imports_numpy_only_for_token_files(tmp_path: Path) -> None:
    import time

    (np.arange(3 * D_SAMPLE) % 128).astype(np.uint16).tofile(tmp_path / "t.bin")
    start = time.perf_counter()
    assert check(tmp_path, 'tokens("t.bin")').ok
    assert time.perf_counter() - start < 5.0
    code = ("import sys; from ppdsl.dsl.check import check_file; "
            "r = check_file(sys.argv[1], model=False); assert r.ok; print('numpy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(ROOT / "specs" / "tiny_cpu.ppspec")], capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == "False"


# ---- runtime: token files -----------------------------------------------------------------------


def token_plan(tmp_path: Path, n: int = 1024, world: int = 1, data: str | None = None, dtype=np.uint16, **kw):
    ids = np.arange(n, dtype=np.int64)  # id = position: every window is identifiable
    vocab = kw.pop("vocab", max(128, n))
    if dtype == np.uint16 and data is None:
        ids.astype(np.uint16).tofile(tmp_path / "t.bin")
        data = 'tokens("t.bin")'
    elif data is None:
        np.save(tmp_path / "t.npy", ids.astype(dtype))
        data = 'tokens("t.npy")'
    return plan_of(tmp_path, data, world=world, vocab=vocab, **kw)


def window_starts(batch: DB.Batch, seq_len: int) -> list[int]:
    ids = batch.input_ids
    assert torch.equal(ids - ids[:, :1], torch.arange(seq_len).expand_as(ids))  # consecutive ids
    return [int(x) for x in ids[:, 0]]


def test_token_file_windows(tmp_path: Path) -> None:
    plan = token_plan(tmp_path, n=1024)
    data = D.make_data(plan)
    assert isinstance(data, F.TokenData) and data.task == "causal_lm"
    b = data.batch(0, 0)
    assert b.input_ids.shape == (8, 8) and b.input_ids.dtype == torch.long
    assert torch.equal(b.labels, b.input_ids) and b.attention_mask is None and b.token_type_ids is None
    assert all(s % 8 == 0 for s in window_starts(b, 8))  # aligned, non-overlapping windows
    mbs = data.microbatches(0, 0)
    assert len(mbs) == 2 and mbs[0].input_ids.shape == (4, 8)


def test_npy_uint32_token_file(tmp_path: Path) -> None:
    plan = token_plan(tmp_path, n=70_000 + 1024, dtype=np.uint32, vocab=80_000)
    b = D.make_data(plan).batch(3, 0)
    assert int(b.input_ids.max()) < 80_000
    window_starts(b, 8)
    assert max(max(window_starts(D.make_data(plan).batch(s, 0), 8)) for s in range(40)) > 65_535  # beyond uint16


def test_token_data_is_a_function_of_seed_step_and_replica(tmp_path: Path) -> None:
    plan = token_plan(tmp_path, n=4096, world=2)
    a, b = D.make_data(plan), D.make_data(plan)
    for step in range(3):
        for r in range(2):
            assert torch.equal(a.batch(step, r).input_ids, b.batch(step, r).input_ids)
    assert not torch.equal(a.batch(0, 0).input_ids, a.batch(1, 0).input_ids)
    other = plan_of(tmp_path, 'tokens("t.bin", seed = 11)', world=2, vocab=4096)
    assert not torch.equal(D.make_data(other).batch(0, 0).input_ids, a.batch(0, 0).input_ids)


def test_replicas_read_disjoint_windows_and_an_epoch_reads_each_once(tmp_path: Path) -> None:
    plan = token_plan(tmp_path, n=64 * 8, world=2)  # 64 windows, global batch 8: an epoch is 8 steps
    assert plan.mesh.dp == 2
    data = D.make_data(plan)
    seen: list[int] = []
    for step in range(8):
        r0, r1 = window_starts(data.batch(step, 0), 8), window_starts(data.batch(step, 1), 8)
        assert len(r0) == len(r1) == 4 and not set(r0) & set(r1)
        seen += r0 + r1
    assert sorted(seen) == list(range(0, 512, 8))
    # the global batch does not depend on how many replicas share it
    one = D.make_data(token_plan(tmp_path, n=64 * 8, world=1))
    both = torch.cat([data.batch(5, 0).input_ids, data.batch(5, 1).input_ids])
    assert torch.equal(one.batch(5, 0).input_ids, both)
    # the next epoch is another order
    assert [window_starts(data.batch(s, 0), 8) for s in range(8)] != [window_starts(data.batch(s, 0), 8)
                                                                      for s in range(8, 16)]


def test_large_datasets_use_an_affine_order() -> None:
    order = FO._Order(FO.PERMUTE_MAX + 7, seed=1)
    items = order.items(range(0, 1000))
    assert len(set(items)) == 1000 and all(0 <= i < FO.PERMUTE_MAX + 7 for i in items)
    assert items == FO._Order(FO.PERMUTE_MAX + 7, seed=1).items(range(0, 1000))


# ---- runtime: who reads what -------------------------------------------------------------------


def test_only_first_and_last_stages_read_inputs_and_labels(tmp_path: Path) -> None:
    plan = token_plan(tmp_path, n=1024, world=3, pp=3, microbatches=4)
    assert DB.needs_of(plan, 0) == DB.Needs(inputs=True, labels=False)
    assert DB.needs_of(plan, 2) == DB.Needs(inputs=False, labels=True)
    assert DB.needs_of(plan, None) == DB.Needs(True, True)
    full = D.make_data(plan).batch(0, 0)
    first = D.make_data(plan, pp_rank=0).batch(0, 0)
    last = D.make_data(plan, pp_rank=2).batch(0, 0)
    assert torch.equal(first.input_ids, full.input_ids) and not first.labels.any()
    assert torch.equal(last.labels, full.labels) and not last.input_ids.any()
    assert first.labels.shape == last.input_ids.shape == (8, 8)
    assert first.labels.stride() == (0, 0)  # a placeholder takes no memory
    middle = D.make_data(plan, pp_rank=1)
    os.unlink(tmp_path / "t.bin")  # a middle stage never opens the file
    mb = middle.microbatches(0, 0)
    assert len(mb) == 4 and mb[0].input_ids.shape == (2, 8) and mb[0].labels.shape == (2, 8)
    with pytest.raises(ValueError, match="t.bin"):
        D.make_data(plan, pp_rank=0).batch(0, 0)


def test_zbv_puts_inputs_and_labels_on_pipeline_rank_0(tmp_path: Path) -> None:
    (np.arange(1024) % 128).astype(np.uint16).tofile(tmp_path / "t.bin")
    text = spec_text('tokens("t.bin")', pp=2, microbatches=4).replace("style = 1f1b", "style = zbv, chunks = 2")
    (tmp_path / "s.ppspec").write_text(text)
    r = check_file(tmp_path / "s.ppspec", world=2, model=False)
    assert r.ok, r.diagnostics
    plan = lower(r.spec, 2)
    assert DB.needs_of(plan, 0) == DB.Needs(True, True) and DB.needs_of(plan, 1) == DB.Needs(False, False)


# ---- runtime: text, jsonl, csv ------------------------------------------------------------------


def test_text_corpus_is_tokenized_once_and_cut_into_windows(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    words = [f"w{i}" for i in range(300)]  # distinct words: every window is identifiable
    lines = [" ".join(words[i:i + 10]) for i in range(0, 300, 10)]
    tok = make_tokenizer(tmp_path / "tok", lines)
    corpus = "\n".join(lines) + "\n"
    (tmp_path / "c.txt").write_text(corpus, encoding="utf-8")
    plan = plan_of(tmp_path, 'text("c.txt", tokenizer = "tok")', world=1, vocab=512)
    data = D.make_data(plan)
    assert isinstance(data, F.TextData)
    expected = Tokenizer.from_file(str(tok / "tokenizer.json")).encode(corpus, add_special_tokens=False).ids
    assert len(expected) == 300 and data.tokens().tolist() == expected
    b = data.batch(0, 0)
    starts = [expected.index(int(r[0])) for r in b.input_ids]
    assert len(set(starts)) == 8 and all(s % 8 == 0 for s in starts)
    assert all(r.tolist() == expected[s:s + 8] for r, s in zip(b.input_ids, starts))
    assert torch.equal(b.labels, b.input_ids)
    assert torch.equal(D.make_data(plan).batch(4, 0).input_ids, data.batch(4, 0).input_ids)


def test_text_corpus_too_short_fails_on_first_read(tmp_path: Path) -> None:
    make_tokenizer(tmp_path / "tok")
    (tmp_path / "c.txt").write_text("a waste of time\n", encoding="utf-8")
    plan = plan_of(tmp_path, 'text("c.txt", tokenizer = "tok")', world=1)
    with pytest.raises(ValueError, match=r"text corpus .*c\.txt holds 4 tokens"):
        D.make_data(plan).batch(0, 0)


@pytest.mark.parametrize("kind", ["jsonl", "csv"])
def test_classification_examples(tmp_path: Path, kind: str) -> None:
    from tokenizers import Tokenizer

    tok = make_tokenizer(tmp_path / "tok")
    rows = examples(24)
    if kind == "jsonl":
        write_jsonl(tmp_path / "e.jsonl", rows)
    else:
        write_csv(tmp_path / "e.csv", ["id", "text", "label"], rows)
    plan = plan_of(tmp_path, f'{kind}("e.{kind}", tokenizer = "tok")', world=2, model="bert", seq_len=6)
    data = D.make_data(plan)
    assert isinstance(data, FE.ExampleData) and data.task == "classification"
    ref = Tokenizer.from_file(str(tok / "tokenizer.json"))
    ref.enable_truncation(6)
    by_ids = {}
    for r in rows:
        by_ids.setdefault(tuple(ref.encode(r["text"]).ids), set()).add(r["label"])
    seen = 0
    for step in range(3):  # 24 examples, global batch 8: one epoch
        for rank in range(2):
            b = data.batch(step, rank)
            assert b.input_ids.shape == (4, 6) and b.labels.shape == (4,) and b.attention_mask.shape == (4, 6)
            assert torch.equal(b.token_type_ids, torch.zeros(4, 6, dtype=torch.long))
            for ids, mask, label in zip(b.input_ids, b.attention_mask, b.labels):
                n = int(mask.sum())
                assert ids[0] == 2 and ids[n - 1] == 3  # [CLS] ... [SEP], truncated to seq_len
                assert (ids[n:] == 0).all() and (mask[:n] == 1).all()  # [PAD] = 0 after the text
                assert int(label) in by_ids[tuple(ids[:n].tolist())]
                seen += 1
    assert seen == 24
    again = D.make_data(plan)
    assert torch.equal(again.batch(2, 1).input_ids, data.batch(2, 1).input_ids)
    assert torch.equal(again.batch(2, 1).labels, data.batch(2, 1).labels)
    middle = D.make_data(plan, pp_rank=None).batch(0, 0)
    assert middle.attention_mask is not None


def test_classification_placeholders_keep_the_mask(tmp_path: Path) -> None:
    make_tokenizer(tmp_path / "tok")
    write_jsonl(tmp_path / "e.jsonl", examples())
    plan = plan_of(tmp_path, 'jsonl("e.jsonl", tokenizer = "tok")', world=2, model="bert", pp=2, microbatches=2)
    full = D.make_data(plan).batch(0, 0)
    first, last = D.make_data(plan, pp_rank=0).batch(0, 0), D.make_data(plan, pp_rank=1).batch(0, 0)
    assert torch.equal(first.input_ids, full.input_ids) and first.labels.shape == (8,) and not first.labels.any()
    assert torch.equal(last.labels, full.labels) and torch.equal(last.attention_mask, full.attention_mask)
    # BERT runs its own forward, which reads the tokens on every stage (source.needs_of)
    assert torch.equal(last.input_ids, full.input_ids) and torch.equal(last.token_type_ids, full.token_type_ids)


# ---- runtime: errors on first read --------------------------------------------------------------


def test_run_time_read_errors_name_the_file(tmp_path: Path) -> None:
    plan = token_plan(tmp_path, n=1024)
    path = tmp_path / "t.bin"
    path.write_bytes(bytes(7))  # changed after check
    with pytest.raises(ValueError, match=r"token file .*t\.bin: holds 7 bytes"):
        D.make_data(plan).batch(0, 0)
    path.unlink()
    with pytest.raises(ValueError, match=r"token file .*t\.bin does not exist"):
        D.make_data(plan).batch(0, 0)
    path.write_bytes(bytes(100))
    with pytest.raises(ValueError, match=r"t\.bin holds 50 tokens, fewer than one global batch"):
        D.make_data(plan).batch(0, 0)
    ids = np.arange(1024) % 128
    ids.astype(np.uint16).tofile(path)
    small = plan_of(tmp_path, 'tokens("t.bin")', world=1, vocab=128)
    ids[700] = 5000
    ids.astype(np.uint16).tofile(path)
    data = D.make_data(small)
    with pytest.raises(ValueError, match=r"t\.bin: token id 5000 at position 700 is outside"):
        for step in range(16):
            data.batch(step, 0)


def test_run_time_bad_example_names_file_and_line(tmp_path: Path) -> None:
    make_tokenizer(tmp_path / "tok")
    rows = examples(1200)
    write_jsonl(tmp_path / "e.jsonl", rows)
    plan = plan_of(tmp_path, 'jsonl("e.jsonl", tokenizer = "tok")', world=1, model="bert")
    with open(tmp_path / "e.jsonl", "a") as f:  # past the lines check reads
        f.write('{"text": "late", "label": 7}\n')
    with pytest.raises(ValueError, match=r"e\.jsonl:1201: label 7 is not a class id 0\.\.1"):
        D.make_data(plan).batch(0, 0)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_run_time_fifo_is_an_error_not_a_hang(tmp_path: Path) -> None:
    plan = token_plan(tmp_path, n=1024)
    (tmp_path / "t.bin").unlink()
    os.mkfifo(tmp_path / "t.bin")
    result: list[BaseException] = []

    def read() -> None:
        try:
            D.make_data(plan).batch(0, 0)
        except BaseException as exc:  # noqa: BLE001
            result.append(exc)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "reading a FIFO blocked"
    assert isinstance(result[0], ValueError) and "not a regular file" in str(result[0])


def test_make_data_refuses_a_source_that_does_not_fit(tmp_path: Path) -> None:
    plan = token_plan(tmp_path, n=1024)
    bert = plan_of(tmp_path, "synthetic(seed = 0)", world=1, model="bert")
    import attrs

    wrong = attrs.evolve(bert, train=attrs.evolve(bert.train, data=plan.train.data))
    with pytest.raises(ValueError, match="classifies sequences"):
        D.make_data(wrong)


# ---- synthetic ----------------------------------------------------------------------------------


def test_synthetic_causal_lm_follows_a_learnable_rule(tmp_path: Path) -> None:
    plan = plan_of(tmp_path, "synthetic(seed = 5)", world=2, vocab=1000, seq_len=16)
    data = D.make_data(plan)
    assert isinstance(data, DS.SyntheticData)
    b = data.batch(0, 0)
    k = DS.SYNTHETIC_ALPHABET
    assert int(b.input_ids.max()) < k and torch.equal(b.labels, b.input_ids)
    for row in b.input_ids.tolist():
        assert any(all(row[t + 1] == (a * row[t] + c) % k for t in range(15)) for a, c in DS.SYNTHETIC_RULES)
    assert torch.equal(D.make_data(plan).batch(3, 1).input_ids, data.batch(3, 1).input_ids)
    assert not torch.equal(data.batch(3, 0).input_ids, data.batch(3, 1).input_ids)
    assert not torch.equal(data.batch(3, 0).input_ids, data.batch(4, 0).input_ids)


def test_synthetic_global_batch_does_not_depend_on_dp(tmp_path: Path) -> None:
    # a run resumed at another dp (runtime.checkpoint.store) continues on the same samples
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    one = D.make_data(plan_of(tmp_path / "a", "synthetic(seed = 5)", world=1, model="bert", labels=3))
    plan = plan_of(tmp_path / "b", "synthetic(seed = 5)", world=2, model="bert", labels=3)
    assert plan.mesh.dp == 2
    two = D.make_data(plan)
    whole, halves = one.batch(3, 0), [two.batch(3, r) for r in (0, 1)]
    for name in ("input_ids", "labels", "attention_mask"):
        assert torch.equal(torch.cat([getattr(h, name) for h in halves]), getattr(whole, name)), name


def test_synthetic_classification_label_is_the_over_represented_class(tmp_path: Path) -> None:
    plan = plan_of(tmp_path, "synthetic(seed = 5)", world=1, model="bert", labels=3, seq_len=32)
    b = D.make_data(plan).batch(0, 0)
    assert b.labels.shape == (8,) and int(b.labels.max()) < 3 and b.attention_mask is not None
    assert torch.equal(b.input_ids[:, 0] % 3, b.labels)  # the first token shows the class
    for ids, mask, label in zip(b.input_ids, b.attention_mask, b.labels):
        counts = torch.bincount(ids[mask.bool()] % 3, minlength=3)
        assert int(counts.argmax()) == int(label)
