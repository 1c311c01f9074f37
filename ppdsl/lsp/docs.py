"""Hover text for the language: the rows of docs/language.md's tables, else the schema's `doc=`.

`dsl/schema.py` is the source of truth for which keys exist; docs/language.md says the most about
each (tests/test_docs.py keeps the two in step). The docs are read once, on first use, from the
repository's docs/ folder; an installation without it still gets the schema's one-line docs.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

from ppdsl.dsl import schema
from ppdsl.dsl.families import DIM_ALIASES

LANGUAGE_MD = Path(__file__).resolve().parents[2] / "docs" / "language.md"

_HEADING = re.compile(r"^(#{2,3}) (.+)$", re.M)
_FENCE = re.compile(r"^```.*?^```[ \t]*$", re.S | re.M)
_LINK = re.compile(r"\[([^\]]+)\]\([^)]*\)")  # [E0303](diagnostics.md#e0303) -> E0303: relative links go nowhere in a hover
_CALL_NAME = re.compile(r"`([A-Za-z_0-9]+)(?:\(|`)")

BLOCK_DOCS = {
    "model": "where the model comes from: `source` and its `config`",
    "mesh": "the sizes of the process mesh: `tp`, `pp` and `dp` (world = tp * pp * dp)",
    "tensor_parallel": "split rules `pattern : style` and `sequence_parallel`",
    "pipeline": "the pipeline schedule and how the model is cut into stages",
    "train": "batch, sequence length, optimizer, schedule, data and checkpoints",
    "config": "values passed to the HF config class or to the factory",
    "checkpoint": "where and how often to save: `dir`, `every`",
    "require": "`require CONDITION \"message\"`: a rule of your own, checked like every other",
}


@functools.lru_cache(maxsize=1)
def _sections() -> dict[str, str]:
    """Heading (## or ###) -> its text up to the next heading, code fences removed."""
    try:
        text = LANGUAGE_MD.read_text(encoding="utf-8")
    except OSError:
        return {}
    text = _FENCE.sub("", text)
    heads = list(_HEADING.finditer(text))
    return {m.group(2).strip(): text[m.end(): heads[i + 1].start() if i + 1 < len(heads) else len(text)]
            for i, m in enumerate(heads)}


def _rows(section: str) -> list[tuple[list[str], list[str]]]:
    """(header cells, row cells) of every table row in a section."""
    out: list[tuple[list[str], list[str]]] = []
    header: list[str] | None = None
    for line in _sections().get(section, "").splitlines():
        line = line.strip()
        if not (line.startswith("|") and line.endswith("|")):
            header = None
            continue
        cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line[1:-1])]
        if header is None:
            header = cells
        elif not all(set(c) <= set("-: ") for c in cells):
            out.append((header, cells))
    return out


def _plain(text: str) -> str:
    return _LINK.sub(r"\1", text)


def _unquote(cell: str) -> str:
    return cell.strip("`")


def key_doc(block: str, key: str) -> str | None:
    """Markdown for `block.key` (block "checkpoint" for train.checkpoint's keys), or None if unknown."""
    table = schema.CHECKPOINT_KEYS if block == "checkpoint" else schema.BLOCKS.get(block, {})
    spec_key = table.get(key)
    if spec_key is None:
        return None
    section = "The `train` block" if block == "checkpoint" else f"The `{block}` block"
    title = f"**`{'train.checkpoint' if block == 'checkpoint' else block}.{key}`** — `{spec_key.kind}`"
    for header, cells in _rows(section):
        if header[:1] == ["key"] and _unquote(cells[0]) == key and len(cells) >= 4:
            return f"{title}, default {cells[2]}\n\n{_plain(cells[3])}"
    default = "required" if spec_key.required else f"`{spec_key.default}`"
    return f"{title}, default {default}\n\n{spec_key.doc}"


def option_doc(call: str, option: str) -> str | None:
    """Markdown for an option of a call (`adamw(lr = ...)`, `column(fused = ...)`)."""
    for header, cells in _rows("Call options"):
        if len(cells) >= 5 and _unquote(cells[0]) == call and _unquote(cells[1]) == option:
            return f"**`{call}({option} = ...)`** — {cells[2]}, default {cells[3]}\n\n{_plain(cells[4])}"
    for args in (schema.OPTIMIZER_ARGS, schema.LR_SCHEDULE_ARGS, schema.DATA_ARGS, schema.TP_STYLE_ARGS):
        if option in args.get(call, {}):
            kind, default = args[call][option]
            return f"**`{call}({option} = ...)`** — {kind}, default `{default}`"
    return None


def call_doc(name: str) -> str | None:
    """Markdown for a call or style name: a model source, a data source, a split style, an
    optimizer or LR schedule (with its options)."""
    for section, what in (("The `model` block", "model source"), ("Data sources", "data source"),
                          ("Split styles", "split style")):
        for header, cells in _rows(section):
            m = _CALL_NAME.match(cells[0])
            if m and m.group(1) == name and header[0] in ("source", "style"):
                body = " · ".join(f"{h}: {_plain(c)}" for h, c in zip(header[1:], cells[1:]))
                return f"**`{_unquote(cells[0])}`** — {what}\n\n{body}"
    for kind, args in (("optimizer", schema.OPTIMIZER_ARGS), ("LR schedule", schema.LR_SCHEDULE_ARGS)):
        if name in args:
            opts = ", ".join(f"`{k}` (default `{d}`)" for k, (_, d) in args[name].items())
            return f"**`{name}(...)`** — {kind}\n\noptions: {opts}"
    return None


def block_doc(name: str) -> str | None:
    if name not in BLOCK_DOCS:
        return None
    keys = schema.CHECKPOINT_KEYS if name == "checkpoint" else schema.BLOCKS.get(name, {})
    listed = f"\n\nkeys: {', '.join(f'`{k}`' for k in keys)}" if keys else ""
    return f"**`{name}`** — {BLOCK_DOCS[name]}{listed}"


def config_key_doc(name: str) -> str | None:
    """A config key that check reads as a model dimension (`n_embd` is `hidden`)."""
    for dim, keys in DIM_ALIASES.items():
        if name in keys:
            return (f"**`{name}`** — the model's `{dim}` dimension for check's rules (config keys tried, in order: "
                    f"{', '.join(f'`{k}`' for k in keys)}); usable as `{dim}` in expressions")
    return None
