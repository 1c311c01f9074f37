"""Will it fit: check's proof that every rank's peak memory fits one accelerator.

After `ppdsl check` has found a spec valid and built its model (on the meta device), this
lowers it at each world size of its verdict (the `--world` given, or every size that works)
and takes each pipeline rank's peak from the one estimate `ppdsl plan` prints
(`lowering.rank_memory`: weights, gradients and optimizer state under the ZeRO stage, and
activations). The ranks of a pipeline coordinate hold the same, so one of each is evaluated.

- With a device memory stated (`train.device_memory`, or `ppdsl check --device-memory`, which
  wins): at `--world N` a rank over it is E0440. With the world left free, the sizes where a
  rank does not fit are left out of the verdict (N0440 says which, and the figure); when none
  is left, E0440. E0440's hint names the first of a few cheap changes (activation
  checkpointing, more microbatches, zero 1 / 3, more pp, more tp) under which the spec, checked
  again with that `--set`, passes and fits: the same check, the same estimate.
- Without one: W0440 where a rank needs more than any accelerator holds (288 GiB), at `--world N`,
  or, with the world free, at every size of the verdict; pointed at the config key whose
  modules hold most of the rank's parameters when one does, else at the model.
- Without the model (`--no-model`) nothing is counted: a stated device memory is N0441.

The estimate's activation term is low (issue 34, item 1) and does not credit activation
checkpointing, so the checkpointing candidate never fits until it does.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from ppdsl.core.module_paths import under_any
from ppdsl.dsl import diagnostics as dg
from ppdsl.dsl.check import CheckResult
from ppdsl.dsl.command_line import bad_input
from ppdsl.dsl.diagnostics import Diagnostic
from ppdsl.dsl.exact import Expr
from ppdsl.dsl.sizes import MIN_DEVICE_MEMORY, UNIT_NAMES, SizeError, format_size, parse_size, written_size
from ppdsl.dsl.spec import Spec
from ppdsl.dsl.world import describe
from .plan import Plan
from .rank_memory import RankMemory, hidden_size, rank_memory
from .rank_params import held_paths

if TYPE_CHECKING:
    from ppdsl.dsl.introspect import ModelInfo

# The most memory one accelerator holds today: 288 GiB of HBM3E on AMD's Instinct MI355X (and
# MI350X; NVIDIA's B300 has the same), shipping since 2025. HBM is sold in binary units written
# "GB" (8 stacks of 36 GiB). A rank above this fits no single device.
LARGEST_DEVICE = 288 * 2**30
LARGEST_DEVICE_NAME = "AMD Instinct MI355X"
SCALES = (2, 4, 8)  # the factors the hint tries for microbatches, pp and tp

Recheck = Callable[[Sequence[str]], CheckResult]  # the same check with these --set overrides added


@attrs.frozen
class WorldPeak:
    """The rank with the largest peak at one world size."""

    world: int
    rank: int
    pp: int
    memory: RankMemory
    plan: Plan

    @property
    def peak(self) -> int:
        assert self.memory.peak is not None
        return self.memory.peak


class Estimator:
    """The largest rank's peak per world size of one checked spec and its model."""

    def __init__(self, spec: Spec, info: ModelInfo | None):
        self.spec, self.info = spec, info
        self._counts: dict = {}  # rank_memory's parameter counts, by stages and tp
        self._peaks: dict = {}  # the schedule's in-flight peaks, by its shape
        self._worlds: dict[int, WorldPeak | None] = {}

    def at(self, world: int) -> WorldPeak | None:
        """None where nothing can be counted (no plan at that size, no parameters)."""
        if world not in self._worlds:
            self._worlds[world] = self._at(world)
        return self._worlds[world]

    def _at(self, world: int) -> WorldPeak | None:
        from ppdsl.core.schedules.simulate import simulate
        from ppdsl.dsl.plan_needs import plan_needs
        from .lower import lower

        if plan_needs(self.spec, self.info, runnable=False):  # E0429: no plan to count (plan and run say so)
            return None
        plan = lower(self.spec, world, self.info)
        m = plan.mesh
        key = None if self.spec.pipeline.profile is not None else \
            (plan.schedule.style, m.pp, plan.schedule.microbatches, len(plan.stages))
        peaks = self._peaks.get(key) if key is not None else None
        if peaks is None:
            peaks = simulate(plan.schedule).peak_activations
            if key is not None:
                self._peaks[key] = peaks
        h = hidden_size(plan, self.info, self.spec.model.dims.get("hidden"))
        best: WorldPeak | None = None
        for pp in range(m.pp):
            mem = rank_memory(plan, self.info, pp, peaks, h, self._counts)
            if mem.peak is None:
                return None
            if best is None or mem.peak > best.peak:
                best = WorldPeak(world, m.rank_of(0, pp, 0), pp, mem, plan)
        return best


def check_and_fit(path: str, world: int | None = None, overrides: Sequence[str] = (), model: bool = True,
                  allow_paths: Sequence[str] = (), launch: Any = None,
                  device_memory: str | None = None) -> CheckResult:
    """`ppdsl check` with the memory proof: `dsl.check.check_file`, then `prove_fit`.
    `device_memory`: `--device-memory` as typed (E0005 when it is not a size)."""
    from ppdsl.dsl.check import check_file

    result = check_file(path, world=world, overrides=overrides, model=model, allow_paths=allow_paths, launch=launch)
    size, problem = command_line_size(device_memory)
    if problem is not None:
        return attrs.evolve(result, diagnostics=(problem, *result.diagnostics), valid_worlds=None, worlds=None)

    def recheck(extra: Sequence[str]) -> CheckResult:
        return check_file(path, world=world, overrides=[*overrides, *extra], model=model, allow_paths=allow_paths)
    return prove_fit(result, size, recheck)


def check_text_and_fit(text: str, file: str = "<spec>", world: int | None = None, overrides: Sequence[str] = (),
                       model: bool = False, device_memory: str | None = None) -> CheckResult:
    """`check_and_fit` of a spec's text (`dsl.check.check_text`)."""
    from ppdsl.dsl.check import check_text

    result = check_text(text, file, world, overrides, model=model)
    size, problem = command_line_size(device_memory)
    if problem is not None:
        return attrs.evolve(result, diagnostics=(problem, *result.diagnostics), valid_worlds=None, worlds=None)
    return prove_fit(result, size, lambda extra: check_text(text, file, world, [*overrides, *extra], model=model))


def command_line_size(text: str | None) -> tuple[int | None, Diagnostic | None]:
    """`--device-memory` as bytes, or the E0005 that says why it is not a size."""
    if text is None:
        return None, None
    hint = f"a number with a unit ({UNIT_NAMES}), e.g. --device-memory 80GiB, or a number of bytes"
    try:
        size = parse_size(text)
    except SizeError as exc:
        return None, bad_input(f"--device-memory: {exc}", hint=hint)
    if size < MIN_DEVICE_MEMORY:
        return None, bad_input(f"--device-memory {text} is less than 1 MiB: is its unit missing?", hint=hint)
    return size, None


def prove_fit(result: CheckResult, device_memory: int | None = None, recheck: Recheck | None = None) -> CheckResult:
    """`result` with the memory proof's diagnostics, and its verdict narrowed to the world sizes
    where every rank fits. `device_memory`: bytes given on the command line (else the spec's);
    `recheck`: how the hint's candidates are checked (without it the hint names none)."""
    spec = result.spec
    if spec is None or not result.ok:
        return result
    stated = device_memory if device_memory is not None else spec.train.device_memory
    where = spec.span("train.device_memory") if device_memory is None else None
    where = where or spec.span("mesh") or spec.span("model")
    shown = _shown(stated)
    if result.model_info is None:
        if stated is None:
            return result
        return _with(result, [dg.note(
            "N0441", where, f"device_memory = {shown} is not proven: check counts each rank's memory on the model, "
                            "which it did not build",
            hint="check without --no-model (with torch installed) to prove that every rank fits")])
    est = Estimator(spec, result.model_info)
    worlds = [result.world] if result.world is not None else list(result.valid_worlds or ())
    if stated is None:
        return _with(result, _beyond_any_device(spec, est, worlds, result.world is None))
    peaks = {w: est.at(w) for w in worlds}
    over = [w for w in worlds if peaks[w] is not None and peaks[w].peak > stated]  # type: ignore[union-attr]
    if not over:
        return result
    if len(over) < len(worlds):  # some sizes fit: the verdict keeps those
        fitting = tuple(w for w in worlds if w not in over)
        closest = peaks[over[-1]]
        assert closest is not None
        sizes = f"world {over[0]}" if len(over) == 1 else f"world sizes {_listed(over)}"
        found = dg.note("N0440", where, f"the verdict leaves out {sizes}, where a rank needs more than device_memory "
                                        f"= {shown}: at world {closest.world}, {_needs(closest)}",
                        hint=f"the sizes where every rank fits: {describe(fitting)}")
        return attrs.evolve(_with(result, [found]), valid_worlds=fitting, worlds=describe(fitting))
    best = min((p for p in peaks.values() if p is not None), key=lambda p: (p.peak, p.world))
    if result.world is not None:
        message = f"{_needs(best)} at world {best.world}, more than device_memory = {shown}"
    else:
        message = (f"no world size of the verdict ({describe(worlds)}) fits device_memory = {shown}: at world "
                   f"{best.world}, the one that needs least, {_needs(best)}")
    refusal = dg.error("E0440", where, message, label=f"rank {best.rank}: {format_size(best.peak)} of {shown}",
                       hint=_hint(spec, stated, recheck))
    return attrs.evolve(_with(result, [refusal]), valid_worlds=None if result.world is None else result.valid_worlds,
                        worlds=None if result.world is None else result.worlds)


def _listed(worlds: list[int], most: int = 8) -> str:
    return ", ".join(map(str, worlds[:most])) + (f", ... ({len(worlds)} sizes)" if len(worlds) > most else "")


def _with(result: CheckResult, found: list[Diagnostic]) -> CheckResult:
    if not found:
        return result
    diags = sorted([*result.diagnostics, *found], key=dg.sort_key)  # a valid spec: no notes attached to an error
    return attrs.evolve(result, diagnostics=tuple(diags))


def _shown(stated: int | None) -> str:
    """The device memory as a spec writes it: `80GiB`, `141GB`."""
    return "" if stated is None else written_size(stated)


def _needs(p: WorldPeak) -> str:
    """`rank 0 needs 49152.1GiB (optimizer state 24576.1GiB, weights 12288.0GiB, gradients 12288.0GiB)`."""
    terms = [f"{name} {format_size(b)}" for name, b in p.memory.terms() if b > 0][:3]
    return f"rank {p.rank} needs {format_size(p.peak)} ({', '.join(terms)})"


# ---- W0440: more than any accelerator holds ------------------------------------------------------


def _beyond_any_device(spec: Spec, est: Estimator, worlds: list[int], free: bool) -> list[Diagnostic]:
    """W0440 where no world size of the verdict fits the largest accelerator (tried from the
    largest size down, which usually fits best, up to the first that fits)."""
    seen = []
    for w in sorted(worlds, reverse=True):
        p = est.at(w)
        if p is None:
            return []
        if p.peak <= LARGEST_DEVICE:
            return []
        seen.append(p)
    if not seen:
        return []
    best = min(seen, key=lambda p: (p.peak, p.world))
    key = _culprit(spec, est.info, best)
    where = spec.span(f"model.config.{key}") if key else None
    device = f"more than any accelerator holds ({written_size(LARGEST_DEVICE)}, the {LARGEST_DEVICE_NAME})"
    if free and len(worlds) > 1:
        message = f"at every world size of the verdict a rank needs {device}: at world {best.world}, {_needs(best)}"
    else:
        message = f"{_needs(best)} at world {best.world}, {device}"
    label = ""
    if key:
        label = f"{key} = {spec.model.config[key]}: most of rank {best.rank}'s {best.memory.params:,} parameters"
    return [dg.warning("W0440", where or spec.span("model"), message, label=label,
                       hint=(f"check {key}; " if key else "") + "more pp or tp, or zero = 3, divide the model state "
                            "over more devices; state train.device_memory to have check prove that every rank fits")]


def _culprit(spec: Spec, info: ModelInfo | None, p: WorldPeak) -> str | None:
    """The written config key whose modules hold most of the rank's parameters, when the model
    state is most of its peak: each module counts for the key equal to its largest dimension
    (or its 2 or 3 times, a fused projection's)."""
    if p.memory.state is None or p.memory.state.peak < p.memory.activations:
        return None
    keys = {k: v for k, v in spec.model.config.items() if f"model.config.{k}" in spec.spans
            and isinstance(v, int) and not isinstance(v, bool) and v > 1}
    held = held_paths(p.plan, p.plan.stages_of(p.pp), info)
    share: dict[str, int] = defaultdict(int)
    total = 0
    for path, module in info.modules.items():
        if not module.num_params or not under_any(path, held):
            continue
        total += module.num_params
        dims = [d for d in (module.in_features, module.out_features, module.num_embeddings, module.embedding_dim) if d]
        if not dims:
            continue
        d = max(dims)
        key = next((k for k, v in keys.items() if d % v == 0 and d // v <= 3), None)
        if key is not None:
            share[key] += module.num_params
    best = max(share, key=lambda k: share[k], default=None)
    return best if best is not None and 2 * share[best] > total else None


# ---- E0440's hint: a cheap change that fits ------------------------------------------------------


def _candidates(spec: Spec) -> list[tuple[str, list[str]]]:
    """(the change in words, its --set overrides), cheapest first."""
    out: list[tuple[str, list[str]]] = []
    t, p = spec.train, spec.pipeline
    if not t.activation_checkpointing:
        out.append(("activation_checkpointing = true", ["train.activation_checkpointing=true"]))
    size, count = _number(p.microbatch_size), _number(p.microbatches)
    if "pipeline.microbatch_size" in spec.spans and size is not None:
        out += [(f"microbatch_size = {size // k}", [f"pipeline.microbatch_size={size // k}"])
                for k in SCALES if size % k == 0]
    elif count is not None:
        out += [(f"microbatches = {count * k}", [f"pipeline.microbatches={count * k}"]) for k in SCALES]
    if t.zero == 0:
        out.append(("zero = 1", ["train.zero=1"]))
    if t.zero < 3:
        out.append(("zero = 3", ["train.zero=3"]))
    pp = _number(spec.mesh.pp)
    if pp is not None:
        for k in SCALES:
            sets = [f"mesh.pp={pp * k}"]
            if count is not None and count < pp * k and "pipeline.microbatch_size" not in spec.spans:
                sets.append(f"pipeline.microbatches={pp * k}")  # pp > 1 needs microbatches, pp of them to fill it
            out.append((f"pp = {pp * k}" + (f", microbatches = {pp * k}" if len(sets) > 1 else ""), sets))
    tp = _number(spec.mesh.tp)
    if tp is not None:
        out += [(f"tp = {tp * k}", [f"mesh.tp={tp * k}"]) for k in SCALES]
    return out


def _number(v: object) -> int | None:
    if isinstance(v, Expr) and v.is_Integer:
        return int(v)
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _hint(spec: Spec, stated: int, recheck: Recheck | None) -> str:
    """The first candidate under which the spec, checked again, passes and every rank fits."""
    if recheck is not None:
        closest: tuple[int, str, WorldPeak] | None = None
        for what, sets in _candidates(spec):
            result = recheck(sets)
            if not result.ok or result.spec is None or result.model_info is None:
                continue
            est = Estimator(result.spec, result.model_info)
            worlds = [result.world] if result.world is not None else list(result.valid_worlds or ())
            found = [p for p in map(est.at, worlds) if p is not None]
            fit = next((p for p in found if p.peak <= stated), None)
            if fit is not None:
                return (f"{what} fits: rank {fit.rank} then needs {format_size(fit.peak)} at world {fit.world} "
                        f"(--set {' --set '.join(sets)})")
            for p in found:
                if closest is None or p.peak < closest[0]:
                    closest = (p.peak, what, p)
        if closest is not None:
            _, what, p = closest
            return (f"no single change of activation checkpointing, microbatches, zero, pp or tp (x{SCALES[-1]} "
                    f"at most) fits; the closest, {what}, still needs {format_size(p.peak)} on rank {p.rank} at world "
                    f"{p.world}: a smaller model, or a device with more memory")
    return "more pp or tp, zero = 1 or 3, or more microbatches divide the memory further; or a device with more memory"
