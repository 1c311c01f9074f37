"""Source positions. Every AST node and every diagnostic carries one."""

from __future__ import annotations

import attrs


@attrs.frozen
class Span:
    file: str
    line: int  # 1-based
    column: int  # 1-based
    end_line: int
    end_column: int  # exclusive, 1-based

    @classmethod
    def point(cls, file: str, line: int = 1, column: int = 1) -> "Span":
        return cls(file, line, column, line, column + 1)

    def to(self, other: "Span") -> "Span":
        return Span(self.file, self.line, self.column, other.end_line, other.end_column)

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.column}"
