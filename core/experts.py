"""Which modules hold a mixture-of-experts layer's experts, found by their structure: the one
place that knows what transformers' expert modules look like (5.x: MixtralExperts, Qwen2MoeExperts,
Qwen3MoeExperts, OlmoeExperts, ... all `@use_experts_implementation`).

An experts module holds every expert of one layer stacked along dim 0 of each of its own
parameters (`gate_up_proj` (E, 2I, H), `down_proj` (E, H, I), biases (E, ...)), says E in
`num_experts`, and is called `forward(hidden_states, top_k_index, top_k_weights)` by its layer
after the router picked each token's experts. Expert parallelism (runtime/parallel/expert.py)
keeps rows [lo, hi) of dim 0 on each ep rank and runs the module's own forward on them.

torch is never imported here: the module is inspected through its attributes only.
"""

from __future__ import annotations

import inspect
from typing import Any

ROUTED_ARGS = ("top_k_index", "top_k_weights")


def expert_count(module: Any) -> int | None:
    """E, when `module` is the experts module of a MoE layer (see above); else None."""
    n = getattr(module, "num_experts", None)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        return None
    params = [p for p in getattr(module, "_parameters", {}).values() if p is not None]
    if not params or any(p.dim() < 2 or p.shape[0] != n for p in params):
        return None
    try:
        names = inspect.signature(type(module).forward).parameters
    except (TypeError, ValueError):
        return None
    return n if all(a in names for a in ROUTED_ARGS) else None
