"""W0317: a ZeRO stage with nothing to shard: a single data-parallel rank, or (zero = 1) an
optimizer without state. W0318: reshard_after_forward = true where no weights are sharded
(zero is not 3); with zero = 3 and dp = 1, W0317 says there is nothing gathered either."""

from __future__ import annotations

import attrs

from . import diagnostics as dg
from . import exact
from .diagnostics import Diagnostic
from .exact import as_expr
from .schema import optimizer_slots
from .spec import Spec
from .world import compile_condition, describe

SHARDED = {1: "the optimizer state", 3: "the weights, gradients and optimizer state"}


def check_zero(spec: Spec, world: int | None, valid_worlds: tuple[int, ...] | None) -> list[Diagnostic]:
    """With `world` given: warn when dp = 1 there. With the world left free: warn for the world
    sizes, among those the spec holds for (`valid_worlds`), where dp = 1."""
    zero = spec.train.zero
    if spec.train.reshard_after_forward and zero != 3:
        return [dg.warning("W0318", spec.span("train.reshard_after_forward"),
                           f"reshard_after_forward = true frees the weights zero = 3 all-gathers, but zero = {zero} "
                           "keeps every weight whole on every rank: it has no effect",
                           label=f"zero = {zero}",
                           hint="set zero = 3 to shard the weights over dp (and free the gathered ones after each "
                                "block's forward and backward), or remove reshard_after_forward"),
                *check_zero(attrs.evolve(spec, train=attrs.evolve(spec.train, reshard_after_forward=False)),
                            world, valid_worlds)]
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
