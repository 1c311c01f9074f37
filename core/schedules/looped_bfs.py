"""Looped BFS (Lamy-Poirier 2022): loop placement, breadth first over microbatches.

Each rank runs the forwards of its first chunk for every microbatch, then of its second
chunk, and so on; the backwards then go through the chunks in reverse order.
"""

from __future__ import annotations

from ._common import assemble, basic_problem, bwd, chunks_problem, fwd, loop_placement, raise_if
from .ir import Action, Schedule

STYLE = "looped_bfs"


def problem(pp: int, microbatches: int, chunks: int) -> str | None:
    return basic_problem(pp, microbatches, chunks) or chunks_problem(STYLE, chunks)


def _rank_actions(pp: int, microbatches: int, chunks: int, rank: int) -> list[Action]:
    stages = [c * pp + rank for c in range(chunks)]
    actions = [fwd(mb, s) for s in stages for mb in range(microbatches)]
    actions += [bwd(mb, s) for s in reversed(stages) for mb in range(microbatches)]
    return actions


def looped_bfs(pp: int, microbatches: int, chunks: int = 2) -> Schedule:
    raise_if(STYLE, problem(pp, microbatches, chunks))
    ranks = [_rank_actions(pp, microbatches, chunks, r) for r in range(pp)]
    return assemble(STYLE, pp, microbatches, chunks, False, loop_placement(pp, chunks), ranks)
