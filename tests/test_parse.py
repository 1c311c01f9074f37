"""The grammar: every construct of docs/language.md parses to the right AST, and every node keeps
the span of the text it came from."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

from ppdsl.dsl import ast
from ppdsl.dsl.diagnostics import SpecError
from ppdsl.dsl.expr import source_text
from ppdsl.dsl.parse import MAX_NESTING, parse
from ppdsl.dsl.read import MAX_BYTES, decode
from ppdsl.dsl.span import Span

ROOT = Path(__file__).resolve().parent.parent


def entries(text: str, block: int = 0) -> tuple:
    doc = parse(text)
    return doc.items[block].entries  # type: ignore[union-attr]


def value(expr_text: str) -> ast.Expr:
    (entry,) = entries(f"b {{ k = {expr_text} }}")
    assert isinstance(entry, ast.Assign)
    return entry.value


def error_of(text: str) -> tuple[str, Span | None, str]:
    with pytest.raises(SpecError) as exc:
        parse(text, "t.ppspec")
    (d,) = exc.value.diagnostics
    return d.code, d.span, d.message


def walk(node: object):
    """Every AST node below (and including) `node`."""
    yield node
    if attrs.has(type(node)):
        for field in attrs.fields(type(node)):
            v = getattr(node, field.name)
            for item in v if isinstance(v, tuple) else (v,):
                if attrs.has(type(item)) and not isinstance(item, Span):
                    yield from walk(item)


# ---- document structure ----------------------------------------------------------------------------


def test_version_and_blocks() -> None:
    doc = parse("ppspec 1\nmodel gpt2 {\n}\nmesh { tp = 2 }\n")
    assert doc.version == 1
    assert doc.version_span == Span("<spec>", 1, 1, 1, 9)
    kinds = [(b.kind, b.label) for b in doc.items]  # type: ignore[union-attr]
    assert kinds == [("model", "gpt2"), ("mesh", None)]


def test_empty_and_comment_only_documents() -> None:
    for text in ("", "\n\n", "# only a comment", "# a\n\n# b\n"):
        doc = parse(text)
        assert doc.version is None and doc.items == ()


def test_comments_before_the_version_and_everywhere() -> None:
    doc = parse("# header\n\nppspec 1 # version\nmesh { # open\n  tp = 2 # two\n  # alone\n} # close\n# end")
    assert doc.version == 1
    (mesh,) = doc.items
    assert [e.key for e in mesh.entries] == ["tp"]  # type: ignore[union-attr]


@pytest.mark.parametrize("body", ["tp = 2, pp = 2", "tp = 2; pp = 2;;", "tp = 2\n  pp = 2\n", "\n\ntp = 2,\n;pp = 2,;\n",
                                  "tp = 2 ,pp = 2"])
def test_separators(body: str) -> None:
    assert [e.key for e in entries(f"mesh {{ {body} }}")] == ["tp", "pp"]


def test_top_level_separators() -> None:
    doc = parse("ppspec 1; mesh { tp = 2 }, train { seq_len = 1 }")
    assert [b.kind for b in doc.items] == ["mesh", "train"]  # type: ignore[union-attr]


def test_line_continuation() -> None:
    v = value("4 + \\\n  4")
    assert isinstance(v, ast.BinOp) and v.op == "+"


def test_crlf_line_endings() -> None:
    doc = parse("ppspec 1\r\nmesh {\r\n  tp = 2\r\n}\r\n")
    (mesh,) = doc.items
    (tp,) = mesh.entries  # type: ignore[union-attr]
    assert tp.key_span == Span("<spec>", 3, 3, 3, 5)


def test_nested_blocks_and_requires() -> None:
    doc = parse('model m {\n  config { n = 1 }\n  require n > 0 "positive"\n}\nrequire world > 0\n')
    model, req = doc.items
    config, inner = model.entries  # type: ignore[union-attr]
    assert isinstance(config, ast.Block) and config.kind == "config"
    assert isinstance(inner, ast.Require) and inner.message == "positive"
    assert isinstance(req, ast.Require) and req.message is None


def test_call_over_several_lines() -> None:
    v = value("adamw(\n  lr = 3e-4,\n  betas = [0.9,\n           0.95],\n  weight_decay = 0.1\n)")
    assert isinstance(v, ast.Call) and v.func == "adamw"
    assert [k.name for k in v.kwargs] == ["lr", "betas", "weight_decay"]
    assert v.span.line == 1 and v.span.end_line == 6


def test_call_arguments_positional_then_keyword() -> None:
    v = value("column(3, true, gather_output = false)")
    assert isinstance(v, ast.Call)
    assert [type(a).__name__ for a in v.args] == ["Num", "Bool"]
    assert [k.name for k in v.kwargs] == ["gather_output"]
    assert value("synthetic()") == ast.Call("synthetic", (), (), value("synthetic()").span)


def test_trailing_comma_in_a_call_is_a_syntax_error() -> None:
    code, _, _ = error_of("b { k = adamw(lr = 1e-3,) }")
    assert code == "E0002"


# ---- split rules and patterns -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "pattern, text, indices",
    [
        ("transformer.h[*].attn.c_attn", "transformer.h[*].attn.c_attn", [None, ("all", None, None), None, None]),
        ("model.layers[3].mlp", "model.layers[3].mlp", [None, ("one", 3, None), None]),
        ("layers[0:6].attention.wq", "layers[0:6].attention.wq", [("range", 0, 6), None, None]),
        ("layers[:4].w", "layers[:4].w", [("range", None, 4), None]),
        ("layers[4:].w", "layers[4:].w", [("range", 4, None), None]),
        ("layers[:].w", "layers[:].w", [("range", None, None), None]),
        ("layers[ 3 # the start\n  : ].w", "layers[3:].w", [("range", 3, None), None]),
        ("layers[\n:\n3\n].w", "layers[:3].w", [("range", None, 3), None]),
        ("transformer.h.3.attn", "transformer.h.3.attn", [None, None, None, None]),
        ("lm_head", "lm_head", [None]),
    ],
)
def test_patterns(pattern: str, text: str, indices: list) -> None:
    (rule,) = entries(f"tensor_parallel {{ {pattern} : column }}")
    assert isinstance(rule, ast.TpRule)
    assert rule.pattern.text == text
    got = [None if s.index is None else (s.index.kind, s.index.start, s.index.stop) for s in rule.pattern.segments]
    assert got == indices
    if ".3." in pattern:
        assert rule.pattern.segments[2].name == "3"


def test_split_rule_styles_with_options() -> None:
    a, b, c, d = entries("tensor_parallel {\n x : column(fused = 3)\n y : row\n z : vocab(pad_to = 64)\n"
                         " w : column(3, true)\n}")
    assert (a.style, [(k.name, k.value.value) for k in a.kwargs]) == ("column", [("fused", 3)])
    assert (b.style, b.args, b.kwargs) == ("row", (), ())
    assert (c.style, c.kwargs[0].name) == ("vocab", "pad_to")
    assert (d.style, [x.value for x in d.args]) == ("column", [3, True])


# ---- names, numbers, strings ------------------------------------------------------------------------


def test_names_that_start_with_digits() -> None:
    v = value("1f1b")
    assert v == ast.Name(("1f1b",), v.span)
    assert value("zbh1") == ast.Name(("zbh1",), value("zbh1").span)


def test_dotted_names() -> None:
    v = value("mesh.tp")
    assert isinstance(v, ast.Name) and v.parts == ("mesh", "tp") and v.text == "mesh.tp"


@pytest.mark.parametrize(
    "text, expected",
    [("8", 8), ("0", 0), ("0x40", 64), ("0xFF_FF", 65535), ("1.5", 1.5), (".5", 0.5), ("3e-4", 3e-4),
     ("1.5E+3", 1500.0), ("1e3", 1000.0), ("1.000_5", 1.0005), ("123456789012345678901234567890", 123456789012345678901234567890)],
)
def test_numbers(text: str, expected: float) -> None:
    v = value(text)
    assert isinstance(v, ast.Num)
    assert v.value == expected and type(v.value) is type(expected)
    assert v.text == text


@pytest.mark.parametrize(
    "text, expected",
    [(r'"plain"', "plain"), (r"'single'", "single"), (r'"a\"b"', 'a"b'), (r"'it\'s'", "it's"),
     (r'"tab\tnew\nline"', "tab\tnew\nline"), (r'"back\\slash"', "back\\slash"), (r'"other\q"', "otherq"),
     (r'"# not a comment"', "# not a comment"), (r'"é ü 中"', "é ü 中"), ('""', "")],
)
def test_strings_and_escapes(text: str, expected: str) -> None:
    v = value(text)
    assert isinstance(v, ast.Str) and v.value == expected


def test_literals_and_lists() -> None:
    assert isinstance(value("true"), ast.Bool) and value("true").value is True
    assert value("false").value is False
    assert isinstance(value("none"), ast.NoneLit)
    lst = value("[transformer.wte, 'x', 3]")
    assert isinstance(lst, ast.ListExpr) and len(lst.items) == 3
    assert value("[]") == ast.ListExpr((), value("[]").span)
    rng = value("[0:3, 3:n * 2]")
    assert all(isinstance(i, ast.RangeItem) for i in rng.items)
    assert rng.items[1].stop.op == "*"


# ---- expressions ------------------------------------------------------------------------------------


def shape(e: ast.Expr) -> object:
    """A compact form of an expression tree for asserting precedence."""
    if isinstance(e, ast.BinOp):
        return (e.op, shape(e.left), shape(e.right))
    if isinstance(e, ast.UnaryOp):
        return (e.op, shape(e.operand))
    if isinstance(e, ast.Num):
        return e.value
    if isinstance(e, ast.Name):
        return e.text
    if isinstance(e, ast.Bool):
        return e.value
    return type(e).__name__


@pytest.mark.parametrize(
    "text, tree",
    [
        ("1 + 2 * 3", ("+", 1, ("*", 2, 3))),
        ("7 // 2 * 2", ("*", ("//", 7, 2), 2)),
        ("8 / 2 % 3", ("%", ("/", 8, 2), 3)),
        ("1 - 2 - 3", ("-", ("-", 1, 2), 3)),
        ("2 ** 3 ** 2", ("**", 2, ("**", 3, 2))),
        ("-2 ** 2", ("-", ("**", 2, 2))),
        ("2 ** -1", ("**", 2, ("-", 1))),
        ("+x", ("+", "x")),
        ("(1 + 2) * 3", ("*", ("+", 1, 2), 3)),
        ("world / (tp * pp)", ("/", "world", ("*", "tp", "pp"))),
        ("a == 1 or b != 2 and not c < 3", ("or", ("==", "a", 1), ("and", ("!=", "b", 2), ("not", ("<", "c", 3))))),
        ("a <= 1 and b >= 2 and c > 3", ("and", ("and", ("<=", "a", 1), (">=", "b", 2)), (">", "c", 3))),
        ("not not true", ("not", ("not", True))),
    ],
)
def test_precedence(text: str, tree: object) -> None:
    assert shape(value(text)) == tree


def test_chained_comparison_is_a_syntax_error() -> None:
    code, span, _ = error_of("b { k = 1 < x < 3 }")
    assert code == "E0002" and span is not None and span.column == 15


# ---- spans ------------------------------------------------------------------------------------------

SPANNED = """ppspec 1
model gpt2 {
  source = hf("GPT2LMHeadModel")
  config { n_layer = 12, n_embd = 768 }
}
tensor_parallel {
  transformer.h[*].attn.c_attn : column(fused = 3)
}
pipeline {
  style = 1f1b
  split = [0:6, 6:12]
  microbatches = -(2 + 2) * 2 ** 1
}
train {
  optimizer = adamw(
    lr = 3e-4,
    betas = [0.9, 0.95]
  )
}
require n_embd % (n_head * 64) == 0 "head dim"
"""


def test_spans_of_every_node_cover_their_text() -> None:
    doc = parse(SPANNED, "s.ppspec")
    lines = SPANNED.splitlines()
    count = 0
    for node in walk(doc):
        span = getattr(node, "span", None)
        if span is None:
            continue
        count += 1
        assert span.file == "s.ppspec"
        assert 1 <= span.line <= span.end_line <= len(lines) + isinstance(node, ast.Document), node
        assert (span.line, span.column) < (span.end_line, span.end_column), node
        text = source_text(span, SPANNED)
        if isinstance(node, ast.Num):
            assert text == node.text
        elif isinstance(node, ast.Name):
            assert text == node.text
        elif isinstance(node, ast.Str):
            assert text in (f'"{node.value}"', f"'{node.value}'")
        elif isinstance(node, ast.Bool):
            assert text == str(node.value).lower()
        elif isinstance(node, ast.Call):
            assert text.startswith(node.func + "(") and text.endswith(")")
        elif isinstance(node, ast.ListExpr):
            assert text.startswith("[") and text.endswith("]")
        elif isinstance(node, ast.Assign):
            assert text.startswith(node.key) and source_text(node.key_span, SPANNED) == node.key
        elif isinstance(node, ast.Block):
            assert text.startswith(node.kind) and text.endswith("}")
            assert source_text(node.kind_span, SPANNED) == node.kind
        elif isinstance(node, ast.KwArg):
            assert text.startswith(node.name) and "=" in text
        elif isinstance(node, ast.Pattern):
            assert text == node.text
        elif isinstance(node, ast.TpRule):
            assert text.startswith(node.pattern.text) and source_text(node.style_span, SPANNED) == node.style
        elif isinstance(node, ast.Require):
            assert text.startswith("require ")
    assert count > 40


def test_exact_spans() -> None:
    doc = parse(SPANNED, "s.ppspec")
    model, tp, pipeline, train, req = doc.items
    assert model.span == Span("s.ppspec", 2, 1, 5, 2)
    assert model.kind_span == Span("s.ppspec", 2, 1, 2, 6)
    source = model.entries[0]
    assert source.key_span == Span("s.ppspec", 3, 3, 3, 9)
    assert source.value.span == Span("s.ppspec", 3, 12, 3, 33)
    assert source.value.args[0].span == Span("s.ppspec", 3, 15, 3, 32)
    config = model.entries[1]
    assert config.entries[1].span == Span("s.ppspec", 4, 26, 4, 38)  # n_embd = 768
    (rule,) = tp.entries
    assert rule.span == Span("s.ppspec", 7, 3, 7, 51)
    assert rule.pattern.span == Span("s.ppspec", 7, 3, 7, 31)
    assert rule.style_span == Span("s.ppspec", 7, 34, 7, 40)
    assert rule.kwargs[0].span == Span("s.ppspec", 7, 41, 7, 50)
    assert [seg.span.column for seg in rule.pattern.segments] == [3, 15, 20, 25]
    style, split, mb = pipeline.entries
    assert style.value.span == Span("s.ppspec", 10, 11, 10, 15)
    assert [i.span for i in split.value.items] == [Span("s.ppspec", 11, 12, 11, 15), Span("s.ppspec", 11, 17, 11, 21)]
    neg = mb.value.left  # -(2 + 2)
    assert neg.span == Span("s.ppspec", 12, 18, 12, 26)
    assert mb.value.span == Span("s.ppspec", 12, 18, 12, 35)
    assert mb.value.right.span == Span("s.ppspec", 12, 29, 12, 35)  # 2 ** 1
    (opt,) = train.entries
    assert opt.value.span == Span("s.ppspec", 15, 15, 18, 4)
    assert opt.value.kwargs[1].value.span == Span("s.ppspec", 17, 13, 17, 24)
    assert req.span == Span("s.ppspec", 20, 1, 20, 47)
    assert req.expr.span == Span("s.ppspec", 20, 9, 20, 36)


def test_spans_with_tabs_and_a_bom_free_text() -> None:
    (e,) = entries("b {\n\ttp = 2\n}")
    assert e.key_span == Span("<spec>", 2, 2, 2, 4)


# ---- refusals ---------------------------------------------------------------------------------------


def test_syntax_errors_point_at_the_token() -> None:
    assert error_of("mesh {\n  tp = 2 $ 2\n}")[:2] == ("E0002", Span("t.ppspec", 2, 10, 2, 11))
    code, span, msg = error_of("tensor_parallel {\n  x.y column\n}")
    assert (code, span, msg) == ("E0002", Span("t.ppspec", 2, 7, 2, 13), "syntax error: unexpected 'column'")


def test_unclosed_brackets_point_at_the_opening_one() -> None:
    assert error_of("ppspec 1\nmesh {\n  tp = 2\n") == ("E0002", Span("t.ppspec", 2, 6, 2, 7),
                                                          "syntax error: this block is never closed")
    assert error_of("mesh { tp = max(1,\n 2\n")[:2] == ("E0002", Span("t.ppspec", 1, 16, 1, 17))
    assert error_of("mesh { tp = [1, 2\n }")[0] == "E0002"


def test_nesting_limit_is_exact() -> None:
    ok = "b { k = " + "(" * (MAX_NESTING - 1) + "1" + ")" * (MAX_NESTING - 1) + " }"  # the block is one level
    parse(ok)
    code, span, _ = error_of("b { k = " + "(" * MAX_NESTING + "1" + ")" * MAX_NESTING + " }")
    assert code == "E0003" and span.column == 9 + MAX_NESTING - 1
    assert error_of("{" * 10_000)[0] in ("E0002", "E0003")


@pytest.mark.parametrize("text", ["1 + " * 150 + "1", "2 ** " * 150 + "2", "- " * 150 + "1", "not " * 150 + "true",
                                  " or ".join(["true"] * 150)])
def test_long_operator_chains_are_refused_not_recursed(text: str) -> None:
    code, _, msg = error_of(f"b {{ k = {text} }}")
    assert code == "E0003" and "deeper than" in msg
    parse("b { k = " + "1 + " * 50 + "1 }")  # long but reasonable


def test_literal_limits() -> None:
    value("9" * 30)
    assert error_of("b { k = " + "9" * 31 + " }")[0] == "E0004"
    assert error_of("b { k = 1e309 }")[0] == "E0004"
    assert error_of("ppspec 0x_")[0] == "E0004"  # where only an integer fits, `0x_` lexes as one
    value("1e308")


def test_decode() -> None:
    assert decode(b"\xef\xbb\xbfppspec 1\n", "f") == "ppspec 1\n"  # a BOM is dropped
    assert decode("é".encode(), "f") == "é"
    for data, where in ((b"ppspec 1\n\x00", None), (b"ppspec 1\nmesh { \xff }", (2, 8)),
                        (b"x" * (MAX_BYTES + 1), None), ("ppspec 1\n".encode("utf-16"), (1, 1))):
        with pytest.raises(SpecError) as exc:
            decode(data, "f")
        (d,) = exc.value.diagnostics
        assert d.code == "E0001"
        if where is not None:
            assert (d.span.line, d.span.column) == where


def test_shipped_specs_parse() -> None:
    for path in sorted((ROOT / "specs").glob("*.ppspec")):
        doc = parse(path.read_text(encoding="utf-8"), str(path))
        assert doc.version == 1
        assert {"model", "train"} <= {b.kind for b in doc.items if isinstance(b, ast.Block)}
