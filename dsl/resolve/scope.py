"""What resolve knows while it goes, and what names mean in a spec's numbers: the keys and blocks
given, the model's config and dims, each numeric key's value (written, or its derived default),
cycles among them. Every block's resolver reads and records through one `Scope`."""

from __future__ import annotations

import difflib
from typing import Any, Callable, Iterable

import attrs

from .. import ast, schema
from ..diagnostics import Diagnostic, error
from ..exact import ZERO, Expr, Term
from ..expr import Divisions, ExprError, bad_value, to_expr
from ..span import Span
from ..spec import WORLD
from .located import Located


class Unresolved(Exception):
    """A value could not be resolved; its diagnostic is already recorded."""


def did_you_mean(name: str, options: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(options), n=1, cutoff=0.6)
    return f"did you mean '{close[0]}'?" if close else ""


@attrs.define(eq=False)
class Scope:
    doc: ast.Document
    text: str
    located: Located  # every file and package the spec names, looked up before resolve
    diags: list[Diagnostic] = attrs.field(factory=list)
    spans: dict[str, Span] = attrs.field(factory=dict)
    blocks: dict[str, ast.Block] = attrs.field(factory=dict)
    requires: list[ast.Require] = attrs.field(factory=list)
    entries: dict[str, dict[str, ast.Assign]] = attrs.field(factory=dict)  # block -> key -> assign
    config: dict[str, Any] = attrs.field(factory=dict)
    config_exprs: dict[str, ast.Assign] = attrs.field(factory=dict)
    dims: dict[str, int] = attrs.field(factory=dict)
    values: dict[str, Term] = attrs.field(factory=dict)  # "mesh.tp" -> value
    evaluating: dict[str, None] = attrs.field(factory=dict)  # the chain being evaluated, in order (for cycles)
    divisions: Divisions = attrs.field(factory=Divisions)
    family: Any = None  # the model family, once the model block is resolved
    hf_class: str | None = None  # the HF model class the source builds, if any

    def err(self, code: str, span: Span | None, message: str, **kw: str) -> None:
        self.diags.append(error(code, span, message, **kw))

    # one rule each, met by every block resolve reads
    def bad_value(self, span: Span | None, message: str, **kw: str) -> None:
        self.diags.append(bad_value(span, message, **kw))

    def unknown_key(self, span: Span | None, message: str, **kw: str) -> None:
        """E0101: a key the block does not have, or an entry in the wrong block."""
        self.err("E0101", span, message, **kw)

    def given_twice(self, span: Span | None, message: str, **kw: str) -> None:
        """E0104: a block, key, config key or option given twice."""
        self.err("E0104", span, message, **kw)

    def unknown_choice(self, span: Span | None, message: str, **kw: str) -> None:
        """E0107: a name that is not one of the choices (style, dtype, optimizer, option, ...)."""
        self.err("E0107", span, message, **kw)

    def guard(self, fn: Callable[[Scope], Any]) -> Any:
        """fn(self), or None when it could not be resolved (its diagnostics are recorded)."""
        try:
            return fn(self)
        except Unresolved:
            return None

    # ---- config values (model.config): plain values, arithmetic over other config values
    def config_value(self, v: ast.Expr, lookup: Callable[[ast.Name], Term] | None = None) -> Any:
        """A plain value: number, string, bool, none, list; arithmetic over config values
        (`lookup`: the names a nested block's values may use, `block_lookup`)."""
        if isinstance(v, ast.Str):
            return v.value
        if isinstance(v, ast.NoneLit):
            return None
        if isinstance(v, ast.Bool):
            return v.value
        if isinstance(v, ast.ListExpr):
            return [self.config_value(i, lookup) for i in v.items if not isinstance(i, ast.RangeItem)]
        if isinstance(v, ast.Call):
            raise ExprError(bad_value(v.span, f"a call '{v.func}(...)' is not a config value"))
        return plain_number(to_expr(v, lookup or self._config_lookup), v.span)

    def block_lookup(self, exprs: dict[str, ast.Assign], values: dict[str, Any], where: str) -> Callable[[ast.Name], Term]:
        """The names of a nested config block's values (`config { text_config { ... } }`): the
        block's own keys, evaluated into `values` on first use. `where`: the block's path."""
        evaluating: dict[str, None] = {}

        def lookup(name: ast.Name) -> Term:
            key = name.text
            if key not in exprs:
                raise _unknown_name(name, f" in config block '{where}'", exprs,
                                    "values in a config block may refer to the keys of the same block only")
            if key not in values:
                if key in evaluating:
                    raise _self_reference(name.span, key, evaluating)
                evaluating[key] = None
                try:
                    values[key] = self.config_value(exprs[key].value, lookup)
                finally:
                    evaluating.pop(key, None)
            value = values[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ExprError(bad_value(name.span, f"config '{where}.{key}' = {value!r} is not a number"))
            return Expr.const(value)

        return lookup

    def _config_lookup(self, name: ast.Name) -> Term:
        key = name.parts[-1] if len(name.parts) == 2 and name.parts[0] in ("config", "model") else name.text
        if key in self.config_exprs and len(name.parts) <= 2:
            if key in self.evaluating:
                raise _self_reference(name.span, key, self.evaluating)
            if key not in self.config:
                self.evaluating[key] = None
                try:
                    self.config[key] = self.config_value(self.config_exprs[key].value)
                finally:
                    self.evaluating.pop(key, None)
            value = self.config[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ExprError(bad_value(name.span, f"config '{key}' = {value!r} is not a number"))
            return Expr.const(value)
        raise _unknown_name(name, " in config", self.config_exprs, "config values may refer to other config values only")

    # ---- names in numeric expressions
    def _known_names(self) -> dict[str, str]:
        """bare or dotted name -> qualified name ("tp" -> "mesh.tp")."""
        names: dict[str, str] = {"world": "world"}
        for k in self.dims:
            names[k] = f"dims.{k}"
        for block in ("train", "pipeline"):
            for k, key in schema.BLOCKS[block].items():
                if key.kind == "int":
                    names[k] = f"{block}.{k}"
                    names[f"{block}.{k}"] = f"{block}.{k}"
        for k in self.config:
            names[k] = f"config.{k}"
            names[f"config.{k}"] = f"config.{k}"
            names[f"model.{k}"] = f"config.{k}"
        for k in ("tp", "pp", "dp", "ep", "cp"):
            names[k] = f"mesh.{k}"
            names[f"mesh.{k}"] = f"mesh.{k}"
        return names

    def lookup(self, name: ast.Name) -> Term:
        names = self._known_names()
        q = names.get(name.text)
        if q is None:
            raise _unknown_name(name, "", names, "names are world, tp, pp, dp, ep, cp, config keys and pipeline/train numbers")
        if q == "world":
            return WORLD
        if q.startswith("dims."):
            return Expr.const(self.dims[q[5:]])
        if q.startswith("config."):
            value = self.config[q[7:]]
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ExprError(bad_value(name.span, f"'{name.text}' = {value!r} is not a number"))
            return Expr.const(value)
        return self.numeric(q, name.span)

    def numeric(self, q: str, use_span: Span | None = None) -> Term:
        """The value of the numeric key `q` ("pipeline.chunks"): as written, else its default."""
        if q in self.values:
            return self.values[q]
        if q in self.evaluating:
            raise _self_reference(use_span, q, self.evaluating)
        block, _, key = q.partition(".")
        assign = self.entries.get(block, {}).get(key)
        self.evaluating[q] = None
        try:
            if assign is not None:
                value = to_expr(assign.value, self.lookup, self.divisions)
                if not isinstance(value, Expr):
                    raise ExprError(bad_value(assign.value.span, f"{q} must be a number"))
            else:
                if use_span is not None and q == "train.seq_len":  # optional (a model fed images has none)
                    raise ExprError(bad_value(use_span, "'seq_len' is not written in this spec, and has no default"))
                value = self._default_numeric(q)
        finally:
            self.evaluating.pop(q, None)
        self.values[q] = value
        return value

    def _default_numeric(self, q: str) -> Term:
        if q == "mesh.dp":
            tp, pp, cp = self.numeric("mesh.tp"), self.numeric("mesh.pp"), self.numeric("mesh.cp")
            return _ratio(WORLD, tp * pp * cp)
        if q == "pipeline.microbatches":
            if "microbatch_size" in self.entries.get("pipeline", {}):
                return _ratio(self.numeric("train.global_batch"), self.numeric("mesh.dp") * self.numeric("pipeline.microbatch_size"))
            return Expr.const(1)
        if q == "pipeline.microbatch_size":
            return _ratio(self.numeric("train.global_batch"), self.numeric("mesh.dp") * self.numeric("pipeline.microbatches"))
        block, _, key = q.partition(".")
        spec_key = schema.BLOCKS[block][key]
        if spec_key.default is None:
            raise Unresolved()
        return Expr.const(spec_key.default)

    def int_value(self, q: str) -> Expr:
        try:
            return self.numeric(q)
        except ExprError as exc:
            self.diags.append(exc.diagnostic)
            raise Unresolved() from None

    def concrete_int(self, q: str, minimum: int = 0) -> int:
        v = self.int_value(q)
        span = self.spans.get(q)
        if v.free_symbols:
            self.bad_value(span, f"{q} cannot depend on the world size", label=str(v))
            raise Unresolved()
        return plain_int(v, span, q, minimum, self.diags)

    def expr_value(self, v: ast.Expr) -> Term:
        try:
            return to_expr(v, self.lookup)
        except ExprError as exc:
            self.diags.append(exc.diagnostic)
            raise Unresolved() from None


def _unknown_name(name: ast.Name, where: str, known: Iterable[str], names_are: str) -> ExprError:
    """E0105: a name that means nothing here (`where`: " in config", or ""), with the closest
    known one, else what the names are."""
    return ExprError(error("E0105", name.span, f"unknown name '{name.text}'{where}",
                           hint=did_you_mean(name.text, known) or names_are))


def _self_reference(span: Span | None, name: str, chain: dict[str, None]) -> ExprError:
    """E0105: `name`'s value depends on itself; `chain`: the names being evaluated, in order."""
    names = list(chain)
    cycle = " -> ".join(names[names.index(name):] + [name])
    return ExprError(error("E0105", span, f"'{name}' is defined in terms of itself", label=cycle))


def _ratio(a: Expr, b: Expr) -> Expr:
    """A derived default a / b. A zero b (tp = 0, microbatches = 0) is reported by the rules on
    the value the user wrote; the derived value becomes 0, which no rule accepts either."""
    return ZERO if b.is_zero else a / b


def plain_number(value: Term, span: Span) -> int | float:
    if not isinstance(value, Expr) or value.free_symbols or not value.is_number:
        raise ExprError(bad_value(span, "expected a number here", label="cannot depend on the world size"
                              if isinstance(value, Expr) and value.free_symbols else "not a number"))
    if value.is_Integer:
        return int(value)
    try:
        f = float(value)  # a fraction such as `1 / 1000` in a float option or config value
    except OverflowError:
        f = float("inf")
    if f != f or f in (float("inf"), float("-inf")):
        raise ExprError(bad_value(span, "number out of range"))
    return f


def plain_int(v: Term, span: Span | None, what: str, minimum: int, diags: list[Diagnostic]) -> int:
    if not isinstance(v, Expr) or not v.is_Integer:
        diags.append(bad_value(span, f"{what} must be a whole number", label=str(v)))
        raise Unresolved()
    if int(v) < minimum:
        diags.append(bad_value(span, f"{what} must be at least {minimum}", label=f"is {int(v)}"))
        raise Unresolved()
    return int(v)
