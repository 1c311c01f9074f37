"""Sources made of sources: ``mix(a, b, ..., weights = [...], seed = N)`` (a weighted mixture,
each positional argument a data source resolved as `train.data` is) and ``holdout(fraction)``
(``train.eval.data`` only: that fraction of ``train.data``'s items, never trained on). Typed here;
what they must satisfy (positive weights, one per source, parts that give one kind of sample, a
fraction in (0, 1)) is dsl/data_check_mix.py's (E0454 to E0456). The runtime is runtime/data/mix.py.

Spans: ``<where>.call``, ``<where>.weights``, ``<where>.weights[i]``, ``<where>.fraction``; part
``i`` records its own under ``<where>[i]``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .. import ast, schema
from ..expr import ExprError, to_expr
from ..spec import DataSpec
from .coerce import call_args
from .scope import Scope, Unresolved, plain_number

PartResolver = Callable[..., DataSpec]


def resolve_mix(scope: Scope, call: ast.Call, seed: int, where: str, resolve_part: PartResolver) -> DataSpec:
    scope.spans[f"{where}.call"] = call.span
    if call.func == "holdout":
        opts = call_args(scope, "holdout", call.args, call.kwargs, schema.DATA_MIX_ARGS["holdout"], call.span)
        if opts is None:
            raise Unresolved()
        given = [*call.args[:1], *(k.value for k in call.kwargs if k.name == "fraction")]
        if not given:
            scope.bad_value(call.span, "holdout(...) needs the fraction of train.data to hold out",
                            hint="e.g. holdout(0.05)")
            raise Unresolved()
        scope.spans[f"{where}.fraction"] = given[0].span
        return DataSpec("holdout", {"fraction": opts["fraction"]})
    ok = True
    parts: list[DataSpec] = []
    for i, arg in enumerate(call.args):
        try:
            parts.append(resolve_part(scope, {"data": ast.Assign("data", arg.span, arg, arg.span)}, seed,
                                      where=f"{where}[{i}]"))
        except Unresolved:
            ok = False
    opts: dict[str, Any] = {"weights": None, "seed": seed}
    for kw in call.kwargs:
        scope.spans[f"{where}.{kw.name}"] = kw.value.span
        try:
            if kw.name == "weights":
                opts["weights"] = _weights(scope, kw.value, where)
            elif kw.name == "seed":
                value = plain_number(to_expr(kw.value, scope.lookup), kw.value.span)
                if not isinstance(value, int):
                    scope.bad_value(kw.value.span, "seed must be a whole number")
                    raise Unresolved()
                opts["seed"] = value
            else:
                scope.unknown_choice(kw.span, f"mix(...) has no option '{kw.name}'",
                                     hint="mix(source, source, ..., weights = [w, w, ...], seed = N)")
                ok = False
        except ExprError as exc:
            scope.diags.append(exc.diagnostic)
            ok = False
        except Unresolved:
            ok = False
    if not ok:
        raise Unresolved()
    opts["parts"] = tuple((p.kind, tuple(sorted(p.options.items()))) for p in parts)
    return DataSpec("mix", opts)


def _weights(scope: Scope, value: ast.Expr, where: str) -> tuple[float, ...]:
    if not isinstance(value, ast.ListExpr) or any(isinstance(i, ast.RangeItem) for i in value.items):
        scope.bad_value(value.span, "weights must be a list of numbers, one per source", hint="e.g. weights = [0.7, 0.3]")
        raise Unresolved()
    out = []
    for i, item in enumerate(value.items):
        scope.spans[f"{where}.weights[{i}]"] = item.span
        out.append(float(plain_number(to_expr(item, scope.lookup), item.span)))
    return tuple(out)


def parts_of(data: DataSpec) -> list[DataSpec]:
    """A mix's sources as data specs."""
    return [DataSpec(kind, dict(options)) for kind, options in data.options["parts"]]
