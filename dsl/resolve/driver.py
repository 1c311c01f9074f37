"""AST -> Spec, pass by pass: look up the files the spec names, then its shape, each block, the
requirements. Collects every error it finds."""

from __future__ import annotations

from pathlib import Path

import attrs

from .. import ast
from ..diagnostics import Diagnostic
from ..exact import Expr
from ..expr import ExprError, source_text, to_expr
from ..spec import MeshSpec, ModelSpec, Requirement, Spec
from .located import locate
from .model import resolve_model
from .pipeline import resolve_pipeline
from .scope import Scope, Unresolved
from .structure import check_version, collect_blocks
from .tensor_parallel import resolve_tensor_parallel
from .train import resolve_train


def resolve(doc: ast.Document, text: str, roots: tuple[str, ...] | None = None) -> tuple[Spec | None, list[Diagnostic]]:
    """`roots`: the directories files may be read from (None: anywhere); see locate.outside."""
    scope = Scope(doc, text, locate(doc, Path(doc.file).parent, roots))
    check_version(scope)
    collect_blocks(scope)
    model = resolve_model(scope)
    mesh = scope.guard(_mesh)
    tp = scope.guard(resolve_tensor_parallel)
    pipeline = scope.guard(resolve_pipeline)
    train = scope.guard(resolve_train)
    requires = _requires(scope)
    if any(d.is_error for d in scope.diags) or None in (model, mesh, tp, pipeline, train):
        return None, scope.diags
    if train.precision == "fp64":
        model = _built_for_fp64(model)
    spec = Spec(file=doc.file, model=model, mesh=mesh, tensor_parallel=tp, pipeline=pipeline, train=train,
                requires=tuple(requires), exact_divisions=tuple(scope.divisions.items), spans=dict(scope.spans))
    return spec, scope.diags


# HF config values a model computing in float64 is built with unless the spec's config sets them:
# transformers' default experts kernel (torch's grouped_mm) takes no float64
FP64_BUILD_CONFIG = {"experts_implementation": "eager"}


def _built_for_fp64(model: ModelSpec) -> ModelSpec:
    if model.source.kind == "python":
        return model
    extra = {k: v for k, v in FP64_BUILD_CONFIG.items() if k not in model.config}
    return attrs.evolve(model, config={**model.config, **extra}, resolved_config={**model.resolved_config, **extra})


def _mesh(scope: Scope) -> MeshSpec:
    return MeshSpec(**{k: scope.int_value(f"mesh.{k}") for k in ("tp", "pp", "dp", "ep", "cp")})


def _requires(scope: Scope) -> list[Requirement]:
    out = []
    for req in scope.requires:
        try:
            cond = to_expr(req.expr, scope.lookup, scope.divisions)
        except ExprError as exc:
            scope.diags.append(exc.diagnostic)
            continue
        except Unresolved:
            continue
        if isinstance(cond, Expr):
            scope.bad_value(req.expr.span, "require needs a condition such as `n_embd % (tp * 64) == 0`")
            continue
        out.append(Requirement(cond, source_text(req.expr.span, scope.text), req.message, req.span))
    return out
