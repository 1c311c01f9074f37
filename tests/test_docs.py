"""The reference docs stay in step with the code.

- docs/language.md documents every block, key, call option, pipeline style, split style and
  choice of `ppdsl.dsl.schema`, with the schema's kind and default;
- docs/diagnostics.md documents every diagnostic code (tests/test_catalogue.py checks it against dsl/catalogue.py);
- every complete spec in the docs (a ```ppspec block) passes `check_text(..., model=False)`;
  fragments are tagged ```text;
- the `ppdsl check ... --no-model` examples of docs/diagnostics.md and docs/cli.md, run on the
  shipped specs, still report the codes the docs show;
- the bubble / peak table of docs/schedules.md is what the generators and the simulator give;
- every link between the docs points at a heading that exists.

Pure Python and fast: nothing here builds a model or imports torch.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
from pathlib import Path

import pytest

from ppdsl import cli
from ppdsl.dsl import schema
from ppdsl.dsl.check import check_text
from ppdsl.core.schedules import STYLES as SCHEDULE_STYLES
from ppdsl.core.schedules import generate
from ppdsl.core.schedules.simulate import simulate

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
LANGUAGE = DOCS / "language.md"
DIAGNOSTICS = DOCS / "diagnostics.md"
SCHEDULES = DOCS / "schedules.md"
CLI = DOCS / "cli.md"
DSL_SOURCES = sorted((ROOT / "dsl").glob("*.py"))

CODE_RE = re.compile(r"[EWN]0\d{3}")
FENCE_RE = re.compile(r"^```(\w*)[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _fences(text: str) -> list[tuple[str, str]]:
    """(info string, body) of every fenced code block."""
    return [(m.group(1), m.group(2)) for m in FENCE_RE.finditer(text)]


def _without_fences(text: str) -> str:
    return FENCE_RE.sub("", text)


def _sections(text: str, level: int) -> dict[str, str]:
    """Heading text -> body (up to the next heading of the same or a higher level)."""
    out: dict[str, str] = {}
    pattern = re.compile(rf"^(#{{1,{level}}}) (.+)$", re.M)
    body = _without_fences(text)
    matches = list(pattern.finditer(body))
    for i, m in enumerate(matches):
        if len(m.group(1)) != level:
            continue
        end = next((n.start() for n in matches[i + 1:] if len(n.group(1)) <= level), len(body))
        out[m.group(2).strip()] = body[m.end():end]
    return out


def _tables(text: str) -> list[list[list[str]]]:
    """Every markdown table: its rows (header first, the separator row dropped) as cells."""
    tables: list[list[list[str]]] = []
    current: list[list[str]] | None = None
    for line in text.splitlines():
        line = line.strip()
        if not (line.startswith("|") and line.endswith("|")):
            current = None
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line[1:-1])]
        if current is None:
            current = []
            tables.append(current)
        if not set("".join(cells)) <= set("-: "):
            current.append(cells)
    return tables


def _table_rows(text: str) -> list[list[str]]:
    """Cells of every row of every table (headers included)."""
    return [row for table in _tables(text) for row in table]


def _spec_literal(value: object) -> str:
    """A schema default as the docs write it in spec syntax."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "none"
    if isinstance(value, tuple):
        return "[" + ", ".join(_spec_literal(v) for v in value) + "]"
    return str(value)


def _same_value(doc: str, value: object) -> bool:
    """Does the docs' default cell (`1e-3`, `[0.9, 0.999]`, `false`, `1f1b`) mean `value`?"""
    doc = doc.strip().strip("`").strip()
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return doc == _spec_literal(value)
    if isinstance(value, tuple):
        parts = [p.strip() for p in doc.strip("[]").split(",")]
        return len(parts) == len(value) and all(_same_value(p, v) for p, v in zip(parts, value))
    try:
        return float(doc) == float(value)  # type: ignore[arg-type]
    except ValueError:
        return False


# ---- language.md ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def language() -> str:
    return _read(LANGUAGE)


def _block_section(language: str, block: str) -> str:
    sections = _sections(language, 2)
    title = f"The `{block}` block"
    assert title in sections, f"docs/language.md has no section '## {title}'"
    return sections[title]


def _key_rows(section: str) -> dict[str, list[str]]:
    """First cell `key` -> the row's cells, for tables whose header is key | kind | default | ..."""
    rows: dict[str, list[str]] = {}
    for table in _tables(section):
        if table[0][:3] != ["key", "kind", "default"]:
            continue
        for cells in table[1:]:
            m = re.fullmatch(r"`(\w+)`", cells[0])
            if m:
                rows[m.group(1)] = cells
    return rows


@pytest.mark.parametrize("block", list(schema.BLOCKS))
def test_every_key_of_every_block_is_documented_with_its_kind_and_default(language: str, block: str) -> None:
    section = _block_section(language, block)
    if block == "train":  # its nested blocks' tables follow the key table
        section = section.split("The `checkpoint` block:")[0]
    rows = _key_rows(section)
    keys = schema.BLOCKS[block]
    missing = [k for k in keys if k not in rows]
    assert not missing, f"docs/language.md, block {block}: keys without a row in its key table: {missing}"
    extra = [k for k in rows if k not in keys]
    assert not extra, f"docs/language.md, block {block}: the table documents keys the schema lacks: {extra}"
    for name, key in keys.items():
        _kind_cell, default_cell = rows[name][1], rows[name][2]
        assert f"`{key.kind}`" == _kind_cell, f"{block}.{name}: kind {_kind_cell!r}, schema says {key.kind!r}"
        if key.required:
            assert "required" in default_cell, f"{block}.{name} is required; the docs say {default_cell!r}"
        elif key.default is not None:
            assert _same_value(default_cell.split()[0], key.default), \
                f"{block}.{name}: default {default_cell!r}, schema says {key.default!r}"


@pytest.mark.parametrize(("nested", "keys"), [("checkpoint", schema.CHECKPOINT_KEYS), ("eval", schema.EVAL_KEYS)])
def test_nested_train_block_keys_are_documented(language: str, nested: str, keys: dict[str, schema.Key]) -> None:
    section = _block_section(language, "train")
    tables = section.split(f"The `{nested}` block:")
    assert len(tables) == 2, f"docs/language.md: the train section has no 'The `{nested}` block:' table"
    rows = _key_rows(tables[1].split("block:")[0])  # up to the next nested block's table
    assert set(rows) == set(keys), f"{nested} keys documented: {sorted(rows)}, schema: {sorted(keys)}"
    for name, key in keys.items():
        assert name in rows, f"{nested} key {name} is not documented"
        assert rows[name][1] == f"`{key.kind}`"
        if key.required:
            assert "required" in rows[name][2]
        else:
            assert _same_value(rows[name][2].split()[0], key.default)


CALL_TABLES = {
    **schema.OPTIMIZER_ARGS, **schema.LR_SCHEDULE_ARGS, **schema.DATA_ARGS, **schema.TP_STYLE_ARGS,
}


def _call_option_rows(language: str) -> dict[tuple[str, str], list[str]]:
    sections = _sections(language, 2)
    assert "Call options" in sections, "docs/language.md has no '## Call options' section"
    rows = {}
    for cells in _table_rows(sections["Call options"]):
        if len(cells) >= 4 and re.fullmatch(r"`\w+`", cells[0]) and re.fullmatch(r"`\w+`", cells[1]):
            rows[(cells[0].strip("`"), cells[1].strip("`"))] = cells
    return rows


def test_every_call_option_is_documented_with_its_kind_and_default(language: str) -> None:
    rows = _call_option_rows(language)
    problems = []
    for func, options in CALL_TABLES.items():
        for option, (kind, default) in options.items():
            row = rows.get((func, option))
            if row is None:
                problems.append(f"{func}({option}) has no row")
                continue
            if row[2] != kind:
                problems.append(f"{func}({option}): kind {row[2]!r}, schema says {kind!r}")
            if not _same_value(row[3], default):
                problems.append(f"{func}({option}): default {row[3]!r}, schema says {default!r}")
    documented = {k for k in rows}
    known = {(f, o) for f, opts in CALL_TABLES.items() for o in opts}
    problems += [f"{f}({o}) is documented but not in the schema" for f, o in sorted(documented - known)]
    assert not problems, "docs/language.md, call options:\n" + "\n".join(problems)


def test_every_call_and_choice_is_named(language: str) -> None:
    names = {
        "call": [*CALL_TABLES],
        "pipeline style (dsl.schema.STYLES)": [*schema.STYLES],
        "pipeline style (ppdsl.core.schedules.STYLES)": [*SCHEDULE_STYLES],
        "split style": [*schema.TP_STYLES],
        "precision": [*schema.PRECISIONS],
        "optimizer": [*schema.OPTIMIZERS],
        "lr schedule": [*schema.LR_SCHEDULES],
        "data": [*schema.DATA_KINDS],
        "source": [*schema.SOURCES],
        "choice": [c for keys in schema.BLOCKS.values() for k in keys.values() for c in k.choices],
    }
    missing = [f"{what} {n}" for what, ns in names.items() for n in ns if f"`{n}`" not in language and
               f"`{n}(" not in language]
    assert not missing, f"docs/language.md does not mention: {missing}"


def test_the_split_styles_have_a_row_each(language: str) -> None:
    section = _block_section(language, "tensor_parallel")
    firsts = {cells[0] for cells in _table_rows(section)}
    missing = [s for s in schema.TP_STYLES if f"`{s}`" not in firsts]
    assert not missing, f"the split styles table of docs/language.md lacks {missing}"


def test_the_schedule_styles_have_a_row_each() -> None:
    rows = {cells[0] for cells in _table_rows(_sections(_read(SCHEDULES), 2)["Styles"])}
    missing = [s for s in SCHEDULE_STYLES if f"`{s}`" not in rows]
    assert not missing, f"the styles table of docs/schedules.md lacks {missing}"
    assert set(schema.STYLES) <= set(SCHEDULE_STYLES)


def test_documented_lexing_and_fractions_hold(language: str) -> None:
    """docs/language.md states how `1_000` lexes and what `1 / 1000` in a float option means."""
    from ppdsl.dsl import ast
    from ppdsl.dsl.parse import parse

    value = parse("x { v = 1_000 }").items[0].entries[0].value  # type: ignore[union-attr]
    assert isinstance(value, ast.Num) and value.value == 1000
    assert "`1_000`" in language
    spec = ("ppspec 1\nmodel m { source = hf(\"GPT2LMHeadModel\") }\n"
            "train { global_batch = 8, seq_len = 128, optimizer = adamw(lr = 1 / 1000) }\n")
    result = check_text(spec, model=False)
    assert result.ok and result.spec.train.optimizer.lr == 0.001
    assert "`adamw(lr = 1 / 1000)` is `lr = 0.001`" in language
