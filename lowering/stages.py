"""Stage assignment: which blocks each virtual stage holds. Pure functions of sizes and costs.

Their callers pass what check proved (E0308: enough blocks for the stages; E0309, E0310, E0311:
explicit ranges that cover the blocks), so a violation here is a bug, stated as an `assert`.
"""

from __future__ import annotations

from typing import Sequence

from ppdsl.dsl.blocks import range_problems


def even_split(num_blocks: int, num_stages: int) -> list[tuple[int, int]]:
    """Contiguous ranges, as even as possible. The remainder goes one block each to the stages
    after the first (stages 1, 2, ...): stage 0 also holds the embedding, so it gets an extra
    block only when every other stage has one. 13 blocks on 4 stages -> 3, 4, 3, 3."""
    assert 1 <= num_stages <= num_blocks, f"{num_blocks} blocks cannot fill {num_stages} stages (E0308)"
    base, extra = divmod(num_blocks, num_stages)
    order = list(range(1, num_stages)) + [0]
    sizes = [base] * num_stages
    for s in order[:extra]:
        sizes[s] += 1
    return _ranges(sizes)


def cost_split(block_costs: Sequence[float], num_stages: int, first_cost: float = 0.0,
               last_cost: float = 0.0) -> list[tuple[int, int]]:
    """Contiguous ranges minimising the largest stage cost, where stage 0 also pays `first_cost`
    (embedding) and the last stage `last_cost` (head). Every stage gets at least one block.
    Dynamic programme over (stage, end block): O(S * n^2), fine for thousands of blocks."""
    n = len(block_costs)
    assert 1 <= num_stages <= n, f"{n} blocks cannot fill {num_stages} stages (E0308)"
    prefix = [0.0]
    for c in block_costs:
        prefix.append(prefix[-1] + c)

    def stage_cost(s: int, a: int, b: int) -> float:
        c = prefix[b] - prefix[a]
        if s == 0:
            c += first_cost
        if s == num_stages - 1:
            c += last_cost
        return c

    inf = float("inf")
    # best[s][b]: minimal max cost placing blocks [0, b) on stages 0..s
    best = [[inf] * (n + 1) for _ in range(num_stages)]
    cut = [[0] * (n + 1) for _ in range(num_stages)]
    for b in range(1, n + 1):
        best[0][b] = stage_cost(0, 0, b)
    for s in range(1, num_stages):
        for b in range(s + 1, n + 1):
            for a in range(s, b):
                v = max(best[s - 1][a], stage_cost(s, a, b))
                if v < best[s][b] - 1e-12:
                    best[s][b], cut[s][b] = v, a
    sizes = []
    b = n
    for s in range(num_stages - 1, 0, -1):
        a = cut[s][b]
        sizes.append(b - a)
        b = a
    sizes.append(b)
    return _ranges(list(reversed(sizes)))


def _ranges(sizes: Sequence[int]) -> list[tuple[int, int]]:
    out, start = [], 0
    for size in sizes:
        out.append((start, start + size))
        start += size
    return out


def check_ranges(ranges: Sequence[tuple[int, int]], num_blocks: int, num_stages: int) -> None:
    """Explicit ranges: one per stage, covering [0, num_blocks) exactly once, in order, none empty
    (check's rule, dsl/blocks.py: E0310 for the count, E0309 and E0311 for the rest)."""
    assert len(ranges) == num_stages, f"{len(ranges)} ranges for {num_stages} stages (E0310)"
    problems = [p.message for p in range_problems(ranges, num_blocks)]
    assert not problems, "; ".join(problems) + " (E0309, E0311)"
