"""Chat fine-tuning: `hf_dataset(path, tokenizer, messages = "messages")`.

Rendering by the tokenizer's chat template (and by a template file the spec names), the
assistant-only labels (the template's {% generation %} mask, and the prefix-rendering fallback
giving the same mask), truncation, the global batch's token count, the loss normalised per token
over the global batch (the reference equals one process over the whole global batch, which a
mean of microbatch means is not), check's diagnostics (E0433 has a golden too), and one spawned
gloo world whose `ppdsl verify` equals one process.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from ppdsl.core.task_loss import IGNORE_INDEX
from ppdsl.dsl.check import check_file
from ppdsl.lowering.lower import lower
from ppdsl.runtime.data import source as D
from ppdsl.core import chat_render as R
from ppdsl.runtime.data import chat as C

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "specs" / "data"
GPT2 = """model tiny {{
  source = hf("GPT2LMHeadModel")
  config {{ n_layer = 2, n_embd = 32, n_head = 2, n_positions = 64, vocab_size = 128,
           resid_pdrop = 0.0, embd_pdrop = 0.0, attn_pdrop = 0.0 }}
}}"""
CONVERSATION = [
    {"role": "system", "content": "be brief and exact ."},
    {"role": "user", "content": "what is two plus three ?"},
    {"role": "assistant", "content": "two plus three is five ."},
    {"role": "user", "content": "what colour is the sky ?"},
    {"role": "assistant", "content": "the sky is blue ."},
]


@pytest.fixture
def data(tmp_path: Path) -> Path:
    """The shipped conversations and tokenizer, under tmp_path; plain.jinja: its template
    without the {% generation %} marks."""
    shutil.copy(SHIPPED / "chat.jsonl", tmp_path / "chat.jsonl")
    shutil.copytree(SHIPPED / "chat_tokenizer", tmp_path / "tok")
    template = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())["chat_template"]
    plain = template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    (tmp_path / "plain.jinja").write_text(plain)
    return tmp_path


def spec_text(data: str, *, global_batch: int = 8, seq_len: int = 32, pp: int = 1, microbatches: int = 2,
              style: str = "1f1b", chunks: int = 1, packing: str | None = None, evaluation: str = "") -> str:
    return (f"ppspec 1\n{GPT2.format()}\nmesh {{ pp = {pp} }}\n"
            f"pipeline {{ style = {style}, chunks = {chunks}, microbatches = {microbatches} }}\n"
            f"train {{\n  global_batch = {global_batch}\n  seq_len = {seq_len}\n  seed = 3\n  steps = 2\n"
            + ("" if packing is None else f"  packing = {packing}\n")
            + (f"  eval {{ {evaluation} }}\n" if evaluation else "") +
            f"  optimizer = adamw(lr = 1e-2, weight_decay = 0.0)\n  data = {data}\n}}\n")


def check(tmp_path: Path, data: str, world: int | None = None, model: bool = False, **kw):
    path = tmp_path / "spec.ppspec"
    path.write_text(spec_text(data, **kw), encoding="utf-8")
    return check_file(path, world=world, model=model)


def plan_of(tmp_path: Path, data: str, world: int = 1, **kw):
    """The plan a run executes: lowered with check's facts of the model."""
    r = check(tmp_path, data, world=world, model=True, **kw)
    assert r.ok, [(d.code, d.message) for d in r.diagnostics if d.is_error]
    return lower(r.spec, world, r.model_info)


CHAT = 'hf_dataset("chat.jsonl", tokenizer = "tok", messages = "messages")'


# ---- rendering and masks ----------------------------------------------------------------------


def test_labels_are_the_assistant_turns_only(data: Path) -> None:
    tok = R.ChatTokenizer(str(data / "tok"))
    assert tok.marked
    ids, labels = tok.encode(CONVERSATION)
    assert len(ids) == len(labels)
    learned = [t for t in labels if t != IGNORE_INDEX]
    assert " ".join(tok.tok.convert_ids_to_tokens(learned)) == \
        "two plus three is five . <|im_end|> the sky is blue . <|im_end|>"
    assert all(lab in (IGNORE_INDEX, t) for t, lab in zip(ids, labels))
    assert labels[0] == IGNORE_INDEX and tok.tok.convert_ids_to_tokens(ids[:3]) == ["<|im_start|>", "system", "be"]


def test_prefix_rendering_gives_the_generation_mask(data: Path) -> None:
    marked = R.ChatTokenizer(str(data / "tok"))
    plain = R.ChatTokenizer(str(data / "tok"), (data / "plain.jinja").read_text())
    assert not plain.marked
    rows = [json.loads(line)["messages"] for line in (data / "chat.jsonl").read_text().splitlines()[:40]]
    for messages in rows + [CONVERSATION]:
        assert plain.encode(messages) == marked.encode(messages)


def test_a_tokenizer_without_a_template_is_refused_at_run_time(data: Path) -> None:
    config = data / "tok" / "tokenizer_config.json"
    doc = json.loads(config.read_text())
    del doc["chat_template"]
    config.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="has no chat template"):
        R.ChatTokenizer(str(data / "tok"))
    assert not R.ChatTokenizer(str(data / "tok"), (data / "plain.jinja").read_text()).marked


def test_bad_conversations_name_the_row(data: Path) -> None:
    (data / "bad.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(ValueError, match="line 1 of .*bad.jsonl.*no assistant turn"):
        C.read_conversations(str(data / "bad.jsonl"), None, "messages", str(data / "tok"), None)


# ---- samples and the global token count ---------------------------------------------------------


def test_samples_are_truncated_padded_and_counted(data: Path) -> None:
    plan = plan_of(data, CHAT, world=2, seq_len=16)
    src = D.make_data(plan)
    assert isinstance(src, C.ChatData)
    rows = src.conversations()
    assert max(len(ids) for ids, _ in rows) == 16  # the tail of longer conversations is cut
    b0, b1 = src.batch(0, 0), src.batch(0, 1)
    n = src.global_tokens(0)
    counted = sum(int((D_labels[:, 1:] != IGNORE_INDEX).sum()) for D_labels in (b0.labels, b1.labels))
    assert n == counted > 0
    m, dp = plan.schedule.microbatches, plan.mesh.dp
    assert b0.token_divisor == b1.token_divisor == pytest.approx(n / (m * dp))
    assert ((b0.labels == IGNORE_INDEX) | (b0.labels == b0.input_ids)).all()
    assert (b0.attention_mask.sum(1) > 0).all()
    mbs = src.microbatches(0, 0)
    assert len(mbs) == m and all(mb.token_divisor == b0.token_divisor for mb in mbs)


def test_the_loss_is_per_token_over_the_global_batch(data: Path) -> None:
    """The reference (as the pipeline: microbatches, dp replicas) equals one process computing
    sum / N over the whole global batch, loss and gradients; a mean of microbatch means does not."""
    from ppdsl.runtime.verify.reference import reference_run
    from ppdsl.runtime.stage.build import build_reference_model

    plan = plan_of(data, CHAT, world=2, microbatches=2)
    ref = reference_run(plan, 1)
    src = D.make_data(plan)
    batches = [src.batch(0, r) for r in range(plan.mesh.dp)]
    ids = torch.cat([b.input_ids for b in batches])
    labels = torch.cat([b.labels for b in batches])
    mask = torch.cat([b.attention_mask for b in batches])
    model = build_reference_model(plan.model, torch.device("cpu"), plan.train.seed, torch.float32)
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    targets = labels[:, 1:]
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), targets.reshape(-1),
                                             ignore_index=IGNORE_INDEX, reduction="sum") / int((targets != -100).sum())
    loss.backward()
    assert ref.losses[0] == pytest.approx(float(loss.detach()), rel=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(ref.grads[0][name], p.grad, rtol=1e-5, atol=1e-7)
    with torch.no_grad():
        means = [model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, labels=mb.labels).loss
                 for r in range(plan.mesh.dp) for mb in src.microbatches(0, r)]
    assert abs(float(sum(means)) / len(means) - float(loss.detach())) > 1e-4  # the normalisation matters here


# ---- packing = documents: whole conversations per window ------------------------------------------


def test_conversations_are_packed_whole_in_reading_order() -> None:
    assert R.pack_whole([5, 3, 4, 8, 1, 2], 8) == [[0, 1], [2], [3], [4, 5]]
    assert R.pack_whole([8, 8], 8) == [[0], [1]]
    assert R.pack_whole([], 8) == []
    assert R.pack_whole([0, 3], 8) == [[0, 1]]


def test_packed_windows_restart_positions_and_count_each_conversation_once(data: Path) -> None:
    plan = plan_of(data, CHAT, world=2, seq_len=64, packing="documents")
    src = D.make_data(plan)
    assert isinstance(src, C.ChatData) and src.packed
    rows = src.conversations()
    windows = src._samples
    assert sorted(i for w in windows for i in w) == list(range(len(rows)))  # each conversation once
    assert len(windows) < len(rows) and all(sum(len(rows[i][0]) for i in w) <= 64 for w in windows)
    b0, b1 = src.batch(0, 0), src.batch(0, 1)
    assert b0.attention_mask is None and b0.position_ids is not None
    per_window = src._order.items(range(0, src.batch_size))
    for r, w in enumerate(per_window):
        at = 0
        for i in windows[w]:
            ids, labels = rows[i]
            n = len(ids)
            assert b0.input_ids[r, at : at + n].tolist() == ids
            assert b0.position_ids[r, at : at + n].tolist() == list(range(n))
            assert b0.labels[r, at].item() == IGNORE_INDEX  # nothing predicts a conversation from the one before
            assert b0.labels[r, at + 1 : at + n].tolist() == labels[1:]
            at += n
        assert (b0.labels[r, at:] == IGNORE_INDEX).all()
    n = src.global_tokens(0)
    assert n == sum(int((b.labels[:, 1:] != IGNORE_INDEX).sum()) for b in (b0, b1)) > 0
    assert b0.token_divisor == pytest.approx(n / (plan.schedule.microbatches * plan.mesh.dp))


def test_packed_attention_stays_inside_each_conversation(data: Path) -> None:
    """The model's own mask builder keeps each conversation to itself: the window's logits on a
    conversation equal the conversation's alone (what E0472's probe proves before launch)."""
    from ppdsl.runtime.stage.build import build_reference_model

    plan = plan_of(data, CHAT, world=1, seq_len=64, packing="documents")
    src = D.make_data(plan)
    rows = src.conversations()
    batch = src.batch(0, 0)
    model = build_reference_model(plan.model, torch.device("cpu"), 0, torch.float32).eval()
    with torch.no_grad():
        packed = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits
        window = src._samples[src._order.items(range(1))[0]]
        assert len(window) > 1
        at = 0
        for i in window:
            ids = torch.tensor([rows[i][0]])
            alone = model(input_ids=ids, use_cache=False).logits
            torch.testing.assert_close(packed[0, at : at + ids.shape[1]], alone[0], rtol=1e-4, atol=1e-5)
            at += ids.shape[1]


# ---- mixtures and held-out conversations ----------------------------------------------------------


def two_chat_files(data: Path) -> str:
    lines = (data / "chat.jsonl").read_text().splitlines()
    (data / "a.jsonl").write_text("\n".join(lines[:200]) + "\n")
    (data / "b.jsonl").write_text("\n".join(lines[200:]) + "\n")
    return ('mix(hf_dataset("a.jsonl", tokenizer = "tok", messages = "messages"), '
            'hf_dataset("b.jsonl", tokenizer = "tok", messages = "messages"), weights = [0.6, 0.4])')


@pytest.mark.parametrize("packing", [None, "documents"])
def test_a_mixture_of_conversations_counts_the_whole_global_batch(data: Path, packing: str | None) -> None:
    from ppdsl.runtime.data.mix import MixedData

    plan = plan_of(data, two_chat_files(data), world=2, seq_len=64, packing=packing)
    src = D.make_data(plan)
    assert isinstance(src, MixedData)
    for step in range(3):
        batches = [src.batch(step, r) for r in range(plan.mesh.dp)]
        n = sum(int((b.labels[:, 1:] != IGNORE_INDEX).sum()) for b in batches)
        assert n > 0
        for b in batches:
            assert b.token_divisor == pytest.approx(n / (plan.schedule.microbatches * plan.mesh.dp))
            assert (b.position_ids is not None) == (packing == "documents")
            assert (b.attention_mask is None) == (packing == "documents")
    drawn = {p for step in range(6) for r in range(plan.mesh.dp) for p, _ in src.positions(step, r)}
    assert drawn == {0, 1}


def test_held_out_conversations_are_never_trained_on(data: Path) -> None:
    plan = plan_of(data, CHAT, world=1, seq_len=64, evaluation="data = holdout(0.25)")
    train = D.make_data(plan)
    held = D.make_data(plan, data=plan.train.eval.data)
    batch = held.batch(0, 0)
    assert batch.token_divisor == pytest.approx(int((batch.labels[:, 1:] != IGNORE_INDEX).sum()) / 2)
    train._ready()
    n = train.parts[0].count()
    trained = set(train._orders[0](range(2 * n)))  # two epochs of training
    evaluated = set(held._orders[0](range(n)))
    assert evaluated and not trained & evaluated and len(trained | evaluated) == n
    assert len(evaluated) == n // 4


# ---- check ---------------------------------------------------------------------------------------


def test_check_counts_what_seq_len_cuts_and_the_packed_windows(data: Path) -> None:
    assert not check(data, CHAT, seq_len=24).diagnostics  # --no-model: transformers renders nothing
    r = check(data, CHAT, seq_len=24, model=True)
    assert r.ok and [d.code for d in r.diagnostics] == ["N0481"], [(d.code, d.message) for d in r.diagnostics]
    assert "of the 384 conversations are longer than seq_len = 24" in r.diagnostics[0].message
    assert r.diagnostics[0].span.line == spec_text(CHAT).splitlines().index("  seq_len = 32") + 1
    assert [d.code for d in check(data, CHAT, seq_len=64, model=True).diagnostics] == []
    (data / "few.jsonl").write_text("\n".join(json.dumps({"messages": CONVERSATION[1:3]}) for _ in range(10)) + "\n")
    few = CHAT.replace("chat.jsonl", "few.jsonl")
    assert check(data, few, global_batch=8, seq_len=64).ok  # 10 conversations, one sample each
    r = check(data, few, global_batch=8, seq_len=64, packing="documents", model=True)  # 18 tokens each: 3 per window
    assert [d.code for d in r.diagnostics] == ["E0414"] and "packed whole into 4 windows" in r.diagnostics[0].message
    r = check(data, 'mix(hf_dataset("chat.jsonl", tokenizer = "tok", messages = "messages"), '
                    'hf_dataset("chat.jsonl", tokenizer = "tok", text = "messages"))', seq_len=64)
    assert "E0455" in [d.code for d in r.diagnostics], [(d.code, d.message) for d in r.diagnostics]
    r = check(data, CHAT, seq_len=64, packing="windows")
    assert [d.code for d in r.diagnostics] == ["E0470"] and "packing = documents" in r.diagnostics[0].message
    assert check(data, CHAT, seq_len=64, packing="none").ok
    # the source's own packing argument packs documents, not conversations
    r = check(data, CHAT[:-1] + ", packing = true)", seq_len=64)
    assert [d.code for d in r.diagnostics] == ["E0470"] and "train.packing" in r.diagnostics[0].message
    assert r.diagnostics[0].span.line == spec_text(CHAT[:-1] + ", packing = true)").splitlines().index(
        "  data = " + CHAT[:-1] + ", packing = true)") + 1


def test_check_accepts_the_shipped_spec_and_a_named_template(data: Path) -> None:
    assert check_file(ROOT / "specs" / "chat_sft.ppspec", model=False).ok
    r = check(data, 'hf_dataset("chat.jsonl", tokenizer = "tok", messages = "messages", chat_template = "plain.jinja")')
    assert r.ok, [(d.code, d.message) for d in r.diagnostics]


@pytest.mark.parametrize("case, code, option", [
    ("no_template", "E0433", None),
    ("missing_file", "E0410", "nope.jinja"),
    ("bad_messages", "E0416", None),
    ("no_field", "E0416", None),
])
def test_check_refuses(data: Path, case: str, code: str, option: str | None) -> None:
    call = CHAT
    if case == "no_template":
        config = data / "tok" / "tokenizer_config.json"
        doc = json.loads(config.read_text())
        del doc["chat_template"]
        config.write_text(json.dumps(doc))
    elif case == "missing_file":
        call = CHAT[:-1] + f', chat_template = "{option}")'
    elif case == "bad_messages":
        (data / "chat.jsonl").write_text("\n".join(json.dumps({"messages": m}) for m in
                                                   ([CONVERSATION] * 3 + [[{"role": "user", "content": 3}]])) + "\n")
    else:
        call = CHAT.replace('messages = "messages"', 'messages = "conversation"')
    r = check(data, call)
    codes = [d.code for d in r.diagnostics]
    assert codes == [code], [(d.code, d.message) for d in r.diagnostics]
    line = spec_text(call).splitlines().index(f"  data = {call}") + 1
    assert r.diagnostics[0].span.line == line


# ---- distributed: ppdsl verify equals one process -----------------------------------------------


@pytest.mark.distributed
def test_verify_at_world_2_equals_one_process(data: Path) -> None:
    from dist_harness import run_distributed
    from test_hf_dataset import verify_worker

    plans = [
        ("1f1b_pp2", plan_of(data, CHAT, world=2, pp=2, microbatches=4).to_json()),
        ("dp2_gpipe", plan_of(data, CHAT, world=2, style="gpipe", microbatches=2).to_json()),
        ("mix_packed_dp2", plan_of(data, two_chat_files(data), world=2, seq_len=64, microbatches=2,
                                   packing="documents", evaluation="data = holdout(0.25)").to_json()),
    ]
    results = run_distributed(verify_worker, 2, plans, timeout=150)
    assert [name for name, *_ in results[0]] == [name for name, _ in plans]
    for name, ok, text in results[0]:
        assert ok, f"{name}:\n{text}"


def test_an_assistant_turn_first_is_found(data: Path) -> None:
    marked = R.ChatTokenizer(str(data / "tok"))
    plain = R.ChatTokenizer(str(data / "tok"), (data / "plain.jinja").read_text())
    messages = CONVERSATION[2:]  # the assistant speaks first
    assert plain.encode(messages) == marked.encode(messages)
    assert marked.encode(messages)[1][0] == IGNORE_INDEX  # <|im_start|>: the template's, not the answer
