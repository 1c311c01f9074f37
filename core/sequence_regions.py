"""Where sequence parallelism gathers the sequence inside a block, and what may run on a part of it:
the one rule the runtime applies (runtime/parallel/parallelize.py) and check proves (dsl/model_check.py on
the model's module tree, dsl/own_tp_proof.py on meta at one rank's shapes).

Between a block's split layers the hidden state is this tp rank's block of the sequence (Megatron-LM's
sequence parallelism). A module with a column-split child (an attention, an MLP) reads the whole
sequence: it is a *gathered region*, whose input is all-gathered at its entry (`gathered_regions`:
the outermost such modules of a block). A column layer outside every region gathers its own input;
a row layer reduce-scatters its output back onto the sequence blocks. Everything else of the block
runs on the rank's part of the sequence, which is right only for what treats each position alone:
`unproven_positions` names the first module that is neither that (`POSITION_WISE` layers, by kind)
nor on the way to split work.

Modules are named by path; ``children_of(path)`` gives a module's child paths. Torch-free.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable

__all__ = ["gathered_regions", "unproven_positions"]

Children = Callable[[str], Iterable[str]]


def gathered_regions(block: str, children_of: Children, columns: Collection[str],
                     split: Collection[str]) -> tuple[str, ...]:
    """The outermost modules under ``block`` with a child in ``columns`` (the column-split layers),
    found without entering a split layer (``split``: every layer tensor parallelism replaces)."""
    found: list[str] = []

    def visit(path: str) -> None:
        for child in children_of(path):
            if any(c in columns for c in children_of(child)):
                found.append(child)
            elif child not in split:
                visit(child)

    visit(block)
    return tuple(found)


def unproven_positions(block: str, children_of: Children, kind_of: Callable[[str], str],
                       regions: Collection[str], split: Collection[str]) -> str | None:
    """The first module under ``block``, outside ``regions`` and the ``split`` layers, that would run
    on a part of the sequence without being known to treat each position alone: ``kind_of(path)``
    is ``"position_wise"`` for such a module (a norm over the features, a dropout, an activation, a
    linear layer, a mixture of experts routing each token on its own), ``"container"`` for a module
    list, anything else otherwise; a module holding a
    split layer that its forward hands the work to (BERT's ``attention.output``) is looked into. An
    attention or an MLP left whole is such a module: under sequence parallelism it would mix, or
    miss, the other ranks' positions. None when there is none."""
    def holds_split(path: str) -> bool:
        return any(c in split or c in regions or holds_split(c) for c in children_of(path))

    def visit(path: str) -> str | None:
        for child in children_of(path):
            if child in regions or child in split:
                continue
            kind = kind_of(child)
            if kind == "position_wise":
                continue
            if kind != "container" and not holds_split(child):
                return child
            found = visit(child)
            if found is not None:
                return found
        return None

    return visit(block)
