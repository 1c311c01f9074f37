"""The message steps of a schedule: the pass that adds sends and receives to the action lists
(pure Python, like torch.distributed.pipelining's ``_add_send_recv``).

Communication follows from the stage -> rank placement (see ``ir``): after ``F(mb, s)`` the
activation goes to the rank of stage ``s + 1``, after ``B(mb, s)`` the input gradient to the rank
of stage ``s - 1``; stages on the same rank hand tensors over locally. The pass turns each rank's
action list into steps: the receives to post before the action (in the order the peer sends
them: between a pair of ranks messages match in order, NCCL ignores tags), the message the
action waits for, the message it sends. ``runtime.pipeline.executor`` walks ``message_steps`` every
training step; ``simulate`` runs the same pass, on ints (``step_codes``), to time the schedule
and to find where it would hang.

Codes. An action is the int ``(op * m + mb) * S + stage`` (op: F 0, B 1, W 2; m microbatches,
S virtual stages), as ``simulate`` numbers them; a message is the code of the action that sends
it (each F or B sends at most one).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import attrs

from .ir import Action, Op, Schedule

__all__ = ["Message", "MessageKind", "RankSteps", "Step", "action_codes", "message_steps", "step_codes"]

MessageKind = Literal["act", "grad"]
_OPS: tuple[Op, ...] = (Op.F, Op.B, Op.W)


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


@attrs.frozen
class RankSteps:
    """One rank's steps as codes (module docstring): step i runs action ``actions[i]`` after
    posting the receives ``posts[post_end[i - 1]:post_end[i]]``, waits for message ``needs[i]``
    and sends message ``sends[i]`` (-1: none)."""

    actions: tuple[int, ...]
    post_end: tuple[int, ...]
    posts: tuple[int, ...]
    needs: tuple[int, ...]
    sends: tuple[int, ...]

    def posted(self, i: int) -> tuple[int, ...]:
        return self.posts[self.post_end[i - 1] if i else 0 : self.post_end[i]]


def action_codes(schedule: Schedule, forward_only: bool = False) -> list[list[int]]:
    """Each rank's actions as codes (only its F with `forward_only`). ValueError for an action
    outside the schedule's microbatches and stages, or a W in a schedule without split backward."""
    m, stages = schedule.microbatches, schedule.num_stages
    num_ops = 3 if schedule.split_backward else 2
    out = []
    for rank, actions in enumerate(schedule.ranks):
        codes = []
        for a in actions:
            op = _OPS.index(a.op)
            if op >= num_ops or not (0 <= a.microbatch < m and 0 <= a.stage < stages):
                raise ValueError(f"rank {rank} lists {a}, which schedule {schedule.style!r} cannot run")
            if op == 0 or not forward_only:
                codes.append((op * m + a.microbatch) * stages + a.stage)
        out.append(codes)
    return out


def step_codes(schedule: Schedule, codes: Sequence[Sequence[int]], lookahead: int = 1) -> tuple[RankSteps, ...]:
    """The message steps of every rank, on the codes of ``action_codes``. `lookahead`: receives
    are posted for the next `lookahead` actions (1 = just in time). ValueError when a rank needs a
    message that no rank sends, or a message is sent that its rank never receives."""
    assert lookahead >= 1
    pp, ms, S = schedule.pp, schedule.microbatches * schedule.num_stages, schedule.num_stages
    stage_ranks = schedule.stage_ranks
    sends_to, receives = _wiring(schedule)  # by action code
    # sent[src * pp + dst]: the messages src sends to dst, in order; slot[msg]: msg's place there
    sent: list[list[int]] = [[] for _ in range(pp * pp)]
    slot = [-1] * (2 * ms)
    sends_of = []
    for src, rank_codes in enumerate(codes):
        dsts = list(map(sends_to.__getitem__, rank_codes))
        for k, dst in zip(rank_codes, dsts):
            if dst >= 0:
                queue = sent[src * pp + dst]
                if stage_ranks[k % S] == src:  # else no rank waits for it from here: never received
                    slot[k] = len(queue)
                queue.append(k)
        sends_of.append(tuple([k if dst >= 0 else -1 for k, dst in zip(rank_codes, dsts)]))
    steps = []
    for rank, rank_codes in enumerate(codes):
        # the message is the code of the action that sends it: F(mb, s - 1) = k - 1, B(mb, s + 1) = k + 1
        needs = tuple([k + d if d else -1 for k, d in zip(rank_codes, map(receives.__getitem__, rank_codes))])
        posts, post_end = _posts(schedule, rank, rank_codes, needs, sent[rank::pp], slot, lookahead)
        steps.append(RankSteps(tuple(rank_codes), post_end, posts, needs, sends_of[rank]))
    return tuple(steps)


def message_steps(
    schedule: Schedule, rank: int, *, forward_only: bool = False, lookahead: int = 1
) -> tuple[Step, ...]:
    """Rank `rank`'s actions with the receives to post before each, the message each waits for
    and the one it sends: what ``runtime.pipeline.executor`` walks. ValueError as ``step_codes``."""
    codes = action_codes(schedule, forward_only)
    steps = step_codes(schedule, codes, lookahead)[rank]
    actions = [a for a in schedule.ranks[rank] if a.op is Op.F or not forward_only]
    messages: dict[int, Message] = {}

    def message(k: int) -> Message | None:
        if k < 0:
            return None
        if k not in messages:
            messages[k] = _message(schedule, k)
        return messages[k]

    return tuple(
        Step(action, tuple(message(k) for k in steps.posted(i)), message(steps.needs[i]), message(steps.sends[i]))
        for i, action in enumerate(actions)
    )


def _wiring(schedule: Schedule) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """By action code: the pipeline rank the action sends its output (F) or input gradient (B)
    to, -1 for none; and where the action that sends it what it receives lies, -1 or +1 stage
    away (an F's input from s - 1, a B's gradient from s + 1), 0 for nothing."""
    ranks, S, m = schedule.stage_ranks, schedule.num_stages, schedule.microbatches

    def other(s: int, to: int) -> bool:
        return 0 <= to < S and ranks[to] != ranks[s]

    # a code is (op * m + mb) * S + stage: one op's row repeats every S codes, m times
    sends_to = (tuple(ranks[s + 1] if other(s, s + 1) else -1 for s in range(S)) * m
                + tuple(ranks[s - 1] if other(s, s - 1) else -1 for s in range(S)) * m + (-1,) * (S * m))
    receives = (tuple(-1 if other(s, s - 1) else 0 for s in range(S)) * m
                + tuple(1 if other(s, s + 1) else 0 for s in range(S)) * m + (0,) * (S * m))
    return sends_to, receives


def _posts(
    schedule: Schedule, rank: int, codes: Sequence[int], needs: Sequence[int],
    sent_here: Sequence[list[int]], slot: Sequence[int], lookahead: int,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The receives `rank` posts before each of its actions, flat, and where each step's end
    (`sent_here[src]`: what rank src sends it, in order). Step i posts for actions i .. i +
    lookahead - 1, so action j's message is posted by step j - lookahead + 1 (step 0 for the
    first ones), after every message the peer sends before it."""
    S, stage_ranks, n = schedule.num_stages, schedule.stage_ranks, len(codes)
    done = [0] * schedule.pp  # per peer: how many of its sends are posted
    posts: list[int] = []
    post_end = [0] * n
    for j, msg in enumerate(needs):
        if msg >= 0:
            src, at = stage_ranks[msg % S], slot[msg]
            if at < 0:
                raise ValueError(
                    f"rank {rank}: {_action(schedule, codes[j])} needs {_message(schedule, msg)}, "
                    f"which rank {src} never sends"
                )
            first = done[src]
            if at == first:
                posts.append(msg)
                done[src] = at + 1
            elif at > first:  # what the peer sends before msg is posted first: per-pair order
                posts += sent_here[src][first : at + 1]
                done[src] = at + 1
        if j >= lookahead - 1:
            post_end[j - lookahead + 1] = len(posts)
    for i in range(max(0, n - lookahead + 1), n):  # windows cut off by the end of the list
        post_end[i] = len(posts)
    for queue, n_posted in zip(sent_here, done):
        if n_posted < len(queue):
            raise ValueError(
                f"rank {rank} never receives {_message(schedule, queue[n_posted])} "
                f"(and {len(queue) - n_posted - 1} more)"
            )
    return tuple(posts), tuple(post_end)


def _action(schedule: Schedule, k: int) -> Action:
    ms, S = schedule.microbatches * schedule.num_stages, schedule.num_stages
    return Action(_OPS[k // ms], (k % ms) // S, k % S)


def _message(schedule: Schedule, k: int) -> Message:
    """The message sent by the action of code `k`."""
    a = _action(schedule, k)
    to = a.stage + 1 if a.op is Op.F else a.stage - 1
    kind: MessageKind = "act" if a.op is Op.F else "grad"
    return Message(kind, a.microbatch, to, schedule.stage_ranks[a.stage], schedule.stage_ranks[to])
