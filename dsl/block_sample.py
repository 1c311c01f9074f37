"""The first blocks a meta trace runs for all of them: a trace's cost grows with the blocks it
runs, and a model's blocks are mostly copies of a few kinds (every block alike; sliding and full
attention alternating; the first few dense, the rest experts).

`representatives` finds how many of the first blocks hold every kind of block twice, and which
traced block stands for each later one; `first_blocks` runs a forward over those only; a trace
then copies each later block's facts from the block standing for it, with `moved` block indices.
`over_sampled_blocks` does that twice, over the fewest blocks and over one more, and keeps the
answer only when both give the same (else it runs every block): an answer that depends on how
many blocks ran cannot be copied from fewer.

Blocks are of one kind when their modules have the same classes, parameter and buffer shapes and
plain attributes (a sliding window, an attention type), leaving out those that count the blocks
(``layer_idx``: a whole number that grows by one from each block to the next). A later block
stands on the last traced block of its kind that is not its kind's first: the first block of a
kind computes or saves what the blocks of that kind share (a mask, the rotary tables), once, as
the whole forward does.

torch is not imported: the functions take the built model's modules.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from torch import nn

__all__ = ["first_blocks", "index_in", "moved", "over_sampled_blocks", "repeated_entries", "representatives"]

T = TypeVar("T")
V = TypeVar("V")


def representatives(stack: nn.Module, more: int = 0,
                    extra: Sequence[Hashable] = ()) -> tuple[int, dict[int, int]] | None:
    """(how many of the first blocks of ``stack`` to trace, {each later block: the traced block
    that stands for it}), or None when that leaves none out. ``more``: trace that many blocks
    beyond the fewest. ``extra``: per block, what else makes its kind (the splits a proof applies
    to it: blocks alike but split differently are not of one kind)."""
    blocks = list(stack.children())
    if len(blocks) != len(stack._modules):  # a block held twice: trace them all
        return None
    described = [{**_described(b), ":extra": extra[i] if extra else None} for i, b in enumerate(blocks)]
    counters = {key for key, first in described[0].items()
                if isinstance(first, int) and not isinstance(first, bool)
                and all(isinstance(d.get(key), int) and d[key] - i == first for i, d in enumerate(described))}
    kinds = [tuple(sorted((k, repr(v)) for k, v in d.items() if k not in counters)) for d in described]
    for fewest in range(2, len(blocks)):
        if all(kinds[:fewest].count(kinds[i]) >= 2 for i in range(fewest, len(blocks))):
            kept = fewest + more
            if kept >= len(blocks):
                return None
            last = {kind: j for j, kind in enumerate(kinds[:kept])}
            return kept, {i: last[kinds[i]] for i in range(kept, len(blocks))}
    return None
def _described(block: nn.Module) -> dict[str, object]:
    """Module path -> class, parameter and buffer shapes; "path:attribute" -> a plain attribute's value."""
    plain = (int, float, str, bool, type(None))
    out: dict[str, object] = {}
    for path, m in block.named_modules():
        out[path] = (type(m).__qualname__,
                     tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in m.named_parameters(recurse=False)),
                     tuple((n, tuple(b.shape), b.dtype) for n, b in m.named_buffers(recurse=False)))
        for name, value in vars(m).items():
            if not name.startswith("_") and (isinstance(value, plain) or
                                             isinstance(value, tuple) and all(isinstance(v, plain) for v in value)):
                out[f"{path}:{name}"] = value
    return out


@contextlib.contextmanager
def first_blocks(stack: nn.Module, kept: int) -> Iterator[None]:
    """While inside, ``stack`` holds its first ``kept`` blocks only (its length, iteration and
    slices: a forward over ``stack[: config.num_hidden_layers]`` runs those)."""
    whole = stack._modules
    stack._modules = type(whole)(list(whole.items())[:kept])
    try:
        yield
    finally:
        stack._modules = whole


def index_in(path: str, blocks: str) -> int | None:
    """The block a module path lies in (``blocks``' index), or None outside the blocks."""
    head = blocks + "."
    if not path.startswith(head):
        return None
    first = path[len(head):].split(".", 1)[0]
    return int(first) if first.isdigit() else None


def moved(path: str, blocks: str, by: int) -> str:
    """``path`` with its block index moved by ``by`` (unchanged outside the blocks)."""
    i = index_in(path, blocks)
    if i is None:
        return path
    head = blocks + "."
    return f"{head}{i + by}{path[len(head) + len(str(i)):]}"


def over_sampled_blocks(model: nn.Module, blocks: str, run: Callable[[], T],
                        repeated: Callable[[T, Mapping[int, int]], T], extra: Sequence[Hashable] = (),
                        complete: Callable[[T], bool] = lambda answer: True) -> T:
    """``run()``'s answer for the whole model from forwards over its first blocks: over the
    `representatives` (``extra``: as there) and over one block more, each answer given the later
    blocks by ``repeated(answer, {later block: the block standing for it})``. When the two differ
    (a module shared by the blocks, temporaries that outlive a block, a last block that differs)
    the answer depends on how many blocks run, and ``run()`` over every block gives it; so it
    does when ``blocks`` is "", the two forwards would run as many blocks as the whole one,
    either fails (one that indexes the blocks by the config's count), an answer is not
    ``complete``, or a forward changed the model (BigBird switches its blocks' attention on its
    first short input, in the blocks it holds then): the model is put back as it was first."""
    try:
        stack = model.get_submodule(blocks) if blocks else None
    except AttributeError:  # not a module of this model: nothing to cut
        stack = None
    fewest = representatives(stack, 0, extra) if stack is not None else None
    more = representatives(stack, 1, extra) if fewest is not None else None
    if more is not None and fewest[0] + more[0] < len(stack._modules):
        before = _state(model)
        try:
            answers = []
            for kept, reps in (fewest, more):
                with first_blocks(stack, kept):
                    answers.append(repeated(run(), reps))
            if answers[0] == answers[1] and complete(answers[0]) and _state_eq(_state(model), before):
                return answers[0]
        except Exception:  # noqa: BLE001 - any failure of a shorter forward: the whole one decides
            pass
        _restore(before)
    return run()


_State = list[tuple[object, dict[str, object], dict[str, object], dict[str, object], dict[str, object]]]


def _state(model: nn.Module) -> _State:
    """Every module's attributes and children, parameters and buffers (shallow: the objects held)."""
    return [(m, dict(vars(m)), dict(m._modules), dict(m._parameters), dict(m._buffers)) for m in model.modules()]


def _same(a: object, b: object) -> bool:
    return a is b or (isinstance(a, (int, float, str, bool, type(None))) and type(a) is type(b) and a == b)


def _state_eq(a: _State, b: _State) -> bool:
    return len(a) == len(b) and all(
        x[0] is y[0] and all(x[i].keys() == y[i].keys() and all(_same(v, y[i][k]) for k, v in x[i].items())
                             for i in range(1, 5))
        for x, y in zip(a, b))


def _restore(state: _State) -> None:
    for m, attributes, children, parameters, buffers in state:
        vars(m).clear()
        vars(m).update(attributes)
        for held, kept in ((m._modules, children), (m._parameters, parameters), (m._buffers, buffers)):
            held.clear()
            held.update(kept)


def repeated_entries(keyed: Mapping[str, V], blocks: str, reps: Mapping[int, int]) -> dict[str, V]:
    """``keyed`` (module path -> a fact of that module alone) from a trace of the first blocks,
    with each later block's entries copied from the block standing for it, at its own paths."""
    out = dict(keyed)
    for block, rep in reps.items():
        for k, v in keyed.items():
            if index_in(k, blocks) == rep:
                out[moved(k, blocks, block - rep)] = v
    return out
