"""Diagnostics as data: code, severity, span, message, hint. Rendering lives in render.py."""

from __future__ import annotations

from typing import Iterable

import attrs

from .catalogue import Severity, admits, rule
from .span import Span

__all__ = ["Diagnostic", "Severity", "SpecError", "diagnostic", "error", "has_errors", "note", "sort_key", "warning"]


@attrs.frozen
class Diagnostic:
    code: str  # e.g. "E0203", declared in dsl/catalogue.py
    severity: Severity
    span: Span | None
    message: str
    label: str = ""  # short text printed under the carets
    hint: str = ""

    @property
    def is_error(self) -> bool:
        return self.severity is Severity.ERROR


def diagnostic(code: str, span: Span | None, message: str, *, label: str = "", hint: str = "") -> Diagnostic:
    """A diagnostic of the severity dsl/catalogue.py declares for `code`."""
    return Diagnostic(code, rule(code).severity, span, message, label, hint)


def error(code: str, span: Span | None, message: str, *, label: str = "", hint: str = "") -> Diagnostic:
    assert rule(code).severity is Severity.ERROR, f"{code} is not declared an error"
    return Diagnostic(code, Severity.ERROR, span, message, label, hint)


def warning(code: str, span: Span | None, message: str, *, label: str = "", hint: str = "") -> Diagnostic:
    assert rule(code).severity is Severity.WARNING, f"{code} is not declared a warning"
    return Diagnostic(code, Severity.WARNING, span, message, label, hint)


def note(code: str, span: Span | None, message: str, *, label: str = "", hint: str = "") -> Diagnostic:
    """A note of its own (an N code), or one that explains an error (E0601's notes keep the code
    of the rule they name)."""
    assert admits(code, Severity.NOTE), f"{code} is declared a warning, not a note"
    return Diagnostic(code, Severity.NOTE, span, message, label, hint)


def has_errors(diags: Iterable[Diagnostic]) -> bool:
    return any(d.is_error for d in diags)


def sort_key(d: Diagnostic) -> tuple:
    if d.span is None:
        return ("", 0, 0, d.code)
    return (d.span.file, d.span.line, d.span.column, d.code)


class SpecError(Exception):
    """Raised by a stage of the pipeline (parse, resolve, ...) that cannot go on; carries all it found."""

    def __init__(self, diagnostics: list[Diagnostic]):
        assert diagnostics
        super().__init__("; ".join(d.message for d in diagnostics))
        self.diagnostics = diagnostics
