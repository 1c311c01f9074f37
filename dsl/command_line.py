"""E0005: command-line input that check cannot use (a `--set` it cannot read, `--world` below 1, a
`--device-memory` that is no size, a schedule `ppdsl schedule --style` cannot build).
These diagnostics have no span: they point at no line of the spec."""

from __future__ import annotations

from .diagnostics import Diagnostic, error


def bad_input(message: str, *, label: str = "", hint: str = "") -> Diagnostic:
    return error("E0005", None, message, label=label, hint=hint)


def world_problem(world: int | None) -> Diagnostic | None:
    """What is wrong with `--world` (None: it is left free, or it is a size)."""
    if world is not None and world < 1:
        return bad_input(f"--world must be at least 1, got {world}")
    return None
