"""The blocks a spec cuts into stages: how many there are, and whether explicit ranges cover them.

One function each, called by check (model_check's E0309 / E0311, profile_check's E0316,
plan_needs' E0429) and by lowering (lowering/lower.py, lowering/stages.py), so the fact check
proves is the fact lowering uses. Pure Python: no torch, no sympy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator, Sequence

import attrs

if TYPE_CHECKING:
    from ppdsl.dsl.introspect import ModelInfo

__all__ = ["RangeProblem", "block_count", "range_problems"]


def block_count(blocks: str, dims: dict[str, Any], info: ModelInfo | None) -> int | None:
    """The number of blocks under the module path `blocks`: the built model's (``info``, a
    ModelInfo, when it has that module), else the config's layer count (``dims["layers"]``);
    None when neither says."""
    if info is not None and blocks in info.modules:
        return sum(1 for c in info.modules[blocks].children if c.isdigit())
    n = dims.get("layers")
    return n if isinstance(n, int) and not isinstance(n, bool) else None


@attrs.frozen
class RangeProblem:
    index: int | None  # the range at fault; None: the ranges as a whole (their end)
    code: str  # E0309 (skips, repeats, ends elsewhere) or E0311 (empty)
    message: str
    hint: str = ""


def range_problems(ranges: Sequence[tuple[int, int]], num_blocks: int) -> Iterator[RangeProblem]:
    """Why explicit ranges do not cover [0, num_blocks) exactly once, in order, none empty."""
    expect = 0
    for i, (a, b) in enumerate(ranges):
        if b <= a:
            yield RangeProblem(i, "E0311", f"range {a}:{b} is empty: every stage needs at least one block")
        if a != expect:
            what = "skips" if a > expect else "repeats"
            yield RangeProblem(i, "E0309", f"range {a}:{b} {what} blocks: the previous range ended at {expect}",
                               "ranges must cover the blocks exactly once, in order")
        expect = max(expect, b)
    if expect != num_blocks:
        yield RangeProblem(None, "E0309", f"the ranges end at block {expect} but the model has {num_blocks} blocks",
                           "blocks past the last range would be silently dropped" if expect < num_blocks else
                           "there are no blocks past the end")
