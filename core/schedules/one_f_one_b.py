"""1F1B (PipeDream-Flush): warm-up forwards, then one forward one backward, then drain.

Rank r warms up with min(pp - r - 1, m) forwards, so m < pp is valid too (the pipeline never
fills); the checker may still insist on m >= pp as the references do.
"""

from __future__ import annotations

from ._common import assemble, basic_problem, bwd, chunks_problem, fwd, loop_placement, raise_if
from .ir import Action, Schedule

STYLE = "1f1b"


def problem(pp: int, microbatches: int, chunks: int) -> str | None:
    return basic_problem(pp, microbatches, chunks) or chunks_problem(STYLE, chunks)


def _rank_actions(pp: int, microbatches: int, rank: int) -> list[Action]:
    warmup = min(pp - rank - 1, microbatches)
    actions = [fwd(mb, rank) for mb in range(warmup)]
    for i in range(microbatches - warmup):
        actions += [fwd(warmup + i, rank), bwd(i, rank)]
    actions += [bwd(mb, rank) for mb in range(microbatches - warmup, microbatches)]
    return actions


def one_f_one_b(pp: int, microbatches: int, chunks: int = 1) -> Schedule:
    raise_if(STYLE, problem(pp, microbatches, chunks))
    ranks = [_rank_actions(pp, microbatches, r) for r in range(pp)]
    return assemble(STYLE, pp, microbatches, 1, False, loop_placement(pp, 1), ranks)
