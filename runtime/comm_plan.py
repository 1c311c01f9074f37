"""The communication plan of one pipeline rank (pure Python, computed once before training).

Communication is implied by the stage -> rank placement (see ``ppdsl.core.schedules.ir``):
``comm_plan`` turns one rank's action list into ``Step``s, each with the messages it posts
(receives it needs, sends it produced); `runtime.executor` walks them every training step.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from ppdsl.core.schedules.ir import Action, Op, Schedule

MessageKind = Literal["act", "grad"]


# ---------------------------------------------------------------------------------------------
# The communication plan (pure Python)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Message:
    kind: MessageKind  # "act": output of stage - 1 for `stage`; "grad": input gradient of stage + 1
    microbatch: int
    stage: int  # the virtual stage that consumes it
    src: int  # pipeline ranks
    dst: int


@dataclass(frozen=True)
class Step:
    action: Action
    post: tuple[Message, ...]  # receives to post before this action, in per-peer send order
    needs: Message | None  # the received message this action consumes
    send: Message | None  # the message this action produces for another rank


def produced(action: Action, stage_ranks: Sequence[int]) -> Message | None:
    """The message `action` sends to another pipeline rank, if any."""
    s, mb, here = action.stage, action.microbatch, stage_ranks[action.stage]
    if action.op is Op.F and s + 1 < len(stage_ranks) and stage_ranks[s + 1] != here:
        return Message("act", mb, s + 1, here, stage_ranks[s + 1])
    if action.op is Op.B and s > 0 and stage_ranks[s - 1] != here:
        return Message("grad", mb, s - 1, here, stage_ranks[s - 1])
    return None


def consumed(action: Action, stage_ranks: Sequence[int]) -> Message | None:
    """The message `action` receives from another pipeline rank, if any."""
    s, mb, here = action.stage, action.microbatch, stage_ranks[action.stage]
    if action.op is Op.F and s > 0 and stage_ranks[s - 1] != here:
        return Message("act", mb, s, stage_ranks[s - 1], here)
    if action.op is Op.B and s + 1 < len(stage_ranks) and stage_ranks[s + 1] != here:
        return Message("grad", mb, s, stage_ranks[s + 1], here)
    return None


def rank_actions(schedule: Schedule, rank: int, forward_only: bool) -> tuple[Action, ...]:
    actions = schedule.ranks[rank]
    return tuple(a for a in actions if a.op is Op.F) if forward_only else actions


def comm_plan(
    schedule: Schedule, rank: int, *, forward_only: bool = False, lookahead: int = 1
) -> tuple[Step, ...]:
    """Rank `rank`'s actions with the receives to post before each and the send after each.

    `lookahead`: receives are posted for the next `lookahead` actions (1 = just in time).
    Raises ValueError when a rank needs a message that no rank sends.
    """
    assert lookahead >= 1
    stage_ranks = schedule.stage_ranks
    sent_to_me: dict[int, collections.deque[Message]] = collections.defaultdict(collections.deque)
    for src in range(schedule.pp):
        for a in rank_actions(schedule, src, forward_only):
            msg = produced(a, stage_ranks)
            if msg is not None and msg.dst == rank:
                sent_to_me[src].append(msg)
    actions = rank_actions(schedule, rank, forward_only)
    posted: set[Message] = set()
    steps = []
    for i, action in enumerate(actions):
        post: list[Message] = []
        for ahead in actions[i : i + lookahead]:
            msg = consumed(ahead, stage_ranks)
            if msg is None or msg in posted:
                continue
            queue = sent_to_me[msg.src]
            if msg not in queue:
                raise ValueError(f"rank {rank}: {ahead} needs {msg}, which rank {msg.src} never sends")
            while True:  # post everything the peer sends before msg, to keep per-pair order
                head = queue.popleft()
                post.append(head)
                posted.add(head)
                if head == msg:
                    break
        steps.append(Step(action, tuple(post), consumed(action, stage_ranks), produced(action, stage_ranks)))
    leftover = [m for q in sent_to_me.values() for m in q]
    if leftover:
        raise ValueError(f"rank {rank} never receives {leftover[0]} (and {len(leftover) - 1} more)")
    return tuple(steps)


