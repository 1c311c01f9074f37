"""`ppdsl lsp`, the editor server: through its protocol (a subprocess speaking JSON-RPC with
Content-Length framing on stdio, as an editor does), and its pure parts directly.

Needs the optional extra `lsp` (pygls; `make test` installs it). The model test builds the tiny
decoder of specs/tiny_cpu.ppspec on the meta device (torch, no transformers).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from lsp_client import ROOT, LspClient
from ppdsl.dsl import schema
from ppdsl.lsp import docs
from ppdsl.lsp.context import context_at, path_at
from ppdsl.lsp.model_view import parse_pattern, render_printout

needs_pygls = pytest.mark.skipif(importlib.util.find_spec("pygls") is None,
                                 reason="pygls is not installed: pip install -e '.[lsp]' (make test does)")
needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="the model test needs torch")

# an unknown key after a string holding a character outside the BMP: its column differs in
# UTF-16 (the emoji is 2 units) and in code points (1)
BROKEN = """ppspec 1
model { source = hf("GPT2LMHeadModel"), config { n_layer = 4 } }
mesh { tp = 2, pp = 2 }
tensor_parallel { transformer.h[*].mlp.c_fc : column, transformer.h[*].mlp.c_proj : row }
pipeline { microbatches = 4 }
train {
  global_batch = 8 * dp, seq_len = 64
  checkpoint { dir = "ckpt\U0001F600", evry = 5 }
}
"""
BROKEN_LINE = next(i for i, line in enumerate(BROKEN.splitlines()) if "evry" in line)
EVRY_CODEPOINTS = BROKEN.splitlines()[BROKEN_LINE].index("evry")  # 0-based, in code points
FIXED = BROKEN.replace("evry", "every")


@pytest.fixture(scope="module")
def server():
    pytest.importorskip("pygls", reason="pygls is not installed: pip install -e '.[lsp]' (make test does)")
    client = LspClient()
    client.initialize()
    yield client
    assert client.close() == 0


def _uri(name: str) -> str:
    return (ROOT / "specs" / name).as_uri()


def _at(line: int, character: int, uri: str) -> dict:
    return {"textDocument": {"uri": uri}, "position": {"line": line, "character": character}}


@needs_pygls
def test_did_open_of_a_broken_spec_publishes_the_diagnostic_at_its_range(server):
    published = server.open(_uri("broken_lsp.ppspec"), BROKEN)
    assert published["uri"] == _uri("broken_lsp.ppspec")
    [diag] = published["diagnostics"]
    assert diag["code"] == "E0101" and diag["severity"] == 1 and diag["source"] == "ppdsl"
    assert "unknown key 'evry'" in diag["message"] and "hint:" in diag["message"]
    assert diag["codeDescription"]["href"] == (ROOT / "docs" / "diagnostics.md").as_uri() + "#e0101"  # from dsl/catalogue.py
    start = EVRY_CODEPOINTS + 1  # UTF-16 (the default): the emoji before it is two code units
    assert diag["range"] == {"start": {"line": BROKEN_LINE, "character": start},
                             "end": {"line": BROKEN_LINE, "character": start + 4}}


@needs_pygls
def test_an_edit_that_fixes_the_spec_clears_its_diagnostics(server):
    uri = _uri("fixed_lsp.ppspec")
    assert server.open(uri, BROKEN)["diagnostics"]
    published = server.change(uri, FIXED, version=2)
    assert published["diagnostics"] == [] and published["version"] == 2
    published = server.change(uri, FIXED.replace("tp = 2", "tp = 0"), version=3)
    assert {d["code"] for d in published["diagnostics"]} == {"E0202"}


@needs_pygls
def test_hover_on_a_key_shows_its_language_md_entry(server):
    uri = _uri("hover_lsp.ppspec")
    server.open(uri, FIXED)
    row = FIXED.splitlines().index("pipeline { microbatches = 4 }")
    hover = server.request("textDocument/hover", _at(row, 13, uri))  # on `microbatches`
    assert hover["contents"]["kind"] == "markdown"
    assert "pipeline.microbatches" in hover["contents"]["value"]
    assert "per data-parallel replica" in hover["contents"]["value"]  # the words of docs/language.md
    assert hover["range"] == {"start": {"line": row, "character": 11}, "end": {"line": row, "character": 23}}


@needs_pygls
def test_completion_offers_the_keys_of_the_block_and_the_options_of_a_call(server):
    uri = _uri("complete_lsp.ppspec")
    text = FIXED.replace("mesh { tp = 2, pp = 2 }", "mesh { tp = 2, pp = 2 }\npipeline {\n  \n}").replace(
        "pipeline { microbatches = 4 }", "").replace("seq_len = 64", "seq_len = 64, optimizer = adamw(")
    server.open(uri, text)
    lines = text.splitlines()
    keys = server.request("textDocument/completion", _at(lines.index("pipeline {") + 1, 2, uri))
    assert {i["label"] for i in keys["items"]} >= set(schema.BLOCKS["pipeline"])
    row = next(i for i, line in enumerate(lines) if "adamw(" in line)
    options = server.request("textDocument/completion", _at(row, len(lines[row]), uri))
    assert [i["label"] for i in options["items"]] == list(schema.OPTIMIZER_ARGS["adamw"])


@needs_pygls
def test_definition_of_a_name_in_an_expression_is_where_the_spec_sets_it(server):
    uri = _uri("define_lsp.ppspec")
    text = FIXED.replace("mesh { tp = 2, pp = 2 }", "mesh {\n  tp = 2\n  pp = 2\n  dp = world / (tp * pp)\n}")
    server.open(uri, text)
    row = text.splitlines().index("  dp = world / (tp * pp)")
    [loc] = server.request("textDocument/definition", _at(row, 17, uri))  # on `tp`
    assert loc == {"uri": uri, "range": {"start": {"line": row - 2, "character": 2},
                                         "end": {"line": row - 2, "character": 4}}}


@needs_pygls
@needs_torch
def test_module_paths_complete_and_jump_into_the_model_printout():
    client = LspClient()
    try:
        client.initialize(encodings=["utf-32"])
        spec = ROOT / "specs" / "tiny_cpu.ppspec"
        uri = spec.as_uri()
        text = spec.read_text(encoding="utf-8")
        assert client.open(uri, text)["diagnostics"] == []
        lines = text.splitlines()
        row = next(i for i, line in enumerate(lines) if "layers[*].attention.wq" in line)
        col = lines[row].index("attention") + 3
        locs = client.request("textDocument/definition", _at(row, col, uri), timeout=300)
        assert len(locs) == 4  # layers[*].attention in each of the 4 blocks
        printout = Path(locs[0]["uri"].removeprefix("file://"))
        shown = printout.read_text(encoding="utf-8").splitlines()
        assert [shown[loc["range"]["start"]["line"]].split("# ")[-1] for loc in locs] == \
            [f"layers.{i}.attention" for i in range(4)]
        row_blocks = lines.index("  blocks = layers")
        [loc] = client.request("textDocument/definition", _at(row_blocks, 12, uri))
        assert shown[loc["range"]["start"]["line"]].split("# ")[-1] == "layers"
        dot = lines[row].index(".wq") + 1
        items = client.request("textDocument/completion", _at(row, dot, uri))["items"]
        assert {"wq", "wk", "wv", "wo"} <= {i["label"] for i in items}
        assert items[0]["textEdit"]["range"]["start"] == {"line": row, "character": dot}
    finally:
        assert client.close() == 0


def _codes(published: dict) -> set[str]:
    return {d["code"] for d in published["diagnostics"]}


SMALL_GPT2 = """ppspec 1
model gpt2 {
  source = hf("GPT2LMHeadModel")
  config { n_layer = 2, n_embd = 64, n_head = 4, vocab_size = 128, n_positions = 32 }
}
mesh { tp = 2, pp = 1 }
tensor_parallel {
  transformer.h[*].mlp.c_fc : column
  transformer.h[*].mlp.c_proj : row
}
pipeline { microbatches = 1 }
train { global_batch = 2, seq_len = 16 }
"""


@needs_pygls
@needs_torch
def test_model_checks_reach_the_editor_and_follow_each_edit_once_the_facts_are_known(tmp_path, monkeypatch):
    """With the facts in check's cache (`ppdsl check` ran) the first diagnostics of an open
    document have the model checks, and torch is never loaded. Without them, they come at once
    without the model checks, then again with them when the model is built aside; every later
    edit has them at once."""
    from ppdsl.dsl.check import check_file

    spec = tmp_path / "small.ppspec"
    spec.write_text(SMALL_GPT2, encoding="utf-8")
    uri = spec.as_uri()
    wrong = SMALL_GPT2.replace("c_fc :", "c_fcx :")  # matches no module: E0402, which only the model checks see
    monkeypatch.setenv("PPDSL_CACHE_DIR", str(tmp_path / "cache"))  # the server processes inherit it
    assert check_file(spec).ok  # as `ppdsl check` would: the facts are stored
    client = LspClient()
    try:
        client.initialize()
        assert "E0402" in _codes(client.open(uri, wrong))
        maps = Path(f"/proc/{client.proc.pid}/maps")
        if maps.exists():
            assert "libtorch" not in maps.read_text()
        assert client.change(uri, SMALL_GPT2, version=2)["diagnostics"] == []
    finally:
        assert client.close() == 0
    monkeypatch.setenv("PPDSL_CACHE_DIR", str(tmp_path / "empty"))
    client = LspClient()
    try:
        client.initialize()
        published = client.open(uri, wrong)
        while "E0402" not in _codes(published):  # published again once the model is built
            published = client.diagnostics_of(uri, 1, timeout=300)
        assert client.change(uri, SMALL_GPT2, version=2)["diagnostics"] == []
        assert "E0402" in _codes(client.change(uri, wrong, version=3))
    finally:
        assert client.close() == 0
    client = LspClient()
    try:
        client.initialize({"model": False})  # model features off: the checks of `check --no-model`
        assert client.open(uri, wrong)["diagnostics"] == []
    finally:
        assert client.close() == 0


# ---- the pure parts -------------------------------------------------------------------------


def test_context_knows_blocks_keys_calls_and_split_rules():
    text = FIXED + "tensor_parallel {\n  layers[0:2].mlp : column(\n"
    lines = text.splitlines()
    ctx = context_at(text, BROKEN_LINE, lines[BROKEN_LINE].index("every"))
    assert ctx.blocks == ("train", "checkpoint") and ctx.at_entry_start
    row = next(i for i, line in enumerate(lines) if "seq_len" in line)
    ctx = context_at(text, row, lines[row].index("64"))
    assert ctx.key == "seq_len" and ctx.block == "train"
    last = len(lines) - 1
    assert context_at(text, last, 2).module_path
    assert not context_at(text, last, lines[last].index(":")).tp_style
    assert context_at(text, last, lines[last].index("column")).tp_style  # `[0:2]`'s colon is not the rule's
    ctx = context_at(text, last, len(lines[last]))
    assert ctx.call == "column" and ctx.at_argument


def test_path_under_the_cursor_is_cut_after_its_segment():
    line = "  transformer.h[*].attn.c_attn : column"
    assert path_at(line, line.index("attn") + 1)[2] == "transformer.h[*].attn"
    assert path_at(line, line.index("c_attn"))[2] == "transformer.h[*].attn.c_attn"
    assert [s.name for s in parse_pattern("transformer.h.3.attn")] == ["transformer", "h", "attn"]
    assert parse_pattern("transformer.h.3.attn")[1].index.start == 3
    assert parse_pattern("a..b") == ()


def test_every_schema_key_has_its_language_md_entry_for_hover():
    """The schema says which keys exist, language.md what they mean: each key's hover is its row."""
    missing = []
    for block, keys in [*schema.BLOCKS.items(), ("checkpoint", schema.CHECKPOINT_KEYS)]:
        for name, key in keys.items():
            text = docs.key_doc(block, name)
            if text is None or (key.doc and text.endswith(key.doc) and "default `" not in text.split("\n")[0]):
                missing.append(f"{block}.{name}")
    assert not missing, f"keys without a row in docs/language.md: {missing}"
    for call, options in [*schema.OPTIMIZER_ARGS.items(), *schema.LR_SCHEDULE_ARGS.items(), *schema.DATA_ARGS.items()]:
        for option in options:
            assert "default" in (docs.option_doc(call, option) or ""), (call, option)
    for name in (*schema.SOURCES, *schema.DATA_KINDS, *schema.TP_STYLES, *schema.OPTIMIZERS):
        assert docs.call_doc(name), name


def test_printout_lists_every_module_on_its_own_line():
    class M:
        def __init__(self, type_name, children=(), params=0):
            self.type_name, self.children, self.num_params = type_name, children, params
            self.in_features = self.out_features = self.num_embeddings = self.embedding_dim = None
            self.has_bias = False

    modules = {"": M("Net", ("layers",)), "layers": M("ModuleList", ("0", "1")),
               "layers.0": M("Block", (), 10), "layers.1": M("Block", (), 10)}
    text, line_of = render_printout("Net", modules, 'python("m:f")', 20)
    shown = text.splitlines()
    assert shown[line_of["layers.1"]].strip().startswith("(1): Block")
    assert shown[line_of["layers"]].endswith("# layers")
    assert shown[line_of["layers"]].split("#")[0].strip() == "(layers): ModuleList(2 blocks)"


def test_textmate_grammar_and_vscode_extension_are_consistent():
    """The grammar is valid JSON whose regexes compile (Python's `re` reads this subset of
    Oniguruma alike), its split-rule and assignment rules match as meant, and the VS Code
    extension names it and the `ppspec` language."""
    import json
    import re

    editors = ROOT / "editors"
    grammar = json.loads((editors / "ppspec.tmLanguage.json").read_text(encoding="utf-8"))
    assert grammar["scopeName"] == "source.ppspec"

    def regexes(node):
        if isinstance(node, dict):
            for k, v in node.items():
                if k in ("match", "begin", "end"):
                    yield v
                else:
                    yield from regexes(v)
        elif isinstance(node, list):
            for v in node:
                yield from regexes(v)

    compiled = [re.compile(r) for r in regexes(grammar)]
    assert len(compiled) > 15
    rules = grammar["repository"]
    m = re.match(rules["split-rule"]["match"], "  transformer.h[*].attn.c_attn  : column(fused = 3)")
    assert m.group(1, 3) == ("transformer.h[*].attn.c_attn", "column")
    assert re.match(rules["split-rule"]["match"], "  layers[0:4].attention.wq : row").group(1) == "layers[0:4].attention.wq"
    assert re.search(rules["assignment"]["match"], "  microbatches = 8").group(1) == "microbatches"
    assert not re.search(rules["assignment"]["match"], "require a == b")

    vscode = editors / "vscode"
    package = json.loads((vscode / "package.json").read_text(encoding="utf-8"))
    [language] = package["contributes"]["languages"]
    assert language["id"] == "ppspec" and language["extensions"] == [".ppspec"]
    [entry] = package["contributes"]["grammars"]
    assert entry["scopeName"] == grammar["scopeName"]
    assert (vscode / entry["path"]).resolve() == (editors / "ppspec.tmLanguage.json").resolve()
    assert '"lsp"' in (vscode / "extension.js").read_text(encoding="utf-8")


@needs_pygls
def test_the_text_features_answer_anywhere_in_any_text():
    """Hover, completion and definition read half-written text: no position of a shipped spec
    (whole, or cut anywhere) raises, and a long line costs no more than its length."""
    from ppdsl.lsp import features
    from ppdsl.lsp.context import path_before

    for spec in sorted((ROOT / "specs").glob("*.ppspec")):
        whole = spec.read_text(encoding="utf-8")
        for text in (whole, whole[: len(whole) // 3]):
            lines = text.split("\n")
            for line, row in enumerate(lines):
                for column in range(line % 5, len(row) + 2, 9):
                    features.hover_markdown(text, line, column, None)
                    features.completions(text, line, column, None)
                    features.definition_path(text, line, column)
                    features.definition_in_spec(text, line, column)
    long_line = "a" * 20_000 + "!"
    assert path_before(long_line, len(long_line)) == (len(long_line), "")
    assert path_before(long_line, len(long_line) - 1) == (0, long_line[:-1])
