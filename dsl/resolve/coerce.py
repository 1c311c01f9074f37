"""Small typed readers every block uses: a key's entry as a bool, a float, a choice, a call such
as ``adamw(lr = 3e-4)`` with its options typed. Each records its diagnostic and raises
`Unresolved` (or, for an option, `ExprError`) when the value is not of its kind."""

from __future__ import annotations

from typing import Any

from .. import ast, schema
from ..exact import Expr
from ..expr import ExprError, bad_value, source_text, to_expr
from ..span import Span
from .scope import Scope, Unresolved, did_you_mean, plain_number

OptionTable = dict[str, tuple[str, Any]]  # option -> (kind, default), as schema's *_ARGS

def bool_value(scope: Scope, assign: ast.Assign) -> bool:
    v = assign.value
    if not isinstance(v, ast.Bool):
        scope.bad_value(v.span, f"{assign.key} must be true or false")
        raise Unresolved()
    return v.value

def float_value(scope: Scope, assign: ast.Assign) -> float:
    value = scope.expr_value(assign.value)
    if not isinstance(value, Expr) or value.free_symbols or not value.is_number:
        scope.bad_value(assign.value.span, f"{assign.key} must be a number")
        raise Unresolved()
    try:
        return float(value)
    except OverflowError:
        scope.bad_value(assign.value.span, f"{assign.key} is out of range")
        raise Unresolved() from None

def enum_value(scope: Scope, block: str, key: str, entries: dict[str, ast.Assign]) -> str:
    spec_key = schema.BLOCKS[block][key]
    if key not in entries:
        return spec_key.default
    v = entries[key].value
    name = v.text if isinstance(v, ast.Name) else v.value if isinstance(v, ast.Str) else None
    if isinstance(v, ast.Num) and v.text in spec_key.choices:  # `precision = 1f1b` can't lex as a name
        name = v.text
    if name is None or name not in spec_key.choices:
        shown = name if name is not None else source_text(v.span, scope.text)
        scope.unknown_choice(v.span, f"unknown {key} '{shown}'",
                  hint=did_you_mean(str(shown), spec_key.choices) or f"choose one of: {', '.join(spec_key.choices)}")
        raise Unresolved()
    return name

def call_value(scope: Scope, assign: ast.Assign, key: str, table: dict[str, OptionTable]) -> tuple[str, dict[str, Any]]:
    """`key = name(options...)` (or a bare `name`), one of `table`'s: its name and typed options."""
    v = assign.value
    if isinstance(v, ast.Name) and len(v.parts) == 1:
        v = ast.Call(v.parts[0], (), (), v.span)
    if not isinstance(v, ast.Call) or v.func not in table:
        name = v.func if isinstance(v, ast.Call) else ""
        scope.unknown_choice(v.span, f"{key} must be one of: {', '.join(f'{n}(...)' for n in table)}",
                  hint=did_you_mean(name, table) if name else "")
        raise Unresolved()
    opts = call_args(scope, v.func, v.args, v.kwargs, table[v.func], v.span)
    if opts is None:
        raise Unresolved()
    return v.func, opts

def call_args(scope: Scope, func: str, args: tuple[ast.Expr, ...], kwargs: tuple[ast.KwArg, ...],
              table: OptionTable, span: Span) -> dict[str, Any] | None:
    """The options of a call, positional or by name, typed and over their defaults (None after
    a diagnostic)."""
    out = {k: d for k, (_, d) in table.items()}
    names = list(table)
    ok = True
    if len(args) > len(names):
        scope.bad_value(span, f"{func}(...) takes at most {len(names)} values", hint=f"arguments: {', '.join(names) or 'none'}")
        return None
    pairs = [(names[i], a, a.span) for i, a in enumerate(args)] + [(k.name, k.value, k.span) for k in kwargs]
    seen: set[str] = set()
    for name, value, vspan in pairs:
        if name not in table:
            scope.unknown_choice(vspan, f"{func}(...) has no option '{name}'",
                      hint=did_you_mean(name, table) or f"options: {', '.join(names) or 'none'}")
            ok = False
            continue
        if name in seen:
            scope.given_twice(vspan, f"option '{name}' is given twice")
            ok = False
            continue
        seen.add(name)
        kind = table[name][0]
        try:
            out[name] = typed(scope, kind, value, name)
        except (ExprError, Unresolved) as exc:
            if isinstance(exc, ExprError):
                scope.diags.append(exc.diagnostic)
            ok = False
    return out if ok else None

def typed(scope: Scope, kind: str, v: ast.Expr, name: str) -> Any:
    """An option's value of `kind` (bool, floats2, str, int, float); ExprError when it is not."""
    if kind == "bool":
        if not isinstance(v, ast.Bool):
            raise ExprError(bad_value(v.span, f"{name} must be true or false"))
        return v.value
    if kind == "floats2":
        if not isinstance(v, ast.ListExpr) or len(v.items) != 2:
            raise ExprError(bad_value(v.span, f"{name} must be a list of two numbers, e.g. [0.9, 0.95]"))
        return tuple(typed(scope, "float", i, name) for i in v.items)  # type: ignore[arg-type]
    if kind == "str":
        if not isinstance(v, ast.Str):
            raise ExprError(bad_value(v.span, f"{name} must be a string"))
        return v.value
    value = plain_number(to_expr(v, scope.lookup), v.span)
    if kind == "int":
        if not isinstance(value, int):
            raise ExprError(bad_value(v.span, f"{name} must be a whole number"))
        return value
    try:
        return float(value)
    except OverflowError:
        raise ExprError(bad_value(v.span, f"{name} is out of range")) from None
