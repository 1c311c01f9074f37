"""Golden diagnostics: one small wrong spec per rule of the catalogue, and what `ppdsl check` says.

Each `tests/golden/<code>_<name>.ppspec` is checked in-process through `ppdsl.cli.main`, exactly as
`ppdsl check tests/golden/<code>_<name>.ppspec <args>` would run from the repository root; its
text output (stderr then stdout) must equal `<same>.txt` and its `--format json` output must equal
`<same>.json`.

Directives, in comments of the golden spec (the parser ignores them):

    # args: --no-model --world 6          extra command-line arguments (shell words)
    # needs: torch                        skip when torch (and transformers) cannot be imported
    tp = 3                  # <-- E0202   a diagnostic with this code starts on this line, at
                                          the first non-blank character of the line
    source = hf("X")        # <-- E0401 @ "hf("    ... at the first occurrence of this text
    # expect: E0002 @ 7:12                ... at this line and column (where no marker fits)
    # expect: E0005 @ -                   ... with no source position (command-line errors)
    # expect: ok                          the spec passes, without any diagnostic (a fix that works)

Every golden needs at least one location directive, and the code in its file name must be among
the diagnostics it produces.

Rewrite the expected files after a deliberate change with

    PPDSL_UPDATE_GOLDEN=1 .venv/bin/pytest tests/test_golden_diagnostics.py

and read the diff: every message must stay right, clear and point at the right place.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
from pathlib import Path

import pytest

from ppdsl import cli
from ppdsl.dsl import catalogue

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = Path(__file__).resolve().parent / "golden"
UPDATE = os.environ.get("PPDSL_UPDATE_GOLDEN") == "1"
HAVE_TORCH = importlib.util.find_spec("torch") is not None and importlib.util.find_spec("transformers") is not None

CASES = sorted(GOLDEN.glob("*.ppspec"))

_MARKER = re.compile(r'#\s*<--\s*([EWN]\d{4})(?:\s*@\s*"((?:[^"\\]|\\.)*)")?')
_EXPECT = re.compile(r"#\s*expect:\s*([EWN]\d{4})\s*@\s*(?:(\d+):(\d+)|(-))")
_ARGS = re.compile(r"#\s*args:(.*)$")
_NEEDS = re.compile(r"#\s*needs:\s*(\w+)")


def _directives(text: str) -> tuple[list[str], set[str], list[tuple[str, int | None, int | None]]]:
    args: list[str] = []
    needs: set[str] = set()
    where: list[tuple[str, int | None, int | None]] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if m := _ARGS.search(line):
            args += shlex.split(m.group(1))
        if m := _NEEDS.search(line):
            needs.add(m.group(1))
        if m := _EXPECT.search(line):
            if m.group(4):
                where.append((m.group(1), None, None))
            else:
                where.append((m.group(1), int(m.group(2)), int(m.group(3))))
        elif m := _MARKER.search(line):
            code = m.group(1)
            if m.group(2) is not None:
                needle = m.group(2).encode().decode("unicode_escape")
                col = line.index(needle) + 1
            else:
                col = len(line) - len(line.lstrip()) + 1
            where.append((code, lineno, col))
    return args, needs, where


def _run(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str, str]:
    try:
        code = cli.main(argv)
    except SystemExit as exc:  # argparse usage errors
        code = exc.code if isinstance(exc.code, int) else 2
    out, err = capsys.readouterr()
    return code, out, err


def _compare(path: Path, actual: str) -> None:
    if UPDATE:
        path.write_text(actual, encoding="utf-8")
        return
    assert path.exists(), f"{path.name} is missing: run with PPDSL_UPDATE_GOLDEN=1 to write it"
    expected = path.read_text(encoding="utf-8")
    assert actual == expected, f"{path.name} differs from the checker's output (PPDSL_UPDATE_GOLDEN=1 rewrites it)"


def _code_of(case: Path) -> str:
    return case.name.split("_", 1)[0]


def test_there_are_goldens() -> None:
    assert len(CASES) >= 50


@pytest.mark.parametrize("case", CASES, ids=[c.stem for c in CASES])
def test_golden(case: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    text = case.read_text(encoding="utf-8")
    args, needs, where = _directives(text)
    if "torch" in needs and not HAVE_TORCH:
        pytest.skip("needs torch and transformers for model-level checks")
    expect_ok = re.search(r"^#\s*expect:\s*ok\s*$", text, re.M) is not None
    assert where or expect_ok, f"{case.name} has no `# <-- CODE` marker or `# expect:` line"
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("PPDSL_DEBUG", raising=False)
    monkeypatch.setenv("NO_COLOR", "1")
    rel = case.relative_to(ROOT).as_posix()

    code, out, err = _run(capsys, ["check", rel, *args])
    _compare(case.with_suffix(".txt"), err + out)

    jcode, jout, jerr = _run(capsys, ["check", rel, *args, "--format", "json"])
    _compare(case.with_suffix(".json"), jout)
    assert jerr == "", "with --format json, nothing but the JSON is printed"
    assert jcode == code

    report = json.loads(jout)
    diags = report["diagnostics"]
    assert code == (0 if report["ok"] else 2), "exit code 0 for a valid spec, 2 for an invalid one"
    assert report["ok"] == (not any(d["severity"] == "error" for d in diags))
    assert "Traceback" not in err and "internal error" not in err

    for d in diags:
        assert catalogue.admits(d["code"], catalogue.Severity(d["severity"])), f"{d['code']} as declared in dsl/catalogue.py"
        assert d["message"] and not d["message"].endswith("."), d["message"]
        for part in (d["message"], d["label"], d["hint"]):
            assert not re.search(r"\{[a-z_]+\}", part), f"an unfilled template: {part!r}"
        if d["span"] is not None:
            assert d["span"]["file"] in (rel,) or d["span"]["file"].startswith("--set "), d["span"]
            assert (d["span"]["line"], d["span"]["column"]) <= (d["span"]["end_line"], d["span"]["end_column"])
    if expect_ok:
        assert code == 0 and diags == [], f"{case.name} should pass without a diagnostic"
        return
    wanted = _code_of(case)
    assert any(d["code"] == wanted for d in diags), f"{case.name}: no {wanted} among {[d['code'] for d in diags]}"
    for want, line, col in where:
        found = [d for d in diags if d["code"] == want]
        assert found, f"{case.name}: expected {want}, got {[d['code'] for d in diags]}"
        if line is None:
            assert any(d["span"] is None for d in found), f"{case.name}: {want} should have no position"
            continue
        spots = [(d["span"]["line"], d["span"]["column"]) for d in found if d["span"] is not None]
        assert (line, col) in spots, f"{case.name}: {want} should point at {line}:{col}, points at {spots}"
        assert f"{rel}:{line}:{col}" in err, f"the text output names {rel}:{line}:{col}"


def test_every_catalogue_code_has_a_golden() -> None:
    required = {
        "E0002", "E0003", "E0004", "E0005", "E0100", "E0101", "E0102", "E0103", "E0104", "E0105", "E0106",
        "E0107", "E0110", "E0201", "E0202", "E0203", "E0204", "E0205", "E0206", "E0208", "E0209", "E0210",
        "E0211", "E0212", "E0213", "E0214", "E0216", "E0301", "E0302", "E0303", "W0304", "E0305",
        "E0306", "E0307", "E0308", "E0309", "E0310", "E0311", "E0315", "W0317", "W0318", "E0401", "E0402", "E0404", "E0405",
        "E0501", "E0601", "E0219", "E0220", "E0221", "E0222", "E0223", "E0407",
        "E0108", "E0109", "E0408", "E0419", "E0428",
    }
    have = {_code_of(c) for c in CASES}
    assert not required - have, f"no golden for {sorted(required - have)}"


def test_golden_files_are_paired() -> None:
    stems = {c.stem for c in CASES}
    for extra in GOLDEN.iterdir():
        if extra.suffix in (".txt", ".json"):
            assert extra.stem in stems, f"{extra.name} has no .ppspec"
