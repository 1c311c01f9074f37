"""Source/target pairs for encoder-decoder models (issue 32, item 4): ``hf_dataset(path, tokenizer,
text = "source", target = "target")`` read by `ppdsl.runtime.data.pairs`.

Each row's source is tokenized with the tokenizer's special tokens, truncated to seq_len and padded
with the pad id under an attention mask; its target likewise, padded with -100 in the labels. The
order is the file sources' (`runtime.data.order._Order`). Check accepts the pairs for a seq2seq
model and refuses, at the data line, what does not fit: E0442 (no target for an encoder-decoder,
or a target for another model), E0416 (no such target field), E0413 (tokenizer beyond the
vocabulary), E0438 (another file source). One gloo world of 2 (pp 2) trains two steps on padded
pairs against the single-process reference.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from _exec_harness import equivalence_worker  # noqa: E402
from dist_harness import run_distributed  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER = ROOT / "specs" / "data" / "pairs_tokenizer"  # <s> 0, <pad> 1, </s> 2, <unk> 3; <s> ... </s> around texts
PAIRS = ROOT / "specs" / "data" / "pairs.jsonl"
BART = dict(vocab_size=32, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
            pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
            dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)  # the harness compares with dropout as written
GPT2 = dict(vocab_size=32, n_embd=32, n_layer=2, n_head=4, n_positions=64)


def _data(path: Path | str = PAIRS, **options: str) -> str:
    opts = {"tokenizer": str(TOKENIZER), "text": "source", "target": "target", **options}
    written = ", ".join(f'{k} = "{v}"' for k, v in opts.items() if v is not None)
    return f'hf_dataset("{path}", {written})'


def _spec(data: str, cls: str = "BartForConditionalGeneration", config: dict[str, Any] = BART,
          mesh: str = "pp = 2", seq_len: int = 8) -> str:
    values = ", ".join(f"{k} = {v}" for k, v in config.items())
    return f"""ppspec 1
model m {{
  source = hf("{cls}")
  config {{ {values} }}
}}
mesh {{ {mesh} }}
pipeline {{ style = 1f1b, microbatches = 2 }}
train {{ global_batch = 4, seq_len = {seq_len}, steps = 2, optimizer = sgd(lr = 1e-2),
  data = {data} }}
"""


from _spec_text import check_text as _check, plan_text as _plan  # noqa: E402


def _errors(tmp_path: Path, text: str, world: int = 2) -> list[Any]:
    return [d for d in _check(tmp_path, text, world).diagnostics if d.is_error]


def _data_line(text: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if "data = " in line)


def _pairs(tmp_path: Path, rows: list[tuple[str, str]]) -> Path:
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps({"source": s, "target": t}) + "\n" for s, t in rows), encoding="utf-8")
    return path


def _source(path: Path, seq_len: int = 6, batch_size: int = 4, dp: int = 1, seed: int = 0) -> Any:
    from ppdsl.runtime.data.pairs import PairData

    return PairData(path=str(path), tokenizer=str(TOKENIZER), split=None, text="source", target="target", seed=seed,
                    seq_len=seq_len, batch_size=batch_size, microbatch_size=batch_size // 2, dp=dp, vocab_size=32)


def test_rows_are_tokenized_truncated_and_padded(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(TOKENIZER / "tokenizer.json"))
    tok.enable_truncation(6)  # as HF's truncation = True, max_length = seq_len: the special tokens kept
    rows = [("one", "eins zwei drei vier five"), ("one two three four five six", "eins"),
            ("two two", "zwei zwei"), ("three", "drei")]
    data = _source(_pairs(tmp_path, rows))
    batch = data.batch(0, 0)
    picked = data._order.items(range(4))  # the rows of step 0, in batch order
    for r, i in enumerate(picked):
        source, target = (tok.encode(t).ids for t in rows[i])
        assert source[0] == target[0] == 0 and source[-1] == target[-1] == 2  # <s> ... </s>, also when cut
        assert batch.input_ids[r].tolist() == source + [1] * (6 - len(source))  # the pad id
        assert batch.attention_mask[r].tolist() == [1] * len(source) + [0] * (6 - len(source))
        assert batch.labels[r].tolist() == target + [-100] * (6 - len(target))  # no loss on the padding
    assert batch.input_ids.shape == batch.labels.shape == (4, 6)
    assert sorted(batch.attention_mask.sum(1).tolist()) == [3, 3, 4, 6]  # "one two ... six" cut to 6
    # a target without any token (an empty field, under a tokenizer without special tokens) is refused
    empty = tmp_path / "empty"
    empty.mkdir()
    bare = Tokenizer.from_file(str(TOKENIZER / "tokenizer.json"))
    bare.post_processor = None
    bare.save(str(empty / "tokenizer.json"))
    bad = _source(_pairs(tmp_path, [*rows[:3], ("one", "")]))
    bad.tokenizer = str(empty)
    with pytest.raises(ValueError, match="line 4 .*gives no token"):
        bad.batch(0, 0)


def test_csv_and_parquet_give_the_same_pairs_as_json_lines(tmp_path: Path) -> None:
    import csv

    rows = [json.loads(line) for line in PAIRS.read_text(encoding="utf-8").splitlines()][:40]
    jsonl = _pairs(tmp_path, [(r["source"], r["target"]) for r in rows])
    with open(tmp_path / "pairs.csv", "w", encoding="utf-8", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["source", "target"])
        writer.writeheader()
        writer.writerows(rows)
    paths = [jsonl, tmp_path / "pairs.csv"]
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({k: [r[k] for r in rows] for k in ("source", "target")}), tmp_path / "pairs.parquet")
        paths.append(tmp_path / "pairs.parquet")
    except ImportError:  # the optional data extra
        pass
    sources = [_source(p, seq_len=12) for p in paths]
    for step in range(12):  # past one epoch
        first, *others = [s.batch(step, 0) for s in sources]
        for b in others:
            assert torch.equal(b.input_ids, first.input_ids) and torch.equal(b.labels, first.labels)
            assert torch.equal(b.attention_mask, first.attention_mask)


def test_the_order_is_a_function_of_seed_step_and_rank(tmp_path: Path) -> None:
    path = _pairs(tmp_path, [(" ".join(["one"] * (1 + i % 5)), " ".join(["eins"] * (1 + i % 3))) for i in range(24)])
    whole = _source(path, batch_size=4)
    again = _source(path, batch_size=4)
    halves = _source(path, batch_size=2, dp=2)
    for step in range(8):  # past one epoch (24 rows, 4 a step)
        b = whole.batch(step, 0)
        assert torch.equal(b.input_ids, again.batch(step, 0).input_ids)
        # the global batch does not depend on how it is split over replicas
        split = [halves.batch(step, r) for r in (0, 1)]
        assert torch.equal(b.input_ids, torch.cat([s.input_ids for s in split]))
        assert torch.equal(b.labels, torch.cat([s.labels for s in split]))
    firsts = [whole._order.items(range(24 * e, 24 * (e + 1))) for e in (0, 1)]
    assert sorted(firsts[0]) == sorted(firsts[1]) == list(range(24)) and firsts[0] != firsts[1]  # each row once an epoch
    assert _source(path, seed=1)._order is None  # read on first use
    assert not torch.equal(_source(path, seed=1).batch(0, 0).input_ids, whole.batch(0, 0).input_ids)


def test_check_accepts_pairs_and_the_plan_reads_them(tmp_path: Path) -> None:
    from ppdsl.runtime.data.source import make_data

    plan = _plan(tmp_path, _spec(_data()))
    source = make_data(plan)
    assert type(source).__name__ == "PairData" and source.task == "seq2seq"
    batch = source.batch(0, 0)
    assert (batch.labels == -100).any() and (batch.attention_mask == 0).any()  # padded sources and targets


def test_what_does_not_fit_is_refused_at_the_data_line(tmp_path: Path) -> None:
    # an encoder-decoder model given hf_dataset without target
    text = _spec(_data(target=None))
    errors = _errors(tmp_path, text)
    assert [d.code for d in errors] == ["E0442"] and errors[0].span.line == _data_line(text)
    # target on a model that is not an encoder-decoder
    text = _spec(_data(), "GPT2LMHeadModel", GPT2, mesh="pp = 1")
    errors = _errors(tmp_path, text, world=1)
    assert [d.code for d in errors] == ["E0442"] and "GPT2LMHeadModel is not one" in errors[0].message
    assert errors[0].span.line == _data_line(text)
    # a target field the rows do not have
    text = _spec(_data(target="translation"))
    errors = _errors(tmp_path, text)
    assert [d.code for d in errors] == ["E0416"] and "'translation'" in errors[0].message
    # a tokenizer with more ids than the model's vocabulary
    errors = _errors(tmp_path, _spec(_data(), config={**BART, "vocab_size": 16}))
    assert [d.code for d in errors] == ["E0413"]
    # fewer pairs than one global batch
    errors = _errors(tmp_path, _spec(_data(_pairs(tmp_path, [("one", "eins")] * 3))))
    assert [d.code for d in errors] == ["E0414"]
    # another file source gives one sequence per sample
    (tmp_path / "corpus.txt").write_text("one two\n" * 50, encoding="utf-8")
    errors = _errors(tmp_path, _spec(f'text("corpus.txt", tokenizer = "{TOKENIZER}")'))
    assert "E0438" in [d.code for d in errors]


def test_pairs_are_mixed_and_held_out(tmp_path: Path) -> None:
    from ppdsl.runtime.data.source import make_data
    from ppdsl.runtime.data.mix import MixedData

    other = _pairs(tmp_path, [("one two", "eins zwei")] * 12)
    text = _spec(f'mix({_data()}, {_data(other)}, weights = [0.5, 0.5])').replace(
        "steps = 2,", "steps = 2, eval { data = holdout(0.25) },")
    plan = _plan(tmp_path, text)
    train, held = make_data(plan), make_data(plan, data=plan.train.eval.data)
    assert isinstance(train, MixedData) and isinstance(held, MixedData)
    batch = train.batch(0, 0)
    assert batch.attention_mask is not None and (batch.labels != -100).any()
    ids = {tuple(row.tolist()) for step in range(8) for row in train.batch(step, 0).input_ids}
    assert len({row[:3] for row in ids}) > 1  # both sources drawn
    assert held.batch(0, 0).input_ids.shape == batch.input_ids.shape
    text = _spec(f'mix({_data()}, text("corpus.txt", tokenizer = "{TOKENIZER}"))')
    (tmp_path / "corpus.txt").write_text("one two\n" * 50, encoding="utf-8")
    errors = _errors(tmp_path, text)
    assert "E0438" in [d.code for d in errors]
    assert errors[0].span.line == _data_line(text)


@pytest.mark.distributed
def test_bart_on_padded_pairs_at_pp2_matches_one_process(tmp_path: Path) -> None:
    # seq_len 6 cuts the longer rows and pads the shorter: -100 target tails and masked sources
    plan = _plan(tmp_path, _spec(_data(), seq_len=6))
    # and a mixture of two pair sources: every stage gets the encoder's mask from it
    other = _pairs(tmp_path, [("one two", "eins zwei"), ("three", "drei")] * 6)
    mixed = _plan(tmp_path, _spec(f'mix({_data()}, {_data(other)}, weights = [0.6, 0.4])', seq_len=6))
    for report, _seconds in run_distributed(equivalence_worker, 2, [plan, mixed], timeout=180)[0]:
        assert report.ok, report.render()
