"""DualPipeV (DeepSeek's DualPipe cut to a V: "DualPipe" in DeepSeek-V3's report, its V-shaped
half as torch.distributed.pipelining's ``ScheduleDualPipeV`` and torchtitan run it).

Two chunks per rank in a V (rank r holds stages r and 2pp - 1 - r, as zbv), split backward. Each
rank runs eight phases: forwards of its first chunk to fill the V; pairs F0 F1; I1 W1 F1 (the
zero-bubble trick on the second chunk); the main phase, pairs (F0, B1) (F1, B0) in which each
forward and the other chunk's backward are independent (DualPipe overlaps their computation and
communication; here, as in torch's CPU path, they run one after the other); then the drain:
B1 (F1, B0), B1 B0 whose second half defers W, W0 B0 and the deferred Ws. A full backward is a B
followed at once by its W. The order of each phase is torch's ``_calculate_single_rank_operations``
of ``ScheduleDualPipeV`` (microbatches counted per stage and op, deferred Ws first in, first out).
It needs at least as many microbatches as virtual stages (2pp).
"""

from __future__ import annotations

from collections import deque

from ._common import assemble, basic_problem, bwd, chunks_problem, fwd, raise_if, v_placement, wgt
from .ir import Action, Schedule

__all__ = ["dualpipev", "dualpipev_problem"]


def dualpipev_problem(pp: int, microbatches: int, chunks: int) -> str | None:
    problem = basic_problem(pp, microbatches, chunks) or chunks_problem("dualpipev", chunks)
    if problem is None and microbatches < 2 * pp:
        problem = f"needs microbatches >= 2 * pp = {2 * pp} (one per virtual stage), got {microbatches}"
    return problem


def dualpipev(pp: int, microbatches: int, chunks: int = 2, costs: object = None) -> Schedule:
    """The DualPipeV order; ``costs`` (a measured profile) change nothing: the order is fixed."""
    raise_if("dualpipev", dualpipev_problem(pp, microbatches, chunks))
    stage_ranks = v_placement(pp)
    return assemble("dualpipev", pp, microbatches, 2, True, stage_ranks,
                    [_rank_order(pp, microbatches, r) for r in range(pp)])


class _Rank:
    """One rank's action list as it is built: the next microbatch of each (stage, op) and the
    Ws deferred by a zero-bubble B."""

    def __init__(self) -> None:
        self.actions: list[Action] = []
        self.next_f: dict[int, int] = {}
        self.next_b: dict[int, int] = {}
        self.deferred: deque[Action] = deque()

    def f(self, stage: int) -> None:
        mb = self.next_f.get(stage, 0)
        self.next_f[stage] = mb + 1
        self.actions.append(fwd(mb, stage))

    def b(self, stage: int, defer_w: bool = False) -> None:
        mb = self.next_b.get(stage, 0)
        self.next_b[stage] = mb + 1
        self.actions.append(bwd(mb, stage))
        if defer_w:
            self.deferred.append(wgt(mb, stage))
        else:
            self.actions.append(wgt(mb, stage))

    def w(self) -> None:
        if self.deferred:
            self.actions.append(self.deferred.popleft())


def _rank_order(pp: int, m: int, r: int) -> list[Action]:
    s0, s1 = r, 2 * pp - 1 - r
    out = _Rank()
    for _ in range(2 * (pp - r - 1)):  # 1: F0, filling the V
        out.f(s0)
    for _ in range(r + 1):  # 2: F0 F1
        out.f(s0)
        out.f(s1)
    for _ in range(pp - r - 1):  # 3: I1 W1 F1
        out.b(s1, defer_w=True)
        out.w()
        out.f(s1)
    for _ in range(m - 2 * pp + r + 1):  # 4, the main phase: (F0, B1) (F1, B0)
        out.f(s0)
        out.b(s1)
        out.f(s1)
        out.b(s0)
    for _ in range(pp - r - 1):  # 5: B1 (F1, B0)
        out.b(s1)
        out.f(s1)
        out.b(s0)
    steps, defer = r + 1, False  # 6: B1 B0, the second half deferring W
    for i in range(steps):
        if i == steps // 2 and r % 2 == 1:
            defer = True
        out.b(s1, defer)
        if i == steps // 2 and r % 2 == 0:
            defer = True
        out.b(s0, defer)
    for _ in range(pp - r - 1):  # 7: W0 B0
        out.w()
        out.b(s0, defer)
    for _ in range(r + 1):  # 8: the deferred Ws
        out.w()
    assert not out.deferred, (pp, m, r, out.deferred)
    return out.actions
