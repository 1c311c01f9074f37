"""`ppdsl check`: text -> AST -> Spec -> every rule, the model, the schedule -> diagnostics."""

from __future__ import annotations

import contextlib
import gc
import importlib.util
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import attrs

from . import catalogue, diagnostics as dg
from .blocks import block_count
from .command_line import world_problem
from .diagnostics import Diagnostic, SpecError, error, note
from .exact import Expr
from .expr import out_of_range
from .overrides import apply_overrides
from .input_check import check_inputs
from .own_check import with_inferred_layout
from .parse import parse
from .read import decode, read_spec
from .resolve import resolve
from .rules import Constraint, Launch, constraints
from .span import Span
from .spec import WORLD, Spec
from .world import MAX_WORLD, Unsupported, compile_condition, describe, value_at


# (kind, target, config) -> introspect.ModelInfo, or None when not known (yet); raises ModelLoadError
ModelFacts = Callable[[str, str, Mapping[str, object]], Any]

MAX_SIMULATED = 200_000  # pp * microbatches * chunks above which check does not simulate the schedule


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


def load_spec(path: str | Path, overrides: Sequence[str] = (),
              roots: tuple[str, ...] | None = None) -> tuple[Spec | None, list[Diagnostic], str]:
    """Read, parse, apply --set overrides and resolve. Never raises for bad input. `roots`: the
    directories the spec's files may be read from (None: anywhere)."""
    try:
        data = read_spec(path)
    except SpecError as exc:
        return None, list(exc.diagnostics), ""
    return load_text(data, str(Path(path)), overrides, roots)


def load_text(data: bytes | str, file: str, overrides: Sequence[str] = (),
              roots: tuple[str, ...] | None = None) -> tuple[Spec | None, list[Diagnostic], str]:
    text = ""
    try:
        text = data if isinstance(data, str) else decode(data, file)
        doc = parse(text, file)
        doc = apply_overrides(doc, list(overrides))
    except SpecError as exc:
        return None, list(exc.diagnostics), text
    spec, diags = resolve(doc, text, roots)
    return spec, diags, text


def check_file(path: str | Path, world: int | None = None, overrides: Sequence[str] = (),
               model: bool = True, allow_paths: Sequence[str] = (), launch: Launch | None = None) -> CheckResult:
    """Without `model` nothing of the spec runs, and no file outside the spec's directory (and
    `allow_paths`) is read: a stranger's spec can be checked safely (docs/cli.md, trust model).
    `launch`: how `ppdsl run` starts this world, for the hints that say the command (E0201)."""
    roots = None if model else (str(Path(path).resolve().parent), *allow_paths)
    spec, diags, text = load_spec(path, overrides, roots)
    return _check(str(path), text, spec, diags, world, model, roots, launch=launch)


def check_text(text: str, file: str = "<spec>", world: int | None = None, overrides: Sequence[str] = (),
               model: bool = False, model_facts: ModelFacts | None = None) -> CheckResult:
    """`model_facts`: with `model`, how the model's facts are had (default: the cache, else a build);
    the language server passes one that returns None while it builds them aside."""
    spec, diags, text = load_text(text, file, overrides)
    return _check(file, text, spec, diags, world, model, model_facts=model_facts)


def _check(file: str, text: str, spec: Spec | None, diags: list[Diagnostic], world: int | None,
           model: bool, roots: tuple[str, ...] | None = None, model_facts: ModelFacts | None = None,
           launch: Launch | None = None) -> CheckResult:
    if spec is None:
        return CheckResult(file, text, None, _sorted(diags), world)
    bad_world = world_problem(world)
    if bad_world is not None:
        diags.append(bad_world)
        return CheckResult(file, text, spec, _sorted(diags), world)
    info, model_found = None, []
    if model:  # before the rules: an image model's activation length is the model's (dsl/input_check.py)
        info, model_found = _model_level(spec, model_facts)
        spec = with_inferred_layout(spec, info)  # the own forward's layout, where the spec leaves it out
        spec, inputs = check_inputs(spec, info)
        model_found = [*model_found, *inputs]
    # E0308 on the blocks lowering cuts: the model's where it has them (W0403 where the config says otherwise)
    found, valid, described = _decide(spec, world, launch, block_count(spec.pipeline.blocks, {}, info) or None)
    diags.extend(found + model_found)
    layers = spec.model.dims.get("layers")
    if info is None and spec.pipeline.split is not None and isinstance(layers, int):
        # without the model, explicit ranges are still checked against the config's layer count
        from .model_check import check_split

        diags.extend(check_split(spec, layers))
    if not dg.has_errors(diags):
        diags.extend(_schedule_level(spec, world))
    from .data_check import check_data  # the files `train.data` names (E0410 to E0418)

    diags.extend(check_data(spec, world, roots, render=model))
    from .profile_check import check_profile  # pipeline.profile (E0314, E0316)

    diags.extend(check_profile(spec, info))
    from .metrics_check import check_metrics  # W0419: metrics = tensorboard without tensorboard

    diags.extend(check_metrics(spec))
    from .nonfinite_check import check_nonfinite  # W0325, W0326: train.on_nonfinite = stop

    diags.extend(check_nonfinite(spec))
    if not dg.has_errors(diags):  # advice about waste only for a spec that is otherwise right
        diags.extend(_idle_tensor_parallel(spec, world))
        from .zero_check import check_zero  # W0317: zero = 1 or 3 with dp = 1

        diags.extend(check_zero(spec, world, valid))
    return CheckResult(file, text, spec, _sorted(diags), world, valid, described, info)


def _idle_tensor_parallel(spec: Spec, world: int | None) -> list[Diagnostic]:
    """W0217: tp > 1 while no rule splits a module: the tp ranks would all compute the same."""
    if any(r.style != "replicate" for r in spec.tensor_parallel.rules):
        return []
    if spec.tensor_parallel.hf_plan is not None:  # the class's plan: only the model tells its rules (E0223 if none)
        return []
    tp = value_at(spec.mesh.tp, world)
    if not tp.isdigit() or int(tp) <= 1:  # unknown until the world size is (or not > 1)
        return []
    return [dg.warning("W0217", spec.span("mesh.tp") or spec.span("mesh"),
                       f"tp = {tp}, but no tensor_parallel rule splits a module: the {tp} ranks of each tp "
                       "group would all compute the same thing",
                       hint="add split rules (`pattern : column`, `pattern : row`), or set tp = 1 and use the "
                            "ranks for dp")]


def _sorted(diags: list[Diagnostic]) -> tuple[Diagnostic, ...]:
    """Unique diagnostics in source order; the notes that follow an error (E0601) stay after it."""
    groups: list[list[Diagnostic]] = []
    seen: set[tuple] = set()
    for d in diags:
        key = (d.code, d.span, d.message)
        if key in seen:
            continue
        seen.add(key)
        if d.severity is dg.Severity.NOTE and not d.code.startswith("N") and groups:
            groups[-1].append(d)
        else:
            groups.append([d])
    groups.sort(key=lambda g: dg.sort_key(g[0]))
    return tuple(d for g in groups for d in g)


def _decide(spec: Spec, world: int | None, launch: Launch | None = None,
            blocks: int | None = None) -> tuple[list[Diagnostic], tuple[int, ...] | None, str | None]:
    """`blocks`: the built model's block count (None: the config's layer count)."""
    out: list[Diagnostic] = []
    free: list[tuple[Constraint, object]] = []
    for c in constraints(spec, blocks):
        cond = c.condition  # in one unknown, the world size (dsl/exact.py): resolve bound every name
        try:
            fn = compile_condition(cond)
        except (Unsupported, ArithmeticError, ValueError, TypeError) as exc:
            # a number that is not finite, from no expression of the spec (which refuses its own)
            out.append(out_of_range(c.span, label=f"rule {c.code} cannot be evaluated: {exc}"))
            continue
        if world is None and WORLD in cond.free_symbols:
            free.append((c, fn))
            continue
        if not _safe(fn, world or 1):
            out.append(_failure(spec, c, world, launch, blocks))
    out = _drop_cascades(spec, out)
    if world is not None or dg.has_errors(out):
        return out, None, None
    candidates = list(range(1, MAX_WORLD + 1))
    for _, fn in free:  # filter rule by rule: the mesh rule alone removes most sizes
        candidates = [w for w in candidates if _safe(fn, w)]
    valid = tuple(candidates)
    if not valid:
        alone = [(c, [w for w in range(1, MAX_WORLD + 1) if _safe(fn, w)]) for c, fn in free]
        if any(not ws for _, ws in alone):  # a rule that holds for no world size at all: that rule is the error
            for c, ws in alone:
                if not ws:
                    d = c.diagnostic(None)
                    out.append(error(c.code, c.span, f"{_summary(c)}: holds for {describe(ws)}",
                                     hint=(f"{d.hint}; " if d.hint else "") +
                                     f"world sizes above {MAX_WORLD} are not searched: check one with --world N"))
        else:
            out.append(error("E0601", spec.span("mesh") or spec.span("model"),
                             "no world size satisfies every rule of this spec",
                             hint="the rules below each hold for some world sizes, but never together"))
            for c, ws in alone:
                out.append(note(c.code, c.span, f"{_summary(c)}: holds for {describe(ws)}"))
    return out, valid, describe(valid) if valid else None


def _failure(spec: Spec, c: Constraint, world: int | None, launch: Launch | None, blocks: int | None) -> Diagnostic:
    d = c.diagnostic(world)
    if launch is None or not c.hint_at_launch:
        return d
    _, valid, described = _decide(spec, None, blocks=blocks)  # the world sizes that work, for the command that starts one
    return attrs.evolve(d, hint=launch.hint(valid, described, otherwise=d.hint))


def _summary(c: Constraint) -> str:
    """What a rule demands, with the world left free (for E0601 and its notes)."""
    return (attrs.evolve(c, message=c.summary) if c.summary else c).diagnostic(None).message


def _drop_cascades(spec: Spec, out: list[Diagnostic]) -> list[Diagnostic]:
    """Report a cause, not its consequences (which hides which is declared in dsl/catalogue.py).

    - A rule's `hides`: e.g. a mesh that does not fit the world makes dp meaningless (E0302,
      inexact `/` in mesh).
    - A written value reported as unusable (a rule's `invalid_value`: E0202, E0302) makes the
      rules that depend on its key meaningless, and every other rule about the same entry; so
      does an inexact `/` (E0110, `hides_entry`), which in turn is the cause of an unusable value.
    """
    rules = {d.code: catalogue.rule(d.code) for d in out}
    if not any(r.hides or r.invalid_value or r.hides_entry for r in rules.values()):
        return out

    def invalid_key(d: Diagnostic) -> str | None:
        """The key whose written value `d` reports as unusable, if it is such a report."""
        return next((k for k in rules[d.code].invalid_value if d.span is not None and spec.spans.get(k) == d.span),
                    None)
    for r in [r for r in rules.values() if r.hides]:
        for hide in r.hides:
            if hide.within is None:
                out = [d for d in out if d.code not in hide.codes]
            else:
                out = [d for d in out if not (d.code in hide.codes and _inside_block(spec, hide.within, d))]
    dropped = catalogue.dependent_on({k for k in map(invalid_key, out) if k is not None})
    out = [d for d in out if d.code not in dropped]
    inexact = [d.span for d in out if rules[d.code].hides_entry and d.span is not None]

    def is_cause(d: Diagnostic) -> bool:
        if d.span is None:
            return False
        if rules[d.code].hides_entry:
            return True
        # a value that is not a positive whole number, unless an inexact `/` inside it says why
        return invalid_key(d) is not None and not any(_contains(d.span, s) for s in inexact)
    causes = [d.span for d in out if is_cause(d)]
    return [d for d in out if d.span is None or is_cause(d) or not any(_contains(d.span, c) for c in causes)]


def _inside_block(spec: Spec, block: str, d: Diagnostic) -> bool:
    start = spec.span(block)
    return start is not None and d.span is not None and d.span.file == start.file and \
        start.line <= d.span.line <= _block_end(spec, block)


def _contains(outer: Span, inner: Span) -> bool:
    return outer.file == inner.file and (outer.line, outer.column) <= (inner.line, inner.column) and \
        (inner.end_line, inner.end_column) <= (outer.end_line, outer.end_column)


def _block_end(spec: Spec, block: str) -> int:
    return max((s.end_line for k, s in spec.spans.items() if k == block or k.startswith(block + ".")), default=0)


def _safe(fn, w: int) -> bool:
    try:
        return fn(w)
    except (ArithmeticError, ValueError, TypeError, Unsupported):  # undefined there: the rule does not hold
        return False


def _model_level(spec: Spec, model_facts: ModelFacts | None = None) -> tuple[object, list[Diagnostic]]:
    with _gc_paused():
        return _model_level_checks(spec, model_facts)


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Python's cyclic collector paused while the model is imported, built and traced on meta:
    importing torch and transformers allocates millions of objects that live for the process, and
    each full collection on the way walks them all again (measured: about 1 s of a cold check of
    a Qwen2 spec). What the traces leave in cycles is collected once the collector runs again."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _model_level_checks(spec: Spec, model_facts: ModelFacts | None) -> tuple[object, list[Diagnostic]]:
    if importlib.util.find_spec("torch") is None:
        return None, [note("N0400", spec.span("model.source"), "model-level checks skipped: torch is not installed")]
    from ppdsl.core.build import ModelLoadError, add_model_path
    from .introspect import size_problem
    from .model_check import check_model

    too_large = size_problem(spec.model.dims)
    if too_large is not None:
        layers = spec.model.dims.get("layers")
        key = next((k for k, v in spec.model.config.items() if v == layers and f"model.config.{k}" in spec.spans), None)
        at = spec.span(f"model.config.{key}") if key and "blocks" in too_large else None
        return None, [error("E0408", at or spec.span("model.config") or spec.span("model.source"),
                            f"the model is too large to build for checking: {too_large}",
                            hint="check the config (a typo in a layer count or width?); --no-model checks the "
                                 "spec without building it")]

    untested = _untested_versions(spec)
    if spec.model.source.kind == "python":  # a local model module lives next to the spec
        add_model_path(str(Path(spec.file).parent))
    if model_facts is None:  # the facts of the model's last build, else a build (dsl/model_facts_cache.py)
        from .model_facts_cache import cached_introspect as model_facts
    try:
        info = model_facts(spec.model.source.kind, spec.model.source.target, dict(spec.model.config))
    except ModelLoadError as exc:
        return None, untested + [_load_error(spec, exc)]
    if info is None:  # not known yet (the language server builds it aside, then checks again)
        return None, untested
    inferred = with_inferred_layout(spec, info)
    found = list(check_model(inferred, info))
    if not dg.has_errors(found):  # what the boundaries carry, at the spec's length (E0420)
        from .own_cut_proof import check_carried_shapes

        found += check_carried_shapes(inferred, info)
    if not dg.has_errors(found):
        from .own_tp_proof import check_local_shapes  # the own forward's split, at local shapes (E0426)

        found += check_local_shapes(inferred, info)
    return info, untested + found


def _load_error(spec: Spec, exc: Exception) -> Diagnostic:
    """E0401 (or the error's own code, E0434) at the config key at fault where the spec writes
    it (a nested block's key: `model.config.text_config.num_layers`), else at the source."""
    key = ".".join(getattr(exc, "key", ()))
    at = spec.spans.get(f"model.config.{key}") if key else None
    code = getattr(exc, "code", "E0401")
    hint = ("write `key = value` for a value; a block `key { ... }` sets a sub-config's keys" if code == "E0434"
            else "fix the source or config, or pass --no-model to check the spec alone")
    return error(code, at or spec.span("model.source"), f"cannot build the model: {exc}", hint=hint)


def _untested_versions(spec: Spec) -> list[Diagnostic]:
    """W0430 for torch (and transformers, for its models) installed outside the declared range."""
    from ppdsl.core.versions import describe_range, untested

    dists = ("torch",) if spec.model.source.kind == "python" else ("torch", "transformers")
    out = []
    for dist in dists:
        found = untested(dist)
        if found is not None:
            out.append(dg.warning("W0430", spec.span("model.source"),
                                  f"{dist} {found[0]} is installed, but ppdsl is tested with "
                                  f"{dist}{describe_range(found[1])}",
                                  hint=f"pip install \"{dist}{found[1]}\" (check may accept a model that then "
                                       "trains differently, or fails, under an untested version)"))
    return out


def _schedule_level(spec: Spec, world: int | None) -> list[Diagnostic]:
    """Generate and simulate the schedule when its sizes are known: deadlocks are check errors."""
    sizes = []
    for v in (spec.mesh.pp, spec.pipeline.microbatches, spec.pipeline.chunks):
        if world is not None:
            v = v.subs(WORLD, world) if isinstance(v, Expr) else v
        if not (isinstance(v, Expr) and v.is_Integer):
            return []
        sizes.append(int(v))
    pp, m, chunks = sizes
    if pp * m * chunks > MAX_SIMULATED:  # a schedule this size would take long to simulate: run it instead
        return []
    from ppdsl.core.schedules import generate
    from ppdsl.core.schedules.simulate import validate

    span = spec.span("pipeline.style") or spec.span("pipeline")
    try:
        schedule = generate(spec.pipeline.style, pp, m, chunks)
    except ValueError as exc:
        return [error("E0312", span, f"cannot build the {spec.pipeline.style} schedule: {exc}")]
    problems = validate(schedule)
    if problems:
        return [error("E0312", span, f"schedule {spec.pipeline.style} (pp={pp}, microbatches={m}, chunks={chunks}): {p.message}",
                      hint="this is a bug in ppdsl's schedule generator; please report it") for p in problems[:5]]
    if m < pp:
        return [_few_microbatches(spec, schedule, pp, m)]
    return []


def _few_microbatches(spec: Spec, schedule: object, pp: int, m: int) -> Diagnostic:
    """W0304: fewer microbatches than pipeline ranks runs correctly, but mostly idle."""
    from ppdsl.core.schedules.simulate import simulate

    bubble = simulate(schedule).bubble
    where = spec.spans.get("pipeline.microbatches") or spec.spans.get("pipeline.microbatch_size") or \
        spec.span("pipeline.style") or spec.span("pipeline")
    return dg.warning("W0304", where, f"{m} microbatch{'es' if m != 1 else ''} for pp = {pp} pipeline ranks: "
                      f"{spec.pipeline.style} runs, but the ranks are idle {bubble:.0%} of the step (bubble {bubble:.3f})",
                      hint=f"microbatches >= pp = {pp} keeps every rank busy in the steady state")
