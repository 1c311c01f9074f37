"""Every `$ ppdsl check ... --no-model` example of docs/diagnostics.md and docs/cli.md prints
exactly what the docs show (carets, line numbers, hints, the summary line).

The examples run in-process through `ppdsl.cli.main` from the repository root, as a reader would
type them. Examples on `tiny.ppspec` (a copy described in prose) and examples that build a model
are left out: they have no file to run on, or need torch. After a deliberate change of a message,
print the new output with `.venv/bin/ppdsl ...` and paste it into the docs.
"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import pytest

from ppdsl import cli

ROOT = Path(__file__).resolve().parent.parent
DOCS = ("docs/diagnostics.md", "docs/cli.md")
CONSOLE_RE = re.compile(r"^```console\n(.*?)^```", re.S | re.M)


def _examples() -> list[tuple[str, str, str]]:
    out = []
    for doc in DOCS:
        for block in CONSOLE_RE.findall((ROOT / doc).read_text(encoding="utf-8")):
            cmd, _, expected = block.partition("\n")
            if not cmd.startswith("$ ppdsl check ") or "--no-model" not in cmd:
                continue
            if not all((ROOT / a).exists() for a in shlex.split(cmd[2:]) if a.endswith(".ppspec")):
                continue
            out.append((doc, cmd[2:], expected))
    return out


EXAMPLES = _examples()


def test_there_are_examples_to_compare() -> None:
    assert len(EXAMPLES) >= 30


@pytest.mark.parametrize(("doc", "cmd", "expected"), EXAMPLES, ids=[f"{d}:{c[12:70]}" for d, c, _ in EXAMPLES])
def test_docs_example_is_what_the_tool_prints(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                                              doc: str, cmd: str, expected: str) -> None:
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.delenv("PPDSL_DEBUG", raising=False)
    cli.main(shlex.split(cmd)[1:])
    out, err = capsys.readouterr()
    assert (err + out).strip() == expected.strip(), f"{doc}: `{cmd}` prints something else now"
    assert os.getcwd() == str(ROOT)
