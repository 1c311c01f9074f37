"""Shared pieces of the schedule generators: stage placements and argument checks."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType

import attrs

from .ir import Action, Op, Schedule


@attrs.frozen
class ChunkRule:
    """How many model chunks per rank a style runs: `least` to `most` (None: no upper bound)."""

    least: int
    most: int | None
    why: str = ""  # said after the rule where a generator refuses other counts

    def holds(self, chunks: int) -> bool:
        return self.least <= chunks and (self.most is None or chunks <= self.most)

    @property
    def text(self) -> str:
        """"== 1", ">= 2": the rule in words (StyleInfo.chunks, docs/schedules.md)."""
        return f"== {self.least}" if self.least == self.most else f">= {self.least}"


# The chunk rule of every style, stated once: the generators, StyleInfo and check's rules
# (E0303, E0305, E0307 in dsl/rules.py) read it from here.
CHUNKS: Mapping[str, ChunkRule] = MappingProxyType({
    "gpipe": ChunkRule(1, 1),
    "1f1b": ChunkRule(1, 1),
    "interleaved": ChunkRule(2, None),
    "looped_bfs": ChunkRule(2, None),
    "zbh1": ChunkRule(1, 1),
    "zbv": ChunkRule(2, 2, " (V placement)"),
    "interleaved_zb": ChunkRule(2, None),
    "dualpipev": ChunkRule(2, 2, " (V placement)"),
})


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


def chunks_problem(style: str, chunks: int) -> str | None:
    rule = CHUNKS[style]
    return None if rule.holds(chunks) else f"needs chunks {rule.text}{rule.why}, got chunks={chunks}"


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
