"""A spec file -> its text: E0000 (the file cannot be read), E0001 (not a UTF-8 text file, or too large)."""

from __future__ import annotations

from pathlib import Path

from .diagnostics import SpecError, error
from .span import Span

MAX_BYTES = 4 * 1024 * 1024


def read_spec(path: str | Path) -> bytes:
    """The bytes of the spec file at `path`; SpecError (E0000) when it cannot be read."""
    p = Path(path)
    try:
        return p.read_bytes()
    except OSError as exc:
        raise SpecError([error("E0000", None, f"cannot read {p}: {exc.strerror or exc}")]) from None


def decode(data: bytes, file: str) -> str:
    """Bytes -> text, or a diagnostic for what is not a UTF-8 text file."""
    if len(data) > MAX_BYTES:
        raise SpecError([error("E0001", Span.point(file), f"the spec is {len(data)} bytes; the limit is {MAX_BYTES}",
                               hint="a .ppspec file is a few dozen lines")])
    if b"\x00" in data:
        raise SpecError([error("E0001", Span.point(file), "this is not a text file (it contains NUL bytes)",
                               hint="give the path of a .ppspec file")])
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        col = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise SpecError([error("E0001", Span.point(file, line, col), "the spec is not valid UTF-8",
                               label=f"byte 0x{data[exc.start]:02x} cannot start or continue a UTF-8 character",
                               hint="save the file as UTF-8")]) from None
    return text
