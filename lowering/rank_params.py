"""How many parameters one rank holds: its stages' modules, at their tensor-parallel local shapes.

What `ppdsl plan` counts for each rank's weights, gradients and optimizer state
(`lowering.memory.state_bytes`): the parameters under the blocks and `first` / `last` / shared
modules of the rank's stages, with

- a tied parameter held once per rank: on a rank holding only its second module (GPT-2's
  `lm_head` on the last stage, tied to `wte` on the first) the copy the runtime keeps there;
- each split layer at its local shape: `column` and `vocab` keep 1/tp of the rows (padding
  included), `row` 1/tp of the weight and the whole bias, a column with replicated key/value heads
  (`TpReplacement.kv_parts`) and `replicate` the whole layer; everything without a rule whole
  (norms, position embeddings, biases of row layers).

Experts are counted whole here; the caller divides them over ep.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from ppdsl.core.module_paths import above, under_any
from ppdsl.lowering.plan import Plan, StageAssignment, TpReplacement

if TYPE_CHECKING:
    from ppdsl.dsl.introspect import ModelInfo


def held_paths(plan: Plan, stages: Sequence[StageAssignment], info: ModelInfo | None) -> tuple[str, ...]:
    """The module paths a rank's stages hold, each once."""
    paths = [f"{plan.blocks}.{i}" for s in stages for i in range(s.block_start, s.block_stop)]
    paths += [x for s in stages for x in (*s.first, *s.last, *s.shared) if x in info.modules]
    if any(s.stage == 0 for s in stages):  # the own parameters of the modules the stages split
        paths += [p for p in above(plan.blocks) if getattr(info.modules.get(p), "num_params", 0)]
    return tuple(dict.fromkeys(paths))


def rank_params(plan: Plan, stages: Sequence[StageAssignment], info: ModelInfo | None) -> int:
    """Parameters the rank holds (see the module doc)."""
    held = held_paths(plan, stages, info)
    return round(params_of(plan, info, held, held))


def params_of(plan: Plan, info: ModelInfo | None, paths: Iterable[str], held: Sequence[str]) -> float:
    """Parameters under the modules `paths` of a rank holding `held`, at their tp-local shapes;
    a tied parameter's copy counts where its owner's module is not held."""
    return float(sum(_local_params(plan, info, paths, held).values()))


def largest_param(plan: Plan, stages: Sequence[StageAssignment], info: ModelInfo | None) -> float:
    """The rank's largest parameter (values, tp-local; an experts module's 1/ep share): a
    module's own parameters less a linear's bias (what the optimizer step's and a gradient
    accumulation's temporaries are the size of)."""
    held = held_paths(plan, stages, info)
    experts = tuple(e.path for e in plan.experts)
    best = 0.0
    for path, n in _local_params(plan, info, held, held).items():
        m = info.modules[path]
        if m.has_bias and m.out_features and m.kind in ("linear", "conv1d") and n > m.out_features:
            n -= m.out_features  # (a column split's bias is 1/tp of it: a few values off)
        if under_any(path, experts):
            n /= plan.mesh.ep
        best = max(best, n)
    return best


def _local_params(plan: Plan, info: ModelInfo | None, paths: Iterable[str], held: Sequence[str]) -> dict[str, float]:
    """`params_of`'s count by module."""
    paths = tuple(paths)
    split = set(above(plan.blocks))  # a module the stages split: its own parameters only, not its subtree's
    whole = tuple(p for p in paths if p not in split)
    own = {p: m.num_params for p, m in info.modules.items() if p in paths or under_any(p, whole)}
    copied: set[str] = set()  # one copy per rank however many of its modules share the tensor
    for owner, other in info.tied:  # a copy on a rank that holds the second name's module only
        module, owner_module = other.rpartition(".")[0], owner.rpartition(".")[0]
        if module in own and not under_any(owner_module, held) and owner not in copied:
            own[module] += _numel(info.modules.get(owner_module), owner)
            copied.add(owner)
    tp = plan.mesh.tp if plan.tp else 1
    experts = tuple(e.path for e in plan.experts)  # counted whole by the caller (replicated over tp)
    if tp > 1:
        for r in plan.tp:
            if r.path in own and not under_any(r.path, experts):
                own[r.path] = local_params(r, info.modules[r.path], own[r.path], tp)
    return {p: float(n) for p, n in own.items()}


def local_params(r: TpReplacement, module: Any, numel: float, tp: int) -> float:
    """One tp rank's share of a layer of `numel` parameters split by `r`."""
    if r.style in ("column", "vocab") and not r.kv_parts:
        rows = module.num_embeddings if r.style == "vocab" else module.out_features
        if not rows:
            return numel / tp
        padded = math.ceil(rows / r.pad_to) * r.pad_to if r.pad_to else math.ceil(rows / tp) * tp
        return numel * (padded // tp) / rows
    if r.style == "row":
        bias = module.out_features if module.has_bias and module.out_features else 0
        return (numel - bias) / tp + bias
    return numel  # replicate, or a column whose key / value heads are replicated: whole on every rank


def _numel(module: Any, param: str) -> int:
    """A tied parameter's size: a linear / conv1d / embedding weight's from its owner module's
    shape, else the owner module's own parameters (exact when the tied one is all it owns)."""
    if module is None:
        return 0
    if param.endswith(".weight") and module.num_embeddings and module.embedding_dim:
        return module.num_embeddings * module.embedding_dim
    if param.endswith(".weight") and module.in_features and module.out_features:
        return module.in_features * module.out_features
    return module.num_params
