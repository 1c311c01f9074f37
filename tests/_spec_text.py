"""A spec written in a test, checked with its model and lowered: the one plan factory over spec
text that the kind tests (seq2seq, speech, images, vision stacks) share."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def check_text(tmp_path: Path, text: str, world: int = 2) -> Any:
    """check_file of ``text``, written to a new file under ``tmp_path``."""
    from ppdsl.dsl.check import check_file

    path = tmp_path / f"spec_{len(list(tmp_path.iterdir()))}.ppspec"
    path.write_text(text, encoding="utf-8")
    return check_file(path, world=world)


def plan_text(tmp_path: Path, text: str, world: int = 2) -> Any:
    """The plan of ``text`` at ``world``; the test fails with check's errors where it has any."""
    from ppdsl.lowering.lower import lower

    result = check_text(tmp_path, text, world)
    assert result.ok, [f"{d.code} {d.message}" for d in result.diagnostics]
    return lower(result.spec, world, result.model_info)
