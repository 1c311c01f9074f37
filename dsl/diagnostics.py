"""Diagnostics as data: code, severity, span, message, hint. Rendering lives in render.py."""

from __future__ import annotations

import enum
from typing import Iterable

import attrs

from ppdsl.dsl.span import Span


class Severity(str, enum.Enum):
    ERROR = "error"
    WARNING = "warning"
    NOTE = "note"


@attrs.frozen
class Diagnostic:
    code: str  # e.g. "E0203"; the catalogue is in docs/diagnostics.md
    severity: Severity
    span: Span | None
    message: str
    label: str = ""  # short text printed under the carets
    hint: str = ""

    @property
    def is_error(self) -> bool:
        return self.severity is Severity.ERROR


def error(code: str, span: Span | None, message: str, *, label: str = "", hint: str = "") -> Diagnostic:
    return Diagnostic(code, Severity.ERROR, span, message, label, hint)


def warning(code: str, span: Span | None, message: str, *, label: str = "", hint: str = "") -> Diagnostic:
    return Diagnostic(code, Severity.WARNING, span, message, label, hint)


def note(code: str, span: Span | None, message: str, *, label: str = "", hint: str = "") -> Diagnostic:
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
