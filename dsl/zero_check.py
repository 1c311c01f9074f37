"""W0317: a ZeRO stage with nothing to shard: a single data-parallel rank, or (zero = 1) an
optimizer without state."""

from __future__ import annotations

from ppdsl.dsl import diagnostics as dg
from ppdsl.dsl import exact
from ppdsl.dsl.diagnostics import Diagnostic
from ppdsl.dsl.exact import as_expr
from ppdsl.dsl.schema import optimizer_slots
from ppdsl.dsl.spec import Spec
from ppdsl.dsl.world import compile_condition, describe

SHARDED = {1: "the optimizer state", 3: "the weights, gradients and optimizer state"}


def check_zero(spec: Spec, world: int | None, valid_worlds: tuple[int, ...] | None) -> list[Diagnostic]:
    """With `world` given: warn when dp = 1 there. With the world left free: warn for the world
    sizes, among those the spec holds for (`valid_worlds`), where dp = 1."""
    zero = spec.train.zero
    if zero not in SHARDED:
        return []
    opt = spec.train.optimizer
    if zero == 1 and optimizer_slots(opt.name, opt.momentum) == 0:
        return [dg.warning("W0317", spec.span("train.zero"),
                           "zero = 1 shards the optimizer state, but sgd without momentum keeps none: there is "
                           "nothing to shard",
                           label="sgd without momentum", hint="set zero = 0 (the same traffic and peak memory), or zero = 3 "
                           "to shard the weights and gradients")]
    single = compile_condition(exact.relation("eq", as_expr(spec.mesh.dp), as_expr(1), evaluate=False))
    worlds = (world,) if world is not None else valid_worlds or ()
    ones = [w for w in worlds if _holds(single, w)]
    if not ones:
        return []
    where = "" if world is not None or len(ones) == len(worlds) else f" for {describe(ones)}"
    return [dg.warning("W0317", spec.span("train.zero"),
                       f"zero = {zero} shards {SHARDED[zero]} over the data-parallel ranks, but dp = 1{where}: "
                       "there is nothing to shard",
                       label="dp = 1" + where,
                       hint="every rank keeps whole weights, gradients and optimizer state, as with zero = 0; "
                            "set zero = 0, or give the mesh dp > 1 (a larger world, or smaller tp * pp)")]


def _holds(fn, w: int) -> bool:
    try:
        return fn(w)
    except (ArithmeticError, ValueError, TypeError):
        return False
