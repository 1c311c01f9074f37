"""The rules over a set of world sizes: what an elastic launch (`ppdsl run --nnodes MIN:MAX`) needs
of the spec before it starts, since the job may run, or restart, at any of them.

- E0330: the spec must hold at every world size of the range; a note per world where it does not,
  under the code of its first error there;
- E0331: with checkpoints, the global batch must be the same at every one of them (a restart at
  another world resumes the checkpoint, which keeps the global batch).
"""

from __future__ import annotations

from typing import Sequence

import attrs

from .check import CheckResult, check_file
from .diagnostics import Diagnostic, error, note
from .rules import Launch
from .world import value_at


@attrs.frozen
class WorldSet:
    """The world sizes `nodes` (MIN, MAX) node counts x `nproc` processes per node can make."""

    nodes: tuple[int, int]
    nproc: int

    @property
    def node_counts(self) -> range:
        return range(self.nodes[0], self.nodes[1] + 1)

    @property
    def worlds(self) -> list[int]:
        return [n * self.nproc for n in self.node_counts]

    @property
    def nodes_text(self) -> str:
        return str(self.nodes[0]) if self.nodes[0] == self.nodes[1] else f"{self.nodes[0]}:{self.nodes[1]}"

    def describe(self) -> str:
        return f"--nnodes {self.nodes_text} x --nproc {self.nproc} can make world sizes {', '.join(map(str, self.worlds))}"


@attrs.frozen
class WorldSetResult:
    diagnostics: tuple[Diagnostic, ...]
    sources: dict[str, str]  # file -> text, for the renderer

    @property
    def ok(self) -> bool:
        return not any(d.is_error for d in self.diagnostics)


def check_world_set(path: str, overrides: Sequence[str], worlds: WorldSet) -> WorldSetResult:
    """Check the spec at each world of `worlds` (without the model: the model does not depend on
    the world). `path` and `overrides` as typed: E0330's hint is the command that starts a range
    that works."""
    results: list[tuple[int, int, CheckResult]] = [
        (n, w, check_file(path, world=w, overrides=overrides, model=False)) for n, w in zip(worlds.node_counts, worlds.worlds)]
    sources = {r.file: r.text for _, _, r in results}
    failed = [(n, w, r) for n, w, r in results if not r.ok]
    if failed:
        free = check_file(path, overrides=overrides, model=False)  # the world left free: the sizes that work
        head = error("E0330", None, f"{worlds.describe()}; the spec does not hold for {len(failed)} of them",
                     hint=Launch(path, tuple(overrides), worlds.nodes).hint(free.valid_worlds, free.worlds))
        notes = []
        for n, w, r in failed:
            first = next(d for d in r.diagnostics if d.is_error)
            notes.append(note(first.code, first.span, f"at {n} node(s) x {worlds.nproc} = world {w}: {first.message}",
                              label=first.label))
        return WorldSetResult((head, *notes), sources)
    batches = {w: value_at(r.spec.train.global_batch, w) for _, w, r in results}
    spec = results[0][2].spec
    if spec.train.checkpoint is not None and len(set(batches.values())) > 1:
        last = batches[worlds.worlds[-1]]
        return WorldSetResult((error(
            "E0331", spec.span("train.global_batch"),
            f"{worlds.describe()}, and the spec's global batch differs between them "
            f"({', '.join(f'{b} at world {w}' for w, b in batches.items())}): a job restarted at another world "
            "could not resume its checkpoints, which keep the global batch",
            hint=f"give one global batch for every world (e.g. --set train.global_batch={last}), or a fixed --nnodes"),),
            sources)
    return WorldSetResult((), sources)
