"""Text -> AST. The only module that knows about lark (reading the file and decoding it: dsl/read.py)."""

from __future__ import annotations

import functools
import re
import sys
from pathlib import Path
from typing import Any


def _import_lark_without_regex() -> None:
    """lark imports the third-party `regex` package whenever it is installed, although only a
    grammar built with Lark(regex=True) uses it (this one does not): about a tenth of a cold
    `ppdsl check`. Hide it while lark loads; a later `import regex` elsewhere works as usual."""
    if "lark" in sys.modules or "regex" in sys.modules:
        return
    sys.modules["regex"] = None  # type: ignore[assignment]  # `import regex` raises ImportError
    try:
        import lark  # noqa: F401
    finally:
        if sys.modules.get("regex", 0) is None:
            del sys.modules["regex"]


_import_lark_without_regex()

import lark  # noqa: E402
from lark import Token, Transformer, v_args  # noqa: E402

from . import ast
from .diagnostics import Diagnostic, SpecError, error
from .span import Span

GRAMMAR = Path(__file__).with_name("ppspec.lark")
MAX_NESTING = 64  # brackets deeper than this are refused before they can exhaust the stack
MAX_EXPR_DEPTH = 100  # operators nested (or chained: 1 + 1 + ... is a left-deep tree) deeper than this

_TOKEN_NAMES = {
    "NAME": "a name",
    "INT": "an integer",
    "SEGINT": "a layer index",
    "FLOAT": "a number",
    "STRING": "a string",
    "_NL": "a new line",
    "LBRACE": "'{'",
    "RBRACE": "'}'",
    "LPAR": "'('",
    "RPAR": "')'",
    "LSQB": "'['",
    "RSQB": "']'",
    "COMMA": "','",
    "SEMICOLON": "';'",
    "COLON": "':'",
    "EQUAL": "'='",
    "DOT": "'.'",
    "STAR": "'*'",
    "POW": "'**'",
    "COMPARE_OP": "a comparison",
    "ADD_OP": "'+' or '-'",
    "MUL_OP": "an operator",
    "$END": "the end of the file",
    "TRUE": "'true'",
    "FALSE": "'false'",
    "NONE": "'none'",
    "NOT": "'not'",
    "AND": "'and'",
    "OR": "'or'",
    "REQUIRE": "'require'",
    "PPSPEC": "'ppspec'",
}


class _DropNewlinesInBrackets:
    """Post-lexer: newlines inside (...) and [...] are whitespace, as in Python."""

    always_accept = ("_NL",)

    def process(self, stream):
        depth = 0
        for tok in stream:
            if tok.type == "_NL" and depth > 0:
                continue
            if tok.type in ("LPAR", "LSQB", "LBRACE"):
                depth += tok.type != "LBRACE"
                self._nesting += 1
                self.open.append(tok)
                if self._nesting > MAX_NESTING:
                    raise _TooDeep(tok)
            elif tok.type in ("RPAR", "RSQB", "RBRACE"):
                depth = max(0, depth - (tok.type != "RBRACE"))
                self._nesting = max(0, self._nesting - 1)
                if self.open:
                    self.open.pop()
            yield tok

    def __init__(self) -> None:
        self._nesting = 0
        self.open: list[Token] = []  # brackets not closed yet: an error at the end of file names the last


class _TooDeep(Exception):
    def __init__(self, tok: Token):
        self.tok = tok


@functools.lru_cache(maxsize=1)
def _parser() -> lark.Lark:
    return lark.Lark(
        GRAMMAR.read_text(encoding="utf-8"),
        parser="lalr",
        propagate_positions=True,
        maybe_placeholders=True,
        postlex=_DropNewlinesInBrackets(),
        cache=True,  # lark keeps the built LALR tables in the temp dir: check starts faster
    )


def parse(text: str, file: str = "<spec>") -> ast.Document:
    """Parse spec text. Raises SpecError with syntax diagnostics."""
    parser = _parser()
    parser.options.postlex.__init__()  # reset nesting depth
    if not text.endswith("\n"):
        text += "\n"
    try:
        tree = parser.parse(text)
    except _TooDeep as exc:
        raise SpecError([error("E0003", _tok_span(exc.tok, file), f"brackets nested deeper than {MAX_NESTING} levels",
                               label="too deep here")]) from None
    except lark.UnexpectedInput as exc:
        raise SpecError([_syntax_error(exc, text, file, parser.options.postlex.open)]) from None
    deep = _too_deep(tree)
    if deep is not None:
        raise SpecError([error("E0003", _span(deep.meta, file), f"expression nested deeper than {MAX_EXPR_DEPTH} levels",
                               label="too deep here",
                               hint="a chain such as 1 + 1 + ... counts one level per operator; simplify the expression")])
    try:
        return _ToAst(file, text).transform(tree)
    except lark.exceptions.VisitError as exc:
        if isinstance(exc.orig_exc, _BadLiteral):
            raise SpecError([exc.orig_exc.diagnostic]) from None
        raise


_COLON_NEXT = re.compile(r"(?:[ \t\f\r\n]|\\\r?\n|#[^\n]*)*:")  # blanks, continuations, comments, then ':'
_CHAINS = {"sum": 2, "product": 2, "or_expr": 1, "and_expr": 1}  # children per level of the AST they become


def _too_deep(tree: lark.Tree) -> lark.Tree | None:
    """The first expression node deeper than MAX_EXPR_DEPTH, counted without recursion (so that
    the recursive transformation below, and everything after it, stays far from Python's limit)."""
    stack = [(tree, 0)]
    while stack:
        node, depth = stack.pop()
        depth += max(1, (len(node.children) - 1) // _CHAINS[node.data]) if node.data in _CHAINS else 1
        if depth > MAX_EXPR_DEPTH:
            return node
        stack.extend((c, depth) for c in node.children if isinstance(c, lark.Tree))
    return None


class _BadLiteral(Exception):
    def __init__(self, diagnostic: Diagnostic):
        self.diagnostic = diagnostic


def _tok_span(tok: Token, file: str) -> Span:
    line = tok.line or 1
    col = tok.column or 1
    end_line = tok.end_line or line
    end_col = tok.end_column or col + max(1, len(str(tok)))
    return Span(file, line, col, end_line, end_col)


def _describe(terminal: str) -> str:
    if terminal in _TOKEN_NAMES:
        return _TOKEN_NAMES[terminal]
    return terminal.lower()


def _syntax_error(exc: lark.UnexpectedInput, text: str, file: str, unclosed: list[Token] = ()) -> Diagnostic:
    line = getattr(exc, "line", None) or 1
    col = getattr(exc, "column", None) or 1
    if line < 0 or col < 0:  # end of input
        lines = text.splitlines() or [""]
        line, col = len(lines), len(lines[-1]) + 1
    span = Span(file, line, col, line, col + 1)
    expected: set[str] = set()
    if isinstance(exc, lark.UnexpectedToken):
        expected = {t for t in exc.expected if not t.startswith("__")}
        tok = exc.token
        if tok.type == "$END":
            found = "end of file"
        elif tok.type == "_NL":
            found = "end of line"
        else:
            found = f"'{tok}'"
            span = _tok_span(tok, file)
    elif isinstance(exc, lark.UnexpectedCharacters):
        ch = text[exc.pos_in_stream] if 0 <= exc.pos_in_stream < len(text) else "?"
        found = f"character {ch!r}"
        expected = set(exc.allowed or ())
    else:
        found = "end of file"
    names = sorted({_describe(t) for t in expected})
    hint = ""
    if names:
        shown = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
        hint = f"expected {shown}"
    if found == "end of file" and unclosed:
        tok = unclosed[-1]
        close = {"{": "}", "(": ")", "[": "]"}.get(str(tok), "")
        what = "block" if str(tok) == "{" else "bracket"
        return error("E0002", _tok_span(tok, file), f"syntax error: this {what} is never closed",
                     label=f"'{tok}' opened here", hint=f"add '{close}' to close it")
    if "RBRACE" in expected and found == "end of file":
        hint = "a block is not closed: add '}'"
    return error("E0002", span, f"syntax error: unexpected {found}", label="here", hint=hint)


def _span(meta: Any, file: str) -> Span:
    if getattr(meta, "empty", True):
        return Span.point(file)
    return Span(file, meta.line, meta.column, meta.end_line, meta.end_column)


@v_args(meta=True)
class _ToAst(Transformer):
    def __init__(self, file: str, text: str = ""):
        super().__init__(visit_tokens=False)
        self.file = file
        self.text = text

    def _s(self, meta: Any) -> Span:
        return _span(meta, self.file)

    def _t(self, tok: Token) -> Span:
        return _tok_span(tok, self.file)

    # -- document and statements
    def start(self, meta, children):
        version = None
        version_span = None
        items = []
        for c in children:
            if isinstance(c, tuple) and c and c[0] == "version":
                version, version_span = c[1], c[2]
            else:
                items.append(c)
        return ast.Document(self.file, version, version_span, tuple(items), self._s(meta))

    def version(self, meta, children):
        return ("version", self._int(children[0]), self._s(meta))

    def block(self, meta, children):
        kind_tok = children[0]
        label = None
        rest = children[1:]
        if rest and isinstance(rest[0], Token):
            label = str(rest[0])
            rest = rest[1:]
        return ast.Block(str(kind_tok), self._t(kind_tok), label, tuple(c for c in rest if c is not None), self._s(meta))

    def assign(self, meta, children):
        key, value = children
        return ast.Assign(str(key), self._t(key), value, self._s(meta))

    def tp_rule(self, meta, children):
        pattern, (style, style_span, args, kwargs) = children
        return ast.TpRule(pattern, style, style_span, args, kwargs, self._s(meta))

    def style(self, meta, children):
        name = children[0]
        args = tuple(c for c in children[1:] if c is not None and not isinstance(c, ast.KwArg))
        kwargs = tuple(c for c in children[1:] if isinstance(c, ast.KwArg))
        return (str(name), self._t(name), args, kwargs)

    def require(self, meta, children):
        expr = children[0]
        msg = None
        if len(children) > 1 and children[1] is not None:
            msg = self._string(children[1])
        return ast.Require(expr, msg, self._s(meta))

    # -- patterns
    def pattern(self, meta, children):
        return ast.Pattern(tuple(children), self._s(meta))

    def seg(self, meta, children):
        name = children[0]
        index = children[1] if len(children) > 1 else None
        return ast.Segment(str(name), index, self._s(meta))

    def index_all(self, meta, children):
        return ast.Index("all")

    def index_one(self, meta, children):
        return ast.Index("one", self._int(children[0]))

    def index_range(self, meta, children):
        # `INT? ":" INT?`: the ':' is not kept, so a lone bound is the start when a ':' follows it
        ints = [c for c in children if c is not None]
        if len(ints) == 2:
            a, b = ints
        elif len(ints) == 1:
            tok = ints[0]
            starts = _COLON_NEXT.match(self.text, tok.end_pos) is not None
            a, b = (tok, None) if starts else (None, tok)
        else:
            a = b = None
        return ast.Index("range", None if a is None else self._int(a), None if b is None else self._int(b))

    # -- expressions
    def _binary_chain(self, meta, children):
        left = children[0]
        for i in range(1, len(children), 2):
            op, right = children[i], children[i + 1]
            left = ast.BinOp(str(op), left, right, _join(left.span, right.span))
        return left

    sum = _binary_chain
    product = _binary_chain

    def power(self, meta, children):
        base, _op, exp = children
        return ast.BinOp("**", base, exp, self._s(meta))

    def compare(self, meta, children):
        left, op, right = children
        return ast.BinOp(str(op), left, right, self._s(meta))

    def or_expr(self, meta, children):
        return _fold("or", children)

    def and_expr(self, meta, children):
        return _fold("and", children)

    def not_(self, meta, children):
        return ast.UnaryOp("not", children[0], self._s(meta))

    def neg(self, meta, children):
        op, operand = children
        return ast.UnaryOp(str(op), operand, self._s(meta))

    def int_lit(self, meta, children):
        return ast.Num(self._int(children[0]), str(children[0]), self._s(meta))

    def float_lit(self, meta, children):
        tok = children[0]
        try:
            value = float(str(tok).replace("_", ""))
        except (ValueError, OverflowError):
            raise _BadLiteral(error("E0004", self._t(tok), f"number {str(tok)[:40]} is out of range")) from None
        if value in (float("inf"), float("-inf")):
            raise _BadLiteral(error("E0004", self._t(tok), f"number {str(tok)[:40]} is out of range",
                                    hint="numbers must be finite"))
        return ast.Num(value, str(tok), self._s(meta))

    def str_lit(self, meta, children):
        return ast.Str(self._string(children[0]), self._s(meta))

    def true_lit(self, meta, children):
        return ast.Bool(True, self._s(meta))

    def false_lit(self, meta, children):
        return ast.Bool(False, self._s(meta))

    def none_lit(self, meta, children):
        return ast.NoneLit(self._s(meta))

    def dotted(self, meta, children):
        return ast.Name(tuple(str(c) for c in children), self._s(meta))

    def word(self, meta, children):
        return ast.Name((str(children[0]),), self._s(meta))

    def call(self, meta, children):
        name = children[0]
        items = [c for c in children[1:] if c is not None]
        args = tuple(c for c in items if not isinstance(c, ast.KwArg))
        kwargs = tuple(c for c in items if isinstance(c, ast.KwArg))
        return ast.Call(str(name), args, kwargs, self._s(meta))

    def kwarg(self, meta, children):
        name, value = children
        return ast.KwArg(str(name), value, self._s(meta))

    def list(self, meta, children):
        return ast.ListExpr(tuple(c for c in children if c is not None), self._s(meta))

    def range_item(self, meta, children):
        a, b = children
        return ast.RangeItem(a, b, self._s(meta))

    # -- literals
    def _int(self, tok: Token) -> int:
        text = str(tok).replace("_", "")
        if len(text) > 30:
            raise _BadLiteral(error("E0004", self._t(tok), f"integer {text[:20]}... has {len(text)} digits",
                                    hint="integers in a spec have at most 30 digits"))
        try:
            return int(text, 16) if text.lower().startswith("0x") else int(text)
        except ValueError:  # `0x_`: the digits are only underscores
            raise _BadLiteral(error("E0004", self._t(tok), f"'{str(tok)[:20]}' is not a number")) from None

    def _string(self, tok: Token) -> str:
        raw = str(tok)[1:-1]
        out = []
        i = 0
        escapes = {"n": "\n", "t": "\t", "\\": "\\", '"': '"', "'": "'"}
        while i < len(raw):
            ch = raw[i]
            if ch == "\\" and i + 1 < len(raw):
                out.append(escapes.get(raw[i + 1], raw[i + 1]))
                i += 2
            else:
                out.append(ch)
                i += 1
        return "".join(out)


def _join(a: Span, b: Span) -> Span:
    return Span(a.file, a.line, a.column, b.end_line, b.end_column)


def _fold(op: str, children: list) -> ast.Expr:
    left = children[0]
    for right in children[1:]:
        left = ast.BinOp(op, left, right, _join(left.span, right.span))
    return left
