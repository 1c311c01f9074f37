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
from ppdsl.runtime import data as D
from ppdsl.runtime import data_chat as C

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
              style: str = "1f1b", chunks: int = 1) -> str:
    return (f"ppspec 1\n{GPT2.format()}\nmesh {{ pp = {pp} }}\n"
            f"pipeline {{ style = {style}, chunks = {chunks}, microbatches = {microbatches} }}\n"
            f"train {{\n  global_batch = {global_batch}\n  seq_len = {seq_len}\n  seed = 3\n  steps = 2\n"
            f"  optimizer = adamw(lr = 1e-2, weight_decay = 0.0)\n  data = {data}\n}}\n")


def check(tmp_path: Path, data: str, world: int | None = None, **kw):
    path = tmp_path / "spec.ppspec"
    path.write_text(spec_text(data, **kw), encoding="utf-8")
    return check_file(path, world=world, model=False)


def plan_of(tmp_path: Path, data: str, world: int = 1, **kw):
    r = check(tmp_path, data, world=world, **kw)
    assert r.ok, [(d.code, d.message) for d in r.diagnostics]
    return lower(r.spec, world)


CHAT = 'hf_dataset("chat.jsonl", tokenizer = "tok", messages = "messages")'


# ---- rendering and masks ----------------------------------------------------------------------


def test_labels_are_the_assistant_turns_only(data: Path) -> None:
    tok = C.ChatTokenizer(str(data / "tok"))
    assert tok.marked
    ids, labels = tok.encode(CONVERSATION)
    assert len(ids) == len(labels)
    learned = [t for t in labels if t != IGNORE_INDEX]
    assert " ".join(tok.tok.convert_ids_to_tokens(learned)) == \
        "two plus three is five . <|im_end|> the sky is blue . <|im_end|>"
    assert all(lab in (IGNORE_INDEX, t) for t, lab in zip(ids, labels))
    assert labels[0] == IGNORE_INDEX and tok.tok.convert_ids_to_tokens(ids[:3]) == ["<|im_start|>", "system", "be"]


def test_prefix_rendering_gives_the_generation_mask(data: Path) -> None:
    marked = C.ChatTokenizer(str(data / "tok"))
    plain = C.ChatTokenizer(str(data / "tok"), (data / "plain.jinja").read_text())
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
        C.ChatTokenizer(str(data / "tok"))
    assert not C.ChatTokenizer(str(data / "tok"), (data / "plain.jinja").read_text()).marked


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
    m, dp = plan.train.microbatches, plan.mesh.dp
    assert b0.token_divisor == b1.token_divisor == pytest.approx(n / (m * dp))
    assert ((b0.labels == IGNORE_INDEX) | (b0.labels == b0.input_ids)).all()
    assert (b0.attention_mask.sum(1) > 0).all()
    mbs = src.microbatches(0, 0)
    assert len(mbs) == m and all(mb.token_divisor == b0.token_divisor for mb in mbs)


def test_the_loss_is_per_token_over_the_global_batch(data: Path) -> None:
    """The reference (as the pipeline: microbatches, dp replicas) equals one process computing
    sum / N over the whole global batch, loss and gradients; a mean of microbatch means does not."""
    from ppdsl.runtime.reference import reference_run
    from ppdsl.runtime.stage_api import default_stage_api

    plan = plan_of(data, CHAT, world=2, microbatches=2)
    api = default_stage_api()
    ref = reference_run(plan, api, 1)
    src = D.make_data(plan)
    batches = [src.batch(0, r) for r in range(plan.mesh.dp)]
    ids = torch.cat([b.input_ids for b in batches])
    labels = torch.cat([b.labels for b in batches])
    mask = torch.cat([b.attention_mask for b in batches])
    model = api.build_reference_model(plan.model, torch.device("cpu"), plan.train.seed, torch.float32)
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


# ---- check ---------------------------------------------------------------------------------------


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
    ]
    results = run_distributed(verify_worker, 2, plans, timeout=150)
    assert [name for name, *_ in results[0]] == [name for name, _ in plans]
    for name, ok, text in results[0]:
        assert ok, f"{name}:\n{text}"


def test_an_assistant_turn_first_is_found(data: Path) -> None:
    marked = C.ChatTokenizer(str(data / "tok"))
    plain = C.ChatTokenizer(str(data / "tok"), (data / "plain.jinja").read_text())
    messages = CONVERSATION[2:]  # the assistant speaks first
    assert plain.encode(messages) == marked.encode(messages)
    assert marked.encode(messages)[1][0] == IGNORE_INDEX  # <|im_start|>: the template's, not the answer
