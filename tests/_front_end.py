"""Spec text -> Plan through the real front end, as `ppdsl plan` and `ppdsl run` get theirs:
parse, resolve, check (with the model built on the meta device: its facts are cached for the
session, see conftest.py) and lower. A spec that check refuses fails the test with the rendered
diagnostics. The tests' plan factory (_tiny_models.tiny_plan) composes its spec text and
lowers it here, so every plan a test runs is one a user could write.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest

from ppdsl.dsl.check import check_text
from ppdsl.dsl.render import render_text
from ppdsl.lowering.lower import lower
from ppdsl.lowering.plan import Plan

# no such file: the factories' text has no file of its own; its directory (tests/) is where a
# relative path or a python(...) module would be looked up
SPEC_FILE = str(Path(__file__).resolve().parent / "<test>.ppspec")


@functools.lru_cache(maxsize=None)  # plans are frozen: the same text and world give the same plan
def lower_text(text: str, world: int, model: bool = True) -> Plan:
    result = check_text(text, SPEC_FILE, world=world, model=model)
    if not result.ok:
        pytest.fail(f"check refused the test's spec (world {world}):\n"
                    f"{render_text(result.diagnostics, {SPEC_FILE: text})}\n--- the spec ---\n{text}", pytrace=False)
    return lower(result.spec, world, result.model_info)


def spec_value(value: Any) -> str:
    """A config value written as the spec language writes it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "none"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(spec_value(v) for v in value) + "]"
    if isinstance(value, (int, float)):
        return repr(value)
    raise TypeError(f"no spec syntax for {value!r}")


def pretrained_source(directory: str | Path) -> str:
    """The model source that reads a checkpoint directory's weights."""
    return f"hf_pretrained({spec_value(str(directory))})"


__all__ = ["SPEC_FILE", "lower_text", "pretrained_source", "spec_value"]
