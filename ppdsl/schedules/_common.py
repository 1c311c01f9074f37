"""Shared pieces of the schedule generators: stage placements and argument checks."""

from __future__ import annotations

from collections.abc import Sequence

from .ir import Action, Op, Schedule


def loop_placement(pp: int, chunks: int) -> tuple[int, ...]:
    """Virtual stage s on rank s % pp (GPipe, 1F1B, interleaved, looped BFS)."""
    return tuple(s % pp for s in range(pp * chunks))


def v_placement(pp: int) -> tuple[int, ...]:
    """Two chunks in a V: rank r holds stages r and 2*pp - 1 - r, so stage 2*pp - 1 is on rank 0."""
    return tuple(range(pp)) + tuple(reversed(range(pp)))


def basic_problem(pp: int, microbatches: int, chunks: int) -> str | None:
    """Why (pp, microbatches, chunks) cannot describe any schedule, or None."""
    for name, value in (("pp", pp), ("microbatches", microbatches), ("chunks", chunks)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            return f"{name} must be a positive integer, got {value!r}"
    return None


def chunks_problem(chunks: int, allowed: str, ok: bool) -> str | None:
    return None if ok else f"needs chunks {allowed}, got chunks={chunks}"


def raise_if(style: str, problem: str | None) -> None:
    if problem is not None:
        raise ValueError(f"schedule {style!r}: {problem}")


def assemble(
    style: str,
    pp: int,
    microbatches: int,
    chunks: int,
    split_backward: bool,
    stage_ranks: tuple[int, ...],
    ranks: Sequence[Sequence[Action]],
) -> Schedule:
    assert len(ranks) == pp and len(stage_ranks) == pp * chunks
    return Schedule(
        style=style,
        pp=pp,
        microbatches=microbatches,
        chunks=chunks,
        split_backward=split_backward,
        stage_ranks=stage_ranks,
        ranks=tuple(tuple(actions) for actions in ranks),
    )


def fwd(microbatch: int, stage: int) -> Action:
    return Action(Op.F, microbatch, stage)


def bwd(microbatch: int, stage: int) -> Action:
    return Action(Op.B, microbatch, stage)


def wgt(microbatch: int, stage: int) -> Action:
    return Action(Op.W, microbatch, stage)
