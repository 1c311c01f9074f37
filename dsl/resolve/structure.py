"""The spec's shape: its language version, which blocks and keys it gives (unknown, twice, a
block written as a value, a required one missing). Each block's entries go to the scope."""

from __future__ import annotations

from .. import ast, schema
from ..diagnostics import Diagnostic, error
from ..span import Span
from .scope import Scope, did_you_mean

LANGUAGE_VERSION = 1


def check_version(scope: Scope) -> None:
    doc = scope.doc
    if doc.version is None:
        scope.err("E0106", _first_span(doc), "the spec does not start with its language version",
                  hint=f"add `ppspec {LANGUAGE_VERSION}` as the first line")
    elif doc.version != LANGUAGE_VERSION:
        scope.err("E0106", doc.version_span, f"unsupported language version {doc.version}",
                  label=f"this ppdsl reads version {LANGUAGE_VERSION}", hint=f"write `ppspec {LANGUAGE_VERSION}`")


def collect_blocks(scope: Scope) -> None:
    """The top-level blocks into `scope.blocks`, their entries into `scope.entries`, every
    `require` into `scope.requires`."""
    for item in scope.doc.items:
        if isinstance(item, ast.Require):
            scope.requires.append(item)
            continue
        if item.kind not in schema.BLOCKS:
            scope.err("E0100", item.kind_span, f"unknown block '{item.kind}'",
                      hint=did_you_mean(item.kind, schema.BLOCKS) or f"blocks are: {', '.join(schema.BLOCKS)}")
            continue
        if item.kind in scope.blocks:
            scope.given_twice(item.kind_span, f"block '{item.kind}' is given twice",
                      label="second one here", hint=f"the first is at line {scope.blocks[item.kind].span.line}")
            continue
        if item.label is not None and item.kind != "model":
            scope.err("E0100", item.kind_span, f"block '{item.kind}' takes no name", label=f"remove '{item.label}'")
        scope.blocks[item.kind] = item
        scope.spans[item.kind] = item.kind_span
        scope.entries[item.kind] = block_entries(scope, item, schema.BLOCKS[item.kind], item.kind)
    for required in ("model", "train"):
        if required not in scope.blocks:
            keys = ", ".join(f"{k.name} = ..." for k in schema.BLOCKS[required].values()
                             if k.required or f"{required}.{k.name}" == "train.seq_len")  # seq_len: for tokens
            scope.err("E0102", scope.doc.version_span or _first_span(scope.doc), f"the spec has no '{required}' block",
                      hint=f"add `{required} {{ {keys} }}` (see docs/language.md)")


def block_entries(scope: Scope, block: ast.Block, keys: dict[str, schema.Key], where: str) -> dict[str, ast.Assign]:
    """key -> entry of a block (`where`: its dotted name); the first of a key given twice."""
    out: dict[str, ast.Assign] = {}
    for entry in block.entries:
        if isinstance(entry, ast.Require):
            scope.requires.append(entry)
            continue
        if isinstance(entry, ast.TpRule):
            if where != "tensor_parallel":
                scope.unknown_key(entry.span, f"a split rule `path : style` belongs in tensor_parallel, not in {where}")
            continue
        name = entry.kind if isinstance(entry, ast.Block) else entry.key
        span = entry.kind_span if isinstance(entry, ast.Block) else entry.key_span
        key = keys.get(name)
        if key is None:
            scope.unknown_key(span, f"unknown key '{name}' in {where}",
                      hint=did_you_mean(name, keys) or f"keys of {where}: {', '.join(keys) or '(none)'}")
            continue
        if (key.kind == "block") != isinstance(entry, ast.Block):
            if key.kind == "block":
                scope.bad_value(span, f"'{name}' is a block: write `{name} {{ ... }}`")
            else:
                scope.bad_value(span, f"'{name}' is a value: write `{name} = ...`")
            continue
        if name in out:
            scope.given_twice(span, f"'{name}' is given twice in {where}", label="second one here",
                      hint=f"the first is at line {out[name].span.line}")
            continue
        out[name] = entry  # type: ignore[assignment]
        scope.spans[f"{where}.{name}"] = entry.span
    for key in keys.values():
        if key.required and key.name not in out:
            scope.diags.append(missing_key(block.kind_span, where, key.name, key.doc))
    return out


def missing_key(span: Span | None, where: str, name: str, doc: str) -> Diagnostic:
    """E0102: a required key is not written (`train.seq_len` is required where the model takes
    tokens, which resolve or, for the own forward, check with the model decides)."""
    return error("E0102", span, f"{where} has no '{name}'", hint=f"add `{name} = ...`: {doc}")


def _first_span(doc: ast.Document) -> Span:
    """Where a diagnostic about the whole file points: the start of its first entry."""
    first = doc.items[0].span if doc.items else Span.point(doc.file)
    return Span(first.file, first.line, first.column, first.line, first.column + 1)
