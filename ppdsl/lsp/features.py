"""What the editor asks for, answered from the text, the check result and (when built) the model.

Columns here are code points (Python string indices); the server converts them to the client's
units (UTF-16 by default) with pygls' position codec.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Sequence

from lsprotocol import types as lsp

from ppdsl.dsl import catalogue, schema
from ppdsl.dsl.diagnostics import Diagnostic, Severity
from . import docs
from .context import Context, context_at, next_char, path_at, path_before, word_at
from .model_view import ModelView

SEVERITY = {Severity.ERROR: lsp.DiagnosticSeverity.Error, Severity.WARNING: lsp.DiagnosticSeverity.Warning,
            Severity.NOTE: lsp.DiagnosticSeverity.Information}
TOP_LEVEL = ("model", "mesh", "tensor_parallel", "pipeline", "train", "require")
NESTED = {("model", "config"): "config", ("train", "checkpoint"): "checkpoint"}
CALLS = {("model", "source"): schema.SOURCES, ("train", "optimizer"): schema.OPTIMIZERS,
         ("train", "lr_schedule"): schema.LR_SCHEDULES, ("train", "data"): schema.DATA_KINDS}
CALL_ARGS = {**schema.OPTIMIZER_ARGS, **schema.LR_SCHEDULE_ARGS, **schema.DATA_ARGS}


def keys_of(block: str | None) -> dict[str, schema.Key]:
    """The schema's keys of a block ("checkpoint": train.checkpoint's)."""
    return schema.CHECKPOINT_KEYS if block == "checkpoint" else schema.BLOCKS.get(block or "", {})


def block_of(ctx: Context) -> str | None:
    """The schema block the cursor is in: "train", "checkpoint", "config", ... (None at top level)."""
    if len(ctx.blocks) > 2 and tuple(ctx.blocks[:2]) == ("model", "config"):
        return "config"  # a nested config block: `config { text_config { ... } }`
    if len(ctx.blocks) >= 2:
        return NESTED.get(tuple(ctx.blocks[-2:]), ctx.blocks[-1])
    return ctx.block


def config_keys_at(config: Mapping[str, object], blocks: Sequence[str]) -> Mapping[str, object]:
    """The built config's keys in the config block the cursor is in: `config` itself, or the
    sub-config a nested block names (`config { text_config { | } }`); none where that is no dict."""
    for name in blocks[2:]:
        config = config.get(name) if isinstance(config, Mapping) else None
    return config if isinstance(config, Mapping) else {}


# ---- diagnostics ------------------------------------------------------------------------------


def code_point_range(d: Diagnostic, lines: Sequence[str]) -> lsp.Range:
    """The span as a 0-based range in code points, kept inside the document."""
    if d.span is None or not lines:
        return lsp.Range(lsp.Position(0, 0), lsp.Position(0, 0))
    s = d.span

    def pos(line: int, column: int) -> lsp.Position:
        line = min(max(line - 1, 0), len(lines) - 1)
        return lsp.Position(line, min(max(column - 1, 0), len(lines[line].rstrip("\r\n"))))

    start, end = pos(s.line, s.column), pos(s.end_line, s.end_column)
    if (end.line, end.character) < (start.line, start.character):
        end = start
    return lsp.Range(start, end)


def to_lsp(d: Diagnostic, lines: Sequence[str]) -> lsp.Diagnostic:
    message = d.message + (f" ({d.label})" if d.label else "") + (f"\nhint: {d.hint}" if d.hint else "")
    return lsp.Diagnostic(range=code_point_range(d, lines), message=message, severity=SEVERITY[d.severity],
                          code=d.code, source="ppdsl", code_description=code_description(d.code))


def code_description(code: str) -> lsp.CodeDescription | None:
    """The code's section of docs/diagnostics.md (the editor links the code to it), where the docs are."""
    if not catalogue.DOCS.is_file():  # an installation without the repository's docs/
        return None
    return lsp.CodeDescription(href=f"{catalogue.DOCS.as_uri()}#{catalogue.rule(code).anchor}")


# ---- hover --------------------------------------------------------------------------------------


def hover_markdown(text: str, line: int, column: int, view: ModelView | None) -> tuple[str, int, int] | None:
    """(markdown, start column, end column) for the name under the cursor, or None."""
    lines = text.split("\n")
    if line >= len(lines):
        return None
    line_text = lines[line]
    span = word_at(line_text, column)
    if span is None:
        return None
    start, end = span
    word = line_text[start:end]
    ctx = context_at(text, line, start)
    after = next_char(line_text, end)
    block = block_of(ctx)
    if ctx.module_path and view is not None:
        found = path_at(line_text, end)
        if found is not None:
            p_start, p_end, path = found
            return _path_hover(path, view), p_start, p_end
    if ctx.at_entry_start:
        if not ctx.blocks and word in docs.BLOCK_DOCS:
            return docs.block_doc(word), start, end
        if block is not None and after in ("=", "{", ""):
            if after == "{" or (block, word) in NESTED:
                found = docs.block_doc(NESTED.get((block, word), word))
                if found:
                    return found, start, end
            found = docs.key_doc(block, word)
            if found:
                return found, start, end
        if word == "require":
            return docs.block_doc("require"), start, end
        if block == "config" and after == "=":
            found = docs.config_key_doc(word)
            if found:
                return found, start, end
    if ctx.call is not None and after == "=" and ctx.at_argument:
        found = docs.option_doc(ctx.call, word)
        if found:
            return found, start, end
    if after == "(" or ctx.tp_style or (ctx.key is not None and ctx.call is None):
        found = docs.call_doc(word)
        if found:
            return found, start, end
    if ctx.key is not None and ctx.call is None and block is not None:  # `style = interleaved`: the key's entry
        key = keys_of(block).get(ctx.key)
        if key is not None and word in key.choices:
            return docs.key_doc(block, ctx.key), start, end
    return None


def _path_hover(path: str, view: ModelView) -> str:
    found = view.resolve(path)
    if not found:
        return f"**`{path}`** matches no module of {view.class_name}"
    first = view.modules[found[0]]
    more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
    shape = ""
    if first.in_features is not None:
        shape = f", {first.in_features} -> {first.out_features}"
    elif first.num_embeddings is not None:
        shape = f", {first.num_embeddings} x {first.embedding_dim}"
    return f"**`{path}`** — `{first.type_name}`{shape}\n\n`{found[0]}`{more} of {view.class_name}"


# ---- completion ---------------------------------------------------------------------------------


def wants_model(text: str, line: int, column: int) -> bool:
    """Whether completion here offers module paths (and so needs the model)."""
    lines = text.split("\n")
    line_text = lines[line] if line < len(lines) else ""
    start, _ = path_before(line_text, column)
    ctx = context_at(text, line, start)
    return ctx.module_path or (block_of(ctx) == "config" and ctx.at_entry_start)


def completions(text: str, line: int, column: int, view: ModelView | None) -> tuple[int, list[lsp.CompletionItem]]:
    """(start column of the text the items replace, items)."""
    lines = text.split("\n")
    line_text = lines[line] if line < len(lines) else ""
    column = min(column, len(line_text))
    span = word_at(line_text, column)
    start = span[0] if span else column
    p_start, typed = path_before(line_text, column)
    ctx = context_at(text, line, p_start)
    if ctx.module_path:
        if view is None:
            return column, []
        parent, _, _ = typed.rpartition(".")
        return p_start + len(parent) + (1 if "." in typed else 0), _path_items(parent, view)
    ctx = context_at(text, line, start)
    block = block_of(ctx)
    start, items = _plain_completions(ctx, block, start, view)
    if start > 0 and line_text[start - 1] in "=:,":  # `style =|` -> `style = 1f1b`, not `style =1f1b`
        for item in items:
            item.insert_text = " " + (item.insert_text or item.label)
    return start, items


def _plain_completions(ctx: Context, block: str | None, start: int,
                       view: ModelView | None) -> tuple[int, list[lsp.CompletionItem]]:
    if ctx.call is not None and ctx.at_argument:
        options = schema.TP_STYLE_ARGS.get(ctx.call, {}) if block == "tensor_parallel" else CALL_ARGS.get(ctx.call, {})
        return start, [_item(o, lsp.CompletionItemKind.Property, f"{k}, default {d}", docs.option_doc(ctx.call, o),
                             insert=f"{o} = ") for o, (k, d) in options.items()]
    if ctx.tp_style:
        return start, [_item(s, lsp.CompletionItemKind.EnumMember, "split style", docs.call_doc(s))
                       for s in schema.TP_STYLES]
    if ctx.key is not None and block is not None and len(ctx.entry) == 2:
        return start, _value_items(block, ctx.key)
    if not ctx.at_entry_start:
        return start, []
    if not ctx.blocks:
        return start, [_item(b, lsp.CompletionItemKind.Module, "block", docs.block_doc(b)) for b in TOP_LEVEL]
    if block == "config":
        if view is None:
            return start, []
        return start, [_item(k, lsp.CompletionItemKind.Property, f"{view.class_name} config: {v!r}"[:80], None,
                             insert=f"{k} {{ }}" if isinstance(v, Mapping) else f"{k} = ")
                       for k, v in config_keys_at(view.config, ctx.blocks).items()]
    keys = keys_of(block)
    items = [_item(k, lsp.CompletionItemKind.Property, f"{key.kind}, default {'required' if key.required else key.default}",
                   docs.key_doc(block, k), insert=f"{k} {{ }}" if key.kind == "block" else f"{k} = ")
             for k, key in keys.items()]
    if block != "config":
        items.append(_item("require", lsp.CompletionItemKind.Keyword, "a rule of your own", docs.block_doc("require")))
    return start, items


def _value_items(block: str, key: str) -> list[lsp.CompletionItem]:
    spec_key = keys_of(block).get(key)
    if spec_key is None:
        return []
    if (block, key) in CALLS:
        return [_item(c, lsp.CompletionItemKind.Function, f"{block}.{key}", docs.call_doc(c)) for c in CALLS[(block, key)]]
    if spec_key.kind == "enum":
        return [_item(c, lsp.CompletionItemKind.EnumMember, f"{block}.{key}", None) for c in spec_key.choices]
    if spec_key.kind == "bool":
        return [_item(v, lsp.CompletionItemKind.Value, f"{block}.{key}", None) for v in ("true", "false")]
    if spec_key.kind == "float_or_none":
        return [_item("none", lsp.CompletionItemKind.Value, "off", None)]
    if spec_key.kind == "split":
        return [_item("auto", lsp.CompletionItemKind.Value, "split = auto", None)]
    return []


def _path_items(parent: str, view: ModelView) -> list[lsp.CompletionItem]:
    parents = [""] if not parent else view.resolve(parent)
    names: dict[str, str] = {}
    for p in parents:
        for child in view.children(p):
            if child not in names:
                info = view.modules[f"{p}.{child}" if p else child]
                names[child] = info.type_name
    return [_item(n, lsp.CompletionItemKind.Module, t, None, sort=f"{i:05d}") for i, (n, t) in enumerate(names.items())]


def _item(label: str, kind: lsp.CompletionItemKind, detail: str, documentation: str | None, *,
          insert: str | None = None, sort: str | None = None) -> lsp.CompletionItem:
    return lsp.CompletionItem(
        label=label, kind=kind, detail=detail, insert_text=insert, sort_text=sort,
        documentation=lsp.MarkupContent(lsp.MarkupKind.Markdown, documentation) if documentation else None)


# ---- go to definition ---------------------------------------------------------------------------


def definition_path(text: str, line: int, column: int) -> tuple[int, int, str] | None:
    """The module path under the cursor, when the cursor is on one (a split rule's pattern,
    pipeline blocks/first/last)."""
    lines = text.split("\n")
    if line >= len(lines):
        return None
    found = path_at(lines[line], column)
    if found is None:
        return None
    ctx = context_at(text, line, found[0])
    return found if ctx.module_path else None


def definition_in_spec(text: str, line: int, column: int) -> tuple[int, int, int] | None:
    """Where a name used in an expression (`tp`, `n_embd`) is set in the spec: (line, start, end)."""
    lines = text.split("\n")
    if line >= len(lines):
        return None
    span = word_at(lines[line], column)
    if span is None:
        return None
    word = lines[line][span[0]:span[1]].rpartition(".")[2]
    assign = re.compile(rf"(?:^|[{{,;])[ \t]*({re.escape(word)})[ \t]*=(?!=)")
    for i, row in enumerate(lines):
        code = row.split("#", 1)[0]
        m = assign.search(code)
        if m and not (i == line and m.start(1) == span[0]):
            return i, m.start(1), m.end(1)
    return None
