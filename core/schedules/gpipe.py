"""GPipe: every rank runs all its forwards, then all its backwards (Huang et al. 2019)."""

from __future__ import annotations

from ._common import assemble, basic_problem, bwd, chunks_problem, fwd, loop_placement, raise_if
from .ir import Schedule

STYLE = "gpipe"


def problem(pp: int, microbatches: int, chunks: int) -> str | None:
    return basic_problem(pp, microbatches, chunks) or chunks_problem(STYLE, chunks)


def gpipe(pp: int, microbatches: int, chunks: int = 1) -> Schedule:
    raise_if(STYLE, problem(pp, microbatches, chunks))
    mbs = range(microbatches)
    ranks = [[fwd(mb, r) for mb in mbs] + [bwd(mb, r) for mb in mbs] for r in range(pp)]
    return assemble(STYLE, pp, microbatches, 1, False, loop_placement(pp, 1), ranks)
