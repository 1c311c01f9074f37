"""The pipeline block: the schedule keys, the module paths a stage holds (from the model's
family unless written), an explicit split into block ranges, the cost profile."""

from __future__ import annotations

from .. import ast
from ..expr import ExprError, to_expr
from ..families import family_of
from ..spec import PipelineSpec
from .coerce import enum_value
from .model import written_source
from .scope import Scope, Unresolved


def resolve_pipeline(scope: Scope) -> PipelineSpec:
    entries = scope.entries.get("pipeline", {})
    style = enum_value(scope, "pipeline", "style", entries)
    balance = enum_value(scope, "pipeline", "balance", entries)
    chunks = scope.int_value("pipeline.chunks")
    # microbatches and microbatch_size both given: check requires batch == microbatch_size * microbatches * dp
    microbatches = scope.int_value("pipeline.microbatches")
    microbatch_size = scope.int_value("pipeline.microbatch_size")
    fam = scope.family  # for hf_pretrained: from the directory's config.json too
    if fam is None:
        src = written_source(scope)
        if src is not None:
            fam = family_of(src.kind, src.target, scope.config)
    blocks = _path(scope, entries["blocks"]) if "blocks" in entries else (fam.blocks if fam else "layers")
    first = _paths(scope, entries["first"]) if "first" in entries else (fam.first if fam else ())
    last = _paths(scope, entries["last"]) if "last" in entries else (fam.last if fam else ())
    split = _split(scope, entries["split"]) if "split" in entries else None
    _one_stage_each(scope, blocks, first, last)
    return PipelineSpec(style, chunks, microbatches, microbatch_size, blocks, first, last, split, balance,
                        _profile(scope, entries, balance))


def _one_stage_each(scope: Scope, blocks: str, first: tuple[str, ...], last: tuple[str, ...]) -> None:
    """E0109: each module is held by one stage: first and last name different modules, outside the blocks."""
    seen: dict[str, str] = {}  # path -> "first" / "last"
    for key, paths in (("first", first), ("last", last)):
        for path in paths:
            other = next(((p, k) for p, k in seen.items()
                          if p == path or p.startswith(path + ".") or path.startswith(p + ".")), None)
            if other is not None:
                scope.err("E0109", scope.spans.get(f"pipeline.{key}") or scope.spans.get("pipeline"),
                          f"pipeline.{key} names '{path}', and pipeline.{other[1]} names '{other[0]}': one module "
                          "would be held by two stages, each training its own copy",
                          hint="list each module once, in first (before the blocks) or last (after them)")
            seen.setdefault(path, key)
            if path == blocks or path.startswith(blocks + ".") or blocks.startswith(path + "."):
                what = "is" if path == blocks else "lies inside" if path.startswith(blocks + ".") else "contains"
                scope.err("E0109", scope.spans.get(f"pipeline.{key}") or scope.spans.get("pipeline"),
                          f"pipeline.{key} names '{path}', which {what} the block list '{blocks}'",
                          hint=f"the blocks are cut into stages by split; {key} lists the modules "
                               f"{'before them (embeddings)' if key == 'first' else 'after them (final norm, head)'}")


def _profile(scope: Scope, entries: dict[str, ast.Assign], balance: str) -> str | None:
    """`profile = "file"`: absolute, as the locate pass found it (E0419 outside the spec's
    directory); `balance = measured` needs one (E0313). dsl/profile_check.py reads it."""
    if "profile" not in entries:
        if balance == "measured" and "balance" in entries:
            scope.err("E0313", entries["balance"].value.span, "balance = measured needs a cost profile",
                      hint='give pipeline.profile = "runs/<name>/profile.json" (ppdsl tune writes one)')
        return None
    v = entries["profile"].value
    if not isinstance(v, ast.Str) or not v.value:
        scope.bad_value(v.span, "profile must be a file path, e.g. \"runs/tiny/profile.json\"")
        raise Unresolved()
    scope.spans["pipeline.profile"] = v.span
    found = scope.located.paths[v.span]
    if found.problem is not None:
        scope.diags.append(found.problem)
        raise Unresolved()
    return found.path


def _path(scope: Scope, assign: ast.Assign) -> str:
    v = assign.value
    if isinstance(v, ast.Name):
        return v.text
    if isinstance(v, ast.Str):
        return v.value
    scope.bad_value(v.span, f"{assign.key} must be a module path such as transformer.h")
    raise Unresolved()


def _paths(scope: Scope, assign: ast.Assign) -> tuple[str, ...]:
    v = assign.value
    items = v.items if isinstance(v, ast.ListExpr) else (v,)
    out = []
    for item in items:
        if isinstance(item, ast.Name):
            out.append(item.text)
        elif isinstance(item, ast.Str):
            out.append(item.value)
        else:
            scope.bad_value(item.span, f"{assign.key} lists module paths: [transformer.wte, transformer.wpe]")
            raise Unresolved()
    return tuple(out)


def _split(scope: Scope, assign: ast.Assign) -> tuple[tuple[int, int], ...] | None:
    v = assign.value
    if isinstance(v, ast.Name) and v.text == "auto":
        return None
    if not isinstance(v, ast.ListExpr) or not v.items:
        scope.bad_value(v.span, "split is `auto` or a list of block ranges such as [0:3, 3:6]")
        raise Unresolved()
    ranges = []
    for item in v.items:
        if not isinstance(item, ast.RangeItem):
            scope.bad_value(item.span, "each split entry is a range start:stop", hint="e.g. [0:3, 3:6]")
            raise Unresolved()
        try:
            a = to_expr(item.start, scope.lookup)
            b = to_expr(item.stop, scope.lookup)
        except ExprError as exc:
            scope.diags.append(exc.diagnostic)
            raise Unresolved() from None
        if a.free_symbols or b.free_symbols or not (a.is_Integer and b.is_Integer):
            scope.bad_value(item.span, "split ranges must be whole numbers")
            raise Unresolved()
        ranges.append((int(a), int(b)))
        scope.spans[f"pipeline.split.{len(ranges) - 1}"] = item.span
    return tuple(ranges)
