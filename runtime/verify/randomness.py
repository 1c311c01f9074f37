"""Dropout switched off for a verification: a parallel run cannot reproduce the reference's
dropout masks (each stage and tensor-parallel rank draws its own), so ``ppdsl verify`` compares
the plan with every dropout-like probability of the model's config set to 0 (unless kept).
"""

from __future__ import annotations

import re
from typing import Any

import attrs

from ppdsl.core.config_tree import deep_merge, frozen, leaves
from ppdsl.lowering.plan import Plan

# config keys that are probabilities of randomness a parallel run cannot reproduce: each stage
# and tp rank draws its own dropout masks (and stochastic depth's, `drop_path_rate` of BEiT and
# Data2Vec-Vision), so the two runs' numbers differ by more than rounding
_RANDOM_KEY = re.compile(r"dropout|pdrop|layerdrop|drop_path", re.IGNORECASE)


def random_config(plan: Plan, config: dict[str, Any]) -> dict[str, float]:
    """The dropout probabilities in effect: every float key of the model's full config (`config`:
    the HF config, or a python factory's keyword defaults) named like a dropout, overridden by
    the spec's values, that is above 0; a composite model's sub-configs' too (Blip2's
    ``qformer_config``), named by their dotted path (``qformer_config.hidden_dropout_prob``)."""
    full = deep_merge(config, plan.model.config_dict)
    return {".".join(path): v for path, v in leaves(full)
            if _RANDOM_KEY.search(path[-1]) and isinstance(v, float) and v > 0}


def without_randomness(plan: Plan, config: dict[str, Any], keep: bool = False) -> tuple[Plan, tuple[str, ...]]:
    """The plan to verify, with dropout switched off in both runs (unless `keep`), and the one
    line that says so."""
    found = random_config(plan, config)
    if not found:
        return plan, ()
    names = ", ".join(sorted(found))
    if keep:
        return plan, (f"dropout kept ({names}): each run draws its own dropout masks (the parallel run per "
                      "stage and tensor-parallel rank), so the numbers differ by more than rounding; leave out "
                      "--keep-dropout to compare the computation itself",)
    off: dict[str, Any] = {}
    for name in found:
        *blocks, key = name.split(".")
        where = off
        for block in blocks:
            where = where.setdefault(block, {})
        where[key] = 0.0
    config_items = deep_merge(plan.model.config_dict, off)
    model = attrs.evolve(plan.model, config=tuple(sorted((k, frozen(v)) for k, v in config_items.items())))
    return attrs.evolve(plan, model=model), (f"dropout off for the comparison: {names}",)
