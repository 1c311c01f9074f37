"""The schedule IR: per pipeline rank, an ordered list of compute actions.

Communication is not part of the IR: it follows from the stage -> rank placement. After
``F(mb, s)`` the activation goes to the rank of stage ``s + 1``; after ``B(mb, s)`` the input
gradient goes to the rank of stage ``s - 1``. Stages on the same rank hand tensors over locally.
"""

from __future__ import annotations

import enum

import attrs


class Op(str, enum.Enum):
    F = "F"  # forward of one microbatch through one virtual stage
    B = "B"  # backward; input gradient only when the schedule splits backward (then W follows)
    W = "W"  # weight gradient of a split backward

    def __str__(self) -> str:
        return self.value


@attrs.frozen
class Action:
    op: Op
    microbatch: int
    stage: int  # virtual stage in model order: 0 holds the first blocks

    def __str__(self) -> str:
        return f"{self.op.value}{self.microbatch}s{self.stage}"


@attrs.frozen
class Schedule:
    style: str
    pp: int
    microbatches: int
    chunks: int
    split_backward: bool  # True when B is input-grad only and W actions exist
    stage_ranks: tuple[int, ...]  # virtual stage -> pipeline rank; len == pp * chunks
    ranks: tuple[tuple[Action, ...], ...]  # pipeline rank -> ordered actions

    @property
    def num_stages(self) -> int:
        return len(self.stage_ranks)

    def stages_of(self, rank: int) -> tuple[int, ...]:
        return tuple(s for s, r in enumerate(self.stage_ranks) if r == rank)
