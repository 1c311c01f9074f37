"""The token cache of the document sources (runtime/data/cache.py): tokenized once, memory-mapped.

A second read maps the entry without calling the tokenizer; a changed data file is a new key
(rebuilt, the stale entry removed); a data folder that cannot be written falls back to the user's
cache folder (XDG_CACHE_HOME respected); the mapped ids equal tokenizing in memory (packed
documents, padded documents, a text corpus with CRLF line ends and chunks); one of several
concurrent readers builds while the others wait, and a wait past the timeout ends named.
"""

from __future__ import annotations

import fcntl
import itertools
import json
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
import pyarrow.parquet as pq  # noqa: E402

from ppdsl.runtime.data import cache as C  # noqa: E402
from ppdsl.runtime.data import docs as DD  # noqa: E402
from ppdsl.runtime.data import files as F  # noqa: E402
from ppdsl.runtime.run.failure import RunFault  # noqa: E402

WORDS = ["the", "cat", "sat", "on", "a", "mat", "dog", "ran", "far", "away", "big", "red", "house"]
DOCS = ["the cat sat on a mat", "a dog ran far away", "", "big red house", "the dog sat", "a cat ran",
        "red mat", "the big house ran away"]


def make_tokenizer(directory: Path) -> Path:
    """WordLevel over WORDS: [PAD] 0, [UNK] 1, </s> 2 (the eos_token), words from 3."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    directory.mkdir(parents=True, exist_ok=True)
    vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "</s>"] + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "pad_token": "[PAD]"}))
    return directory


def ids_of(text: str) -> list[int]:
    return [3 + WORDS.index(w) for w in text.split()]


def packed(tmp_path: Path, docs: list[str] = DOCS, name: str = "data/c.parquet", **kw) -> DD.PackedDocuments:
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        pq.write_table(pa.table({"text": docs}), path)
    tok = tmp_path / "tok"
    if not tok.exists():
        make_tokenizer(tok)
    return DD.PackedDocuments(path=str(path), dtype=None, tokenizer=str(tok), seed=3, seq_len=4, batch_size=2,
                              microbatch_size=1, dp=1, vocab_size=None, **kw)


def no_tokenizer(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*a, **k):
        raise AssertionError("the tokenizer was loaded")

    monkeypatch.setattr(F, "_Tokenizer", refuse)
    monkeypatch.setattr(DD, "_Tokenizer", refuse)


def entries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("*.json")) if folder.is_dir() else []


def test_built_once_and_a_second_read_does_not_tokenize(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    want = [i for d in DOCS if d for i in ids_of(d) + [2]]
    first = packed(tmp_path)
    assert first.tokens().tolist() == want
    beside = tmp_path / "data" / C.BESIDE
    assert len(entries(beside)) == 1
    no_tokenizer(monkeypatch)
    again = packed(tmp_path)
    assert isinstance(again.tokens(), np.memmap) and again.tokens().tolist() == want
    for step in range(3):
        assert (again.batch(step, 0).input_ids == first.batch(step, 0).input_ids).all()
    padded = DD.PaddedDocuments(path=first.path, tokenizer=first.tokenizer, split=None, text="text", seed=3,
                                seq_len=4, batch_size=2, microbatch_size=1, dp=1, vocab_size=None)
    assert padded.batch(0, 0).attention_mask.shape == (2, 4)  # same entry: pad id from its json


def test_a_changed_file_is_rebuilt_and_the_stale_entry_removed(tmp_path: Path) -> None:
    data = packed(tmp_path)
    data.tokens()
    beside = tmp_path / "data" / C.BESIDE
    old = entries(beside)
    time.sleep(0.01)
    pq.write_table(pa.table({"text": ["red red red", "big big dog"]}), tmp_path / "data" / "c.parquet")
    assert packed(tmp_path).tokens().tolist() == ids_of("red red red") + [2] + ids_of("big big dog") + [2]
    now = entries(beside)
    assert len(now) == 1 and now != old
    assert not [p for p in beside.iterdir() if p.name.startswith(old[0][: -len(".json")])]


def test_an_unwritable_data_folder_falls_back_to_the_user_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = packed(tmp_path)
    (tmp_path / "data" / C.BESIDE).write_text("not a folder")  # the cache folder cannot be made (root included)
    if os.geteuid() != 0:
        os.chmod(tmp_path / "data", 0o555)
    monkeypatch.delenv("PPDSL_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    try:
        assert data.tokens().tolist()[:3] == ids_of("the cat sat")
    finally:
        os.chmod(tmp_path / "data", 0o755)
    assert len(entries(tmp_path / "xdg" / "ppdsl" / C.SUBDIR)) == 1
    no_tokenizer(monkeypatch)
    assert packed(tmp_path).tokens().tolist() == data.tokens().tolist()


def test_caching_off_writes_nothing_and_reads_the_same(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PPDSL_NO_CACHE", "1")
    assert packed(tmp_path).tokens().tolist() == [i for d in DOCS if d for i in ids_of(d) + [2]]
    assert not (tmp_path / "data" / C.BESIDE).exists()


def test_mapped_ids_equal_tokenizing_in_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tokenizers import Tokenizer

    monkeypatch.setattr(F, "TEXT_CHUNK", 40)  # several tokenizer calls, cut at whole lines
    tok = make_tokenizer(tmp_path / "tok")
    lines = [" ".join(WORDS[i % 13 : i % 13 + 1 + i % 5]) for i in range(40)]
    corpus = "\r\n".join(lines) + "\n"
    (tmp_path / "c.txt").write_bytes(corpus.encode())
    text = F.TextData(path=str(tmp_path / "c.txt"), dtype=None, tokenizer=str(tok), seed=1, seq_len=4,
                      batch_size=2, microbatch_size=1, dp=1, vocab_size=None)
    reference = Tokenizer.from_file(str(tok / "tokenizer.json"))
    text_mode = open(tmp_path / "c.txt", encoding="utf-8").read()  # noqa: SIM115 - as the source read it before
    chunks, pieces, size = [], [], 0
    for line in text_mode.splitlines(keepends=True):
        pieces.append(line)
        size += len(line)
        if size >= 40:
            chunks.append("".join(pieces))
            pieces, size = [], 0
    chunks.append("".join(pieces))
    want = [i for c in chunks for i in reference.encode(c, add_special_tokens=False).ids]
    assert len(chunks) > 3 and text.tokens().tolist() == want
    docs = packed(tmp_path, name="d/docs.parquet")
    assert docs.tokens().dtype.name == "uint16"  # 16 ids: two bytes each
    starts = DD.read_documents(docs.path, None, "text", str(tok)).starts.tolist()
    assert starts == list(itertools.accumulate([len(ids_of(d)) + 1 for d in DOCS if d], initial=0))


def test_one_of_several_readers_builds_the_others_wait(tmp_path: Path) -> None:
    make_tokenizer(tmp_path / "tok")
    (tmp_path / "f.txt").write_text("x")
    calls: list[int] = []

    def build(out: C.Writer) -> dict:
        calls.append(1)
        time.sleep(0.3)
        out.begin(100)
        out.add([[1, 2, 3], [4]])
        return {"pad_id": 0}

    got: list[list[int]] = []

    def read() -> None:
        got.append(C.cached_tokens(str(tmp_path / "f.txt"), [str(tmp_path / "f.txt")], str(tmp_path / "tok"),
                                   {"kind": "test"}, build).tokens.tolist())

    threads = [threading.Thread(target=read) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert calls == [1] and got == [[1, 2, 3, 4]] * 4


def test_a_wait_past_the_timeout_ends_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = packed(tmp_path)
    beside = tmp_path / "data" / C.BESIDE
    data.tokens()
    lock = next(beside.glob("*.lock"))
    for p in beside.glob("*.json"):
        p.unlink()  # as if never built
    fd = os.open(lock, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.pwrite(fd, b"4242\n", 0)
    monkeypatch.setenv(C.TIMEOUT_ENV, "0.3")
    try:
        with pytest.raises(RunFault, match=r"c\.parquet: .*\.lock is held by process 4242"):
            packed(tmp_path).tokens()
    finally:
        os.close(fd)


def test_bad_data_caches_nothing(tmp_path: Path) -> None:
    data = packed(tmp_path, docs=["", ""])
    with pytest.raises(ValueError, match="no document has any token"):
        data.tokens()
    assert entries(tmp_path / "data" / C.BESIDE) == []


# ---- background prefetch (runtime/data/prefetch.py) --------------------------------------------------


def test_prefetch_reads_the_next_step_while_this_one_runs() -> None:
    from ppdsl.runtime.data.prefetch import Prefetcher

    reads: list[tuple[int, str]] = []

    def read(step: int) -> int:
        reads.append((step, threading.current_thread().name))
        time.sleep(0.2)
        if step == 3:
            raise ValueError("bad row at step 3")
        return step * 10

    with Prefetcher(read, end=5) as feed:
        assert feed.take(0) == 0 and feed.wait_s >= 0.2  # nothing read ahead yet
        time.sleep(0.4)  # the step's compute: step 1 is read meanwhile
        assert feed.take(1) == 10 and feed.wait_s < 0.1
        assert feed.take(2) == 20 and 0.1 < feed.wait_s  # no compute between: the step waits
        with pytest.raises(ValueError, match="step 3"):  # a read-ahead's error, at the step that uses it
            feed.take(3)
        assert feed.take(0) == 0  # out of sequence: read now
    assert [s for s, _ in reads][:5] == [0, 1, 2, 3, 0]  # then step 1's read ahead, unless close dropped it
    assert reads[0][1] == threading.current_thread().name and reads[1][1].startswith("ppdsl-data")


# ---- each replica reads its share; exact resume (runtime/data/source.py's order, the training loop's reads) ----

RESUME_DOCS = [" ".join(WORDS[(7 * i + j) % 13] for j in range(1 + i % 6)) for i in range(90)]
DECODER = """model tiny {
  source = python("ppdsl.models.decoder:build_decoder")
  config { vocab_size = 32, dim = 32, n_layers = 2, n_heads = 2, max_seq_len = 8 }
}"""


def resume_plan(tmp_path: Path, world: int, packing: bool = True, steps: int = 8):
    """A causal LM on `world` data-parallel ranks, reading RESUME_DOCS from a Parquet file."""
    from ppdsl.dsl.check import check_file
    from ppdsl.lowering.lower import lower

    if not (tmp_path / "r.parquet").exists():
        pq.write_table(pa.table({"text": RESUME_DOCS}), tmp_path / "r.parquet")
        make_tokenizer(tmp_path / "tok")
    spec = tmp_path / f"r{world}{packing}.ppspec"
    spec.write_text(f"ppspec 1\n{DECODER}\nmesh {{ pp = 1 }}\npipeline {{ style = 1f1b, microbatches = 2 }}\n"
                    f"train {{\n  global_batch = 8\n  seq_len = 8\n  seed = 5\n  steps = {steps}\n"
                    "  optimizer = adamw(lr = 1e-2, weight_decay = 0.0)\n"
                    f'  data = hf_dataset("r.parquet", tokenizer = "tok", packing = {str(packing).lower()})\n}}\n')
    r = check_file(spec, world=world, model=True)
    assert r.ok, [(d.code, d.message) for d in r.diagnostics if d.is_error]
    return lower(r.spec, world, r.model_info)


def test_each_replica_touches_only_the_windows_of_its_samples(tmp_path: Path) -> None:
    from ppdsl.runtime.data.source import make_data

    class Touched:
        def __init__(self, ids) -> None:
            self.ids, self.slices = ids, []
            self.shape = ids.shape

        def __getitem__(self, key):
            self.slices.append((key.start, key.stop))
            return self.ids[key]

    plan = resume_plan(tmp_path, world=2)
    for rank in range(2):
        data = make_data(plan)
        data.tokens()
        data._tokens = Touched(data._tokens)
        b = data.batch(3, rank)
        items = data._order.items(range(3 * 8 + rank * 4, 3 * 8 + rank * 4 + 4))
        assert data._tokens.slices == [(8 * i, 8 * i + 8) for i in items]
        assert [row.tolist() for row in b.input_ids] == [data._tokens.ids[8 * i : 8 * i + 8].tolist() for i in items]


def samples(plan, steps: range, pick=None) -> list[list[list[int]]]:
    """What the training loop reads at each step of `steps` (Trainer.read_step through the
    Prefetcher, from fresh sources as a new process builds them): the global batch, the replicas'
    microbatches in rank order."""
    from ppdsl.runtime.data.source import make_data
    from ppdsl.runtime.data.prefetch import Prefetcher

    dp = plan.mesh.dp
    sources = [make_data(plan) for _ in range(dp)]
    feeds = [Prefetcher(lambda s, r=r: sources[r].microbatches(s, r), steps.stop) for r in range(dp)]
    out = []
    try:
        for s in steps:
            out.append([row for r in range(dp) for mb in feeds[r].take(s) for row in mb.input_ids.tolist()])
    finally:
        for f in feeds:
            f.close()
    return out


@pytest.mark.parametrize("packing", [True, False])
def test_a_resume_at_a_random_step_under_any_dp_reads_what_the_whole_run_reads(tmp_path: Path, packing: bool) -> None:
    import random

    steps = 24  # 90 documents (packed: about 40 windows) in global batches of 8: several epochs
    whole = samples(resume_plan(tmp_path, 1, packing, steps), range(steps))
    rng = random.Random()
    for before, after in [(1, 1), (2, 2), (1, 2), (2, 4), (4, 1)]:
        k = rng.randrange(1, steps)
        got = samples(resume_plan(tmp_path, before, packing, steps), range(k)) + \
            samples(resume_plan(tmp_path, after, packing, steps), range(k, steps))
        assert got == whole, f"stopped after step {k} at dp {before}, resumed at dp {after}"
    if packing:  # an epoch reads each window once: none skipped or seen twice across the resume
        from ppdsl.runtime.data.source import make_data

        ids = make_data(resume_plan(tmp_path, 1)).tokens()
        n = len(ids) // 8
        first_epoch = [tuple(row) for step in whole for row in step][:n]
        assert sorted(first_epoch) == sorted(tuple(ids[8 * i : 8 * i + 8].tolist()) for i in range(n))


def _resume_worker(rank: int, world: int, plan_json: dict, ckpt: str, k: int, whole: bool) -> dict:
    """A real training loop on this rank: with `whole`, the uninterrupted run, then one stopped
    after step k (its checkpoint saved) and a new trainer resumed from that checkpoint; without,
    only the resume. What each step's read gave this rank, and the losses."""
    import io

    import torch

    from ppdsl.lowering.plan import Plan
    from ppdsl.runtime.checkpoint.store import Checkpointer, step_name
    from ppdsl.runtime.parallel.groups import build_process_groups, tie_pp_ranks_of
    from ppdsl.runtime.train.metrics import MetricsLogger
    from ppdsl.runtime.train.trainer import Trainer
    from ppdsl.runtime.train.loop import run_steps

    plan = Plan.from_json(plan_json)

    def trainer(log: dict) -> Trainer:
        t = Trainer(plan, build_process_groups(plan.mesh, "cpu", tie_pp_ranks_of(plan.schedule.stage_ranks)),
                    torch.device("cpu"))
        read = t.read_step

        def recorded(step: int) -> list:
            mbs = read(step)
            log[step] = [row for mb in mbs for row in mb.input_ids.tolist()]
            return mbs

        t.read_step = recorded  # what the loop's Prefetcher calls
        return t

    def loop(t: Trainer, **kw) -> list[float]:
        logger = MetricsLogger(None, plan.train.steps, enabled=False, stream=io.StringIO())
        return [r.loss for r in run_steps(t, logger, **kw)]

    out: dict = {"whole": {}, "first": {}, "resumed": {}}
    checkpointer = Checkpointer(Path(ckpt), plan, rank)
    if whole:
        out["whole_losses"] = loop(trainer(out["whole"]))
        loop(trainer(out["first"]), steps=k, checkpointer=checkpointer)
    t = trainer(out["resumed"])
    start = checkpointer.load(t, Path(ckpt) / step_name(k))
    out["start"] = start
    out["resumed_losses"] = loop(t, start=start)
    return out


@pytest.mark.distributed
def test_a_run_stopped_at_a_random_step_resumes_with_the_same_samples_under_the_same_and_another_dp(
        tmp_path: Path) -> None:
    """The real loop and checkpoints: dp 2 uninterrupted vs stopped after step k and resumed at
    dp 2, and that checkpoint resumed at dp 1."""
    import random

    from dist_harness import run_distributed

    steps = 6
    k = random.Random().randrange(1, steps)
    ckpt = str(tmp_path / "ckpt")
    two = run_distributed(_resume_worker, 2, resume_plan(tmp_path, 2, steps=steps).to_json(), ckpt, k, True,
                          timeout=240)
    one = run_distributed(_resume_worker, 1, resume_plan(tmp_path, 1, steps=steps).to_json(), ckpt, k, False,
                          timeout=240)

    def glob(results: list[dict], part: str) -> dict[int, list]:
        return {s: [row for r in results for row in r[part][s]] for s in results[0][part]}

    whole = glob(two, "whole")
    assert sorted(whole) == list(range(steps))
    assert two[0]["start"] == one[0]["start"] == k
    assert glob(two, "first") == {s: whole[s] for s in range(k)}, f"stopped after step {k}"
    assert glob(two, "resumed") == {s: whole[s] for s in range(k, steps)}, f"resumed after step {k} at dp 2"
    assert glob(one, "resumed") == {s: whole[s] for s in range(k, steps)}, f"resumed after step {k} at dp 1"
    assert two[0]["resumed_losses"] == pytest.approx(two[0]["whole_losses"][k:], rel=1e-5)
    assert one[0]["resumed_losses"] == pytest.approx(two[0]["whole_losses"][k:], rel=1e-4)
