"""`ppdsl check`: text -> AST -> Spec -> every rule, the model, the schedule -> diagnostics."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Sequence

import attrs
import sympy

from ppdsl.dsl import diagnostics as dg
from ppdsl.dsl.diagnostics import Diagnostic, SpecError, error, note
from ppdsl.dsl.overrides import apply_overrides
from ppdsl.dsl.parse import decode, parse
from ppdsl.dsl.resolve import resolve
from ppdsl.dsl.rules import Constraint, constraints
from ppdsl.dsl.spec import WORLD, Spec
from ppdsl.dsl.world import MAX_WORLD, Unsupported, compile_condition, describe, value_at


@attrs.frozen
class CheckResult:
    file: str
    text: str
    spec: Spec | None
    diagnostics: tuple[Diagnostic, ...]
    world: int | None  # the world size checked, or None when it was left free
    valid_worlds: tuple[int, ...] | None = None  # with world free: every size up to MAX_WORLD that works
    worlds: str | None = None  # ... and its description
    model_info: object = attrs.field(default=None, eq=False, repr=False)  # introspect.ModelInfo when built

    @property
    def ok(self) -> bool:
        return not dg.has_errors(self.diagnostics)


def load_spec(path: str | Path, overrides: Sequence[str] = ()) -> tuple[Spec | None, list[Diagnostic], str]:
    """Read, parse, apply --set overrides and resolve. Never raises for bad input."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as exc:
        return None, [error("E0000", None, f"cannot read {p}: {exc.strerror or exc}")], ""
    return load_text(data, str(p), overrides)


def load_text(data: bytes | str, file: str, overrides: Sequence[str] = ()) -> tuple[Spec | None, list[Diagnostic], str]:
    text = ""
    try:
        text = data if isinstance(data, str) else decode(data, file)
        doc = parse(text, file)
        doc = apply_overrides(doc, list(overrides))
    except SpecError as exc:
        return None, list(exc.diagnostics), text
    spec, diags = resolve(doc, text)
    return spec, diags, text


def check_file(path: str | Path, world: int | None = None, overrides: Sequence[str] = (),
               model: bool = True) -> CheckResult:
    spec, diags, text = load_spec(path, overrides)
    return _check(str(path), text, spec, diags, world, model)


def check_text(text: str, file: str = "<spec>", world: int | None = None, overrides: Sequence[str] = (),
               model: bool = False) -> CheckResult:
    spec, diags, text = load_text(text, file, overrides)
    return _check(file, text, spec, diags, world, model)


def _check(file: str, text: str, spec: Spec | None, diags: list[Diagnostic], world: int | None,
           model: bool) -> CheckResult:
    if spec is None:
        return CheckResult(file, text, None, _sorted(diags), world)
    if world is not None and world < 1:
        diags.append(error("E0005", None, f"--world must be at least 1, got {world}"))
        return CheckResult(file, text, spec, _sorted(diags), world)
    found, valid, described = _decide(spec, world)
    diags.extend(found)
    info = None
    if model:
        info, found = _model_level(spec)
        diags.extend(found)
    if not dg.has_errors(diags):
        diags.extend(_schedule_level(spec, world))
    return CheckResult(file, text, spec, _sorted(diags), world, valid, described, info)


def _sorted(diags: list[Diagnostic]) -> tuple[Diagnostic, ...]:
    unique: dict[tuple, Diagnostic] = {}
    for d in diags:
        unique.setdefault((d.code, d.span, d.message), d)
    return tuple(sorted(unique.values(), key=dg.sort_key))


def _as_diagnostic(c: Constraint, world: int | None) -> Diagnostic:
    values = {k: value_at(v, world) for k, v in c.values.items()}
    values["world"] = str(world) if world is not None else "world"
    fmt = lambda s: s.format(**values) if s else s  # noqa: E731
    make = dg.warning if c.severity == "warning" else dg.error
    return make(c.code, c.span, fmt(c.message), label=fmt(c.label), hint=fmt(c.hint))


def _decide(spec: Spec, world: int | None) -> tuple[list[Diagnostic], tuple[int, ...] | None, str | None]:
    out: list[Diagnostic] = []
    free: list[tuple[Constraint, object]] = []
    for c in constraints(spec):
        cond = c.condition
        if world is not None:
            cond = cond.subs(WORLD, world) if WORLD in cond.free_symbols else cond
        extra = cond.free_symbols - {WORLD}
        if extra:
            out.append(error("E0105", c.span, f"cannot decide a rule over unknown names {sorted(map(str, extra))}"))
            continue
        try:
            fn = compile_condition(cond)
        except (Unsupported, ZeroDivisionError, TypeError) as exc:
            out.append(error("E0103", c.span, f"cannot evaluate rule {c.code}: {exc}"))
            continue
        if WORLD in cond.free_symbols:
            free.append((c, fn))
            continue
        if not _safe(fn, world or 1):
            out.append(_as_diagnostic(c, world))
    out = _drop_cascades(spec, out)
    if world is not None or dg.has_errors(out):
        return out, None, None
    candidates = list(range(1, MAX_WORLD + 1))
    for _, fn in free:  # filter rule by rule: the mesh rule alone removes most sizes
        candidates = [w for w in candidates if _safe(fn, w)]
    valid = tuple(candidates)
    if not valid:
        out.append(error("E0601", spec.span("mesh") or spec.span("model"), "no world size satisfies every rule of this spec",
                         hint="the rules below each hold for some world sizes, but never together"))
        for c, fn in free:
            alone = [w for w in range(1, MAX_WORLD + 1) if _safe(fn, w)]
            msg = _as_diagnostic(c, None)
            out.append(note(c.code, c.span, f"{msg.message}: holds for {describe(alone)}"))
    return out, valid, describe(valid) if valid else None


def _drop_cascades(spec: Spec, out: list[Diagnostic]) -> list[Diagnostic]:
    """A mesh that does not fit the world makes dp meaningless: report that, not its consequences."""
    if not any(d.code in ("E0201", "E0202") for d in out):
        return out
    mesh = spec.span("mesh")
    def inside_mesh(d: Diagnostic) -> bool:
        return mesh is not None and d.span is not None and d.span.file == mesh.file and \
            spec.span("mesh").line <= d.span.line <= _block_end(spec, "mesh")
    return [d for d in out if not (d.code == "E0302" or (d.code == "E0110" and inside_mesh(d)))]


def _block_end(spec: Spec, block: str) -> int:
    return max((s.end_line for k, s in spec.spans.items() if k == block or k.startswith(block + ".")), default=0)


def _safe(fn, w: int) -> bool:
    try:
        return fn(w)
    except (ZeroDivisionError, Unsupported):
        return False


def _model_level(spec: Spec) -> tuple[object, list[Diagnostic]]:
    if importlib.util.find_spec("torch") is None:
        return None, [note("N0400", spec.span("model.source"), "model-level checks skipped: torch is not installed")]
    from ppdsl.dsl.introspect import ModelLoadError, introspect
    from ppdsl.dsl.model_check import check_model

    try:
        info = introspect(spec.model.source.kind, spec.model.source.target, dict(spec.model.config))
    except ModelLoadError as exc:
        return None, [error("E0401", spec.span("model.source"), f"cannot build the model: {exc}",
                      hint="fix the source or config, or pass --no-model to check the spec alone")]
    return info, list(check_model(spec, info))


def _schedule_level(spec: Spec, world: int | None) -> list[Diagnostic]:
    """Generate and simulate the schedule when its sizes are known: deadlocks are check errors."""
    from ppdsl.lowering.schedules import generate
    from ppdsl.lowering.simulate import validate

    sizes = []
    for v in (spec.mesh.pp, spec.pipeline.microbatches, spec.pipeline.chunks):
        if world is not None:
            v = v.subs(WORLD, world) if isinstance(v, sympy.Expr) else v
        if not (isinstance(v, sympy.Expr) and v.is_Integer):
            return []
        sizes.append(int(v))
    pp, m, chunks = sizes
    span = spec.span("pipeline.style") or spec.span("pipeline")
    try:
        schedule = generate(spec.pipeline.style, pp, m, chunks)
    except ValueError as exc:
        return [error("E0312", span, f"cannot build the {spec.pipeline.style} schedule: {exc}")]
    problems = validate(schedule)
    return [error("E0312", span, f"schedule {spec.pipeline.style} (pp={pp}, microbatches={m}, chunks={chunks}): {p.message}",
                  hint="this is a bug in ppdsl's schedule generator; please report it") for p in problems[:5]]
