"""Pipeline schedule generators: one pure function of (pp, microbatches, chunks) per style.

``generate(style, pp, microbatches, chunks)`` returns the schedule IR (see ``ir``);
``STYLES`` describes each style (placement, chunks rule, whether backward is split) and
``style_problem`` says why a combination is unsupported without building anything, so the
spec checker can report it with a source span.
``messages`` adds the sends and receives to the action lists: the steps the runtime executes
and ``simulate`` runs.
"""

from __future__ import annotations

import gc

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Literal

import attrs

from . import dualpipev as _dualpipev
from . import gpipe as _gpipe
from . import interleaved as _interleaved
from . import looped_bfs as _looped_bfs
from . import one_f_one_b as _one_f_one_b
from . import zero_bubble as _zero_bubble
from ._common import CHUNKS, ChunkRule
from .ir import Action, Op, Schedule

__all__ = ["CHUNKS", "STYLES", "Action", "ChunkRule", "Op", "Schedule", "StyleInfo", "generate", "style_problem"]


@attrs.frozen
class StyleInfo:
    name: str
    summary: str
    placement: Literal["loop", "v"]  # loop: stage s on rank s % pp; v: rank r holds r and 2pp-1-r
    split_backward: bool
    problem: Callable[[int, int, int], str | None] = attrs.field(repr=False)
    build: Callable[[int, int, int], Schedule] = attrs.field(repr=False)

    @property
    def chunk_rule(self) -> ChunkRule:
        return CHUNKS[self.name]

    @property
    def chunks(self) -> str:
        """The chunks rule, in words: "== 1", ">= 2"."""
        return CHUNKS[self.name].text


STYLES: Mapping[str, StyleInfo] = MappingProxyType(
    {
        info.name: info
        for info in (
            StyleInfo(
                "gpipe", "all forwards, then all backwards", "loop", False,
                _gpipe.problem, _gpipe.gpipe,
            ),
            StyleInfo(
                "1f1b", "warm-up forwards, one forward one backward, drain", "loop", False,
                _one_f_one_b.problem, _one_f_one_b.one_f_one_b,
            ),
            StyleInfo(
                "interleaved", "Megatron interleaved 1F1B over virtual stages; m % pp == 0",
                "loop", False, _interleaved.problem, _interleaved.interleaved,
            ),
            StyleInfo(
                "looped_bfs", "each chunk's forwards for all microbatches, backwards in reverse",
                "loop", False, _looped_bfs.problem, _looped_bfs.looped_bfs,
            ),
            StyleInfo(
                "zbh1", "zero bubble H1: split backward, W fills 1F1B's bubbles", "loop", True,
                _zero_bubble.zbh1_problem, _zero_bubble.zbh1,
            ),
            StyleInfo(
                "zbv", "zero bubble V: two chunks in a V, split backward", "v", True,
                _zero_bubble.zbv_problem, _zero_bubble.zbv,
            ),
            StyleInfo(
                "interleaved_zb", "zero bubble over interleaved virtual stages", "loop", True,
                _zero_bubble.interleaved_zb_problem, _zero_bubble.interleaved_zb,
            ),
            StyleInfo(
                "dualpipev", "DualPipe's V: two chunks in a V, forward and backward pairs, split backward; m >= 2pp",
                "v", True, _dualpipev.dualpipev_problem, _dualpipev.dualpipev,
            ),
        )
    }
)


def style_problem(style: str, pp: int, microbatches: int, chunks: int) -> str | None:
    """Why ``generate`` would refuse these arguments, or None when it builds a schedule."""
    info = STYLES.get(style)
    if info is None:
        return f"unknown pipeline style {style!r}; known styles: {', '.join(STYLES)}"
    problem = info.problem(pp, microbatches, chunks)
    return None if problem is None else f"schedule {style!r}: {problem}"


def generate(style: str, pp: int, microbatches: int, chunks: int,
             costs: _zero_bubble.StageCosts | None = None) -> Schedule:
    """The schedule IR of ``style``; ValueError, with the reason, for an unsupported combination.
    ``costs`` (F, B, W seconds per virtual stage): the zero-bubble styles order their actions on
    them instead of on unit costs; the other styles' orders do not depend on costs."""
    problem = style_problem(style, pp, microbatches, chunks)
    if problem is not None:
        raise ValueError(problem)
    if costs is not None and STYLES[style].split_backward:
        return STYLES[style].build(pp, microbatches, chunks, costs)  # type: ignore[call-arg]
    # A big schedule is ~100k small acyclic objects: each allocation burst would start a full
    # garbage collection over everything the process holds (torch's modules in a worker), for
    # nothing. Collection resumes as before once the schedule is built.
    enabled = gc.isenabled()
    gc.disable()
    try:
        return STYLES[style].build(pp, microbatches, chunks)
    finally:
        if enabled:
            gc.enable()
