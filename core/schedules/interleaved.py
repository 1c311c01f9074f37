"""Interleaved 1F1B with virtual stages (Megatron-LM, Narayanan et al. 2021).

Loop placement: virtual stage s runs on rank s % pp, so each rank holds `chunks` model chunks.
Forward step i of a rank runs chunk (i mod (pp*chunks)) div pp for microbatch
(i div (pp*chunks)) * pp + i mod pp; backward step i the same with the chunk order reversed.
Rank r warms up with min(2(pp-r-1) + (chunks-1)pp, m*chunks) forwards. (Megatron runs all
forwards first when m == pp; the formula gives the same bubble there.)
"""

from __future__ import annotations

from ._common import assemble, basic_problem, bwd, chunks_problem, fwd, loop_placement, raise_if
from .ir import Action, Schedule

STYLE = "interleaved"


def problem(pp: int, microbatches: int, chunks: int) -> str | None:
    basic = basic_problem(pp, microbatches, chunks) or chunks_problem(STYLE, chunks)
    if basic is None and microbatches % pp != 0:
        return f"needs microbatches to be a multiple of pp, got microbatches={microbatches}, pp={pp}"
    return basic


def _step(pp: int, chunks: int, i: int, backward: bool) -> tuple[int, int]:
    """(microbatch, chunk) of a rank's i-th forward (or backward) step."""
    group = pp * chunks
    chunk = (i % group) // pp
    if backward:
        chunk = chunks - 1 - chunk
    return (i // group) * pp + i % pp, chunk


def _rank_actions(pp: int, microbatches: int, chunks: int, rank: int) -> list[Action]:
    total = microbatches * chunks
    warmup = min(2 * (pp - rank - 1) + (chunks - 1) * pp, total)

    def forward(i: int) -> Action:
        mb, chunk = _step(pp, chunks, i, backward=False)
        return fwd(mb, chunk * pp + rank)

    def backward(i: int) -> Action:
        mb, chunk = _step(pp, chunks, i, backward=True)
        return bwd(mb, chunk * pp + rank)

    actions = [forward(i) for i in range(warmup)]
    for k in range(total - warmup):
        actions += [forward(warmup + k), backward(k)]
    actions += [backward(i) for i in range(total - warmup, total)]
    return actions


def interleaved(pp: int, microbatches: int, chunks: int = 2) -> Schedule:
    raise_if(STYLE, problem(pp, microbatches, chunks))
    ranks = [_rank_actions(pp, microbatches, chunks, r) for r in range(pp)]
    return assemble(STYLE, pp, microbatches, chunks, False, loop_placement(pp, chunks), ranks)
