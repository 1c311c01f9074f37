"""Which replicated parameters get partial gradients under tensor parallelism of the own forward.

A module beside a split column layer, inside the same parent (an attention module, an MLP), may
work on this rank's share of the column's output: Qwen3's per-head q / k RMSNorms read the split
q / k. Its parameters are replicated, but each rank's gradient covers only its heads, so the
trainer sums them over tp (as sequence-parallel ones). A module that reads whole activations
(BART's and OPT's layer norms, which sit in the decoder layer beside ``fc1``, fed the residual
stream that a row layer made whole) has whole gradients on every rank and must not be summed.

Check's dataflow (`ppdsl.dsl.tp_dataflow`) records the producers of every layer and whole-width
norm: one is partial when a split column feeds it (an unsplit q_proj beside a split fc1 is not).
A module it does not record (per-head norms, other modules) is partial, as before the dataflow
was read; so is every module when no dataflow is known.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ppdsl.core.module_paths import under

from .plan import TpReplacement

if TYPE_CHECKING:
    from ppdsl.dsl.introspect import ModelInfo

__all__ = ["tp_partial"]


def tp_partial(policy: Sequence[TpReplacement], info: ModelInfo | None) -> tuple[str, ...]:
    """The modules with parameters of their own that see a split column's share (see above)."""
    if info is None:
        return ()
    columns = {r.path for r in policy if r.style == "column" and not r.gather_output}
    split = {r.path for r in policy if r.style != "replicate"}  # replaced by a split layer
    flow = getattr(info, "dataflow", None)
    out: list[str] = []
    for parent in sorted({c.rpartition(".")[0] for c in columns} - {""}):
        for path, module in info.modules.items():
            if not (path == parent or under(path, parent)) or module.num_params == 0 or any(path == s or under(path, s) for s in split):
                continue
            if flow is not None and path in flow.producers and not flow.producers.get(path, frozenset()) & columns:
                continue  # a layer or norm no split column feeds: whole activations, whole gradients
            out.append(path)
    return tuple(out)
