"""The one renderer of diagnostics: compiler-style text, or JSON for editors and CI."""

from __future__ import annotations

import json
from typing import Iterable, Mapping

from .diagnostics import Diagnostic


def render_text(diags: Iterable[Diagnostic], sources: Mapping[str, str], color: bool = False) -> str:
    return "\n".join(render_one(d, sources, color) for d in diags)


def _paint(text: str, code: str, color: bool) -> str:
    return f"\x1b[{code}m{text}\x1b[0m" if color else text


def render_one(d: Diagnostic, sources: Mapping[str, str], color: bool = False) -> str:
    sev_color = {"error": "1;31", "warning": "1;33", "note": "1;36"}[d.severity.value]
    head = _paint(f"{d.severity.value}[{d.code}]", sev_color, color) + f": {d.message}"
    lines = [head]
    span = d.span
    gutter = "  "  # as wide as the line number shown, like rustc's
    if span is not None:
        gutter = " " * len(str(span.line))
        lines.append(f"{gutter}--> {span.file}:{span.line}:{span.column}")
        text = sources.get(span.file)
        if text is None and span.file.startswith("--set "):
            text = span.file  # a --set value: its spans point into the option itself
        src_lines = text.splitlines() if text is not None else []
        if 1 <= span.line <= len(src_lines):
            src = src_lines[span.line - 1].replace("\t", " ")
            end = span.end_column if span.end_line == span.line else len(src) + 1
            width = max(1, min(end, len(src) + 1) - span.column)
            carets = " " * (span.column - 1) + _paint("^" * width, sev_color, color)
            lines.append(f"{gutter} |")
            lines.append(f"{span.line} | {src}")
            lines.append(f"{gutter} | {carets}" + (f" {d.label}" if d.label else ""))
        elif d.label:
            lines.append(f"{gutter} = {d.label}")
    elif d.label:
        lines.append(f"{gutter} = {d.label}")
    if d.hint:
        lines.append(f"{gutter} = hint: {d.hint}")
    return "\n".join(lines) + "\n"


def to_json(d: Diagnostic) -> dict:
    span = None
    if d.span is not None:
        s = d.span
        span = {"file": s.file, "line": s.line, "column": s.column, "end_line": s.end_line, "end_column": s.end_column}
    return {"code": d.code, "severity": d.severity.value, "message": d.message, "span": span, "label": d.label,
            "hint": d.hint}


def render_json(results: list[dict]) -> str:
    return json.dumps(results, indent=2)
