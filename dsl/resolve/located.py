"""The locate pass: every file and package lookup of a spec, done once, before resolve.

`locate` looks up each path the spec's text names on this machine: an ``hf_pretrained``
directory and its config.json, the cost profile (``pipeline.profile``), and the data files and
tokenizer directories of ``train.data`` and ``train.eval.data``. Resolve reads the `Located`
record and never touches the file system itself. A lookup's problem is a diagnostic that
resolve reports where it accepts the value: a path inside an entry that is wrong in another way
is looked up, but not reported (its entry's error is).

The path rules of check are written once here: `outside_error` (E0419) for every file check
does not read under ``--no-model``, `missing_error` (E0410) for a data file or tokenizer
directory that is not there; dsl/data_check.py uses both for the files it reads later.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator, Mapping

import attrs

from .. import ast, schema
from ..diagnostics import Diagnostic, error, warning
from ppdsl.core.locate import PACKAGE_SCHEME, PretrainedDirError, outside, read_pretrained_config, resolve_pretrained_dir
from ..span import Span

__all__ = ["FoundPath", "Located", "OUTSIDE_HINT", "Pretrained", "locate", "missing_error", "outside_error"]

OUTSIDE_HINT = ("with --no-model, check reads no file outside the spec's directory; pass --allow-path DIR to "
                "let it read DIR, or check without --no-model if you trust this spec")
# a file inside an accepted directory (a tokenizer's) that a symbolic link leads out of it
_LEADS_OUTSIDE_HINT = "with --no-model, check reads no file outside the spec's directory"


def outside_error(span: Span | None, subject: str, directory: str | None = None) -> Diagnostic:
    """E0419 (under --no-model check reads only the spec's directory and the --allow-path ones):
    `subject` ("data file 'x.bin'") is not read. `directory`: the accepted directory that
    `subject`, a file inside it, leads out of through a symbolic link (a `package:` tokenizer lies
    outside the spec's directory, so its files are held to the tokenizer directory itself)."""
    if directory is None:
        return error("E0419", span, f"{subject} is outside the spec's directory", label="not read", hint=OUTSIDE_HINT)
    return error("E0419", span, f"{subject} leads outside {directory}", label="not read", hint=_LEADS_OUTSIDE_HINT)


def missing_error(span: Span | None, message: str, hint: str) -> Diagnostic:
    """E0410: a data file or tokenizer directory the spec names is not on this machine: a path
    that does not exist (dsl/data_check.py), or a ``package:NAME`` tokenizer whose package or
    directory cannot be found (here)."""
    return error("E0410", span, message, hint=hint)


@attrs.frozen
class Pretrained:
    """What ``hf_pretrained("target")`` names. `directory`: the absolute directory, None when it
    was not found or (E0419) not looked at; `config`: its config.json, empty when not read;
    `problem`: E0419 or W0401, else None."""

    directory: str | None
    config: Mapping[str, Any]
    problem: Diagnostic | None


@attrs.frozen
class FoundPath:
    """A profile, data file or tokenizer directory: `path` absolute (None where `problem`, E0410,
    says it was not found); `problem`: E0410 or E0419, else None. Whether a data file exists is
    dsl/data_check.py's business, when it reads it."""

    path: str | None
    problem: Diagnostic | None


@attrs.frozen
class Located:
    """Each lookup under the span of the string literal that names it."""

    pretrained: Mapping[Span, Pretrained]
    paths: Mapping[Span, FoundPath]

    @property
    def diagnostics(self) -> tuple[Diagnostic, ...]:
        found = (*self.pretrained.values(), *self.paths.values())
        return tuple(f.problem for f in found if f.problem is not None)


def locate(doc: ast.Document, base_dir: str | os.PathLike[str], roots: tuple[str, ...] | None = None) -> Located:
    """Look up every path `doc` names. `base_dir`: the spec file's directory, where relative paths
    start; `roots`: the directories files may be read from (None: anywhere; see locate.outside)."""
    base = Path(base_dir)
    pretrained: dict[Span, Pretrained] = {}
    paths: dict[Span, FoundPath] = {}
    for block in _blocks(doc.items, "model"):
        for assign in _assigns(block, "source"):
            call = assign.value
            if (isinstance(call, ast.Call) and call.func == "hf_pretrained" and len(call.args) == 1 and not call.kwargs
                    and isinstance(call.args[0], ast.Str)):
                pretrained[call.args[0].span] = _pretrained(call, call.args[0].value, base, roots)
    for block in _blocks(doc.items, "pipeline"):
        for assign in _assigns(block, "profile"):
            if isinstance(assign.value, ast.Str):
                v = assign.value
                paths[v.span] = _spec_file(v, "cost profile", base, roots)
    for block in _blocks(doc.items, "train"):
        for data in (*_assigns(block, "data"), *(d for e in _blocks(block.entries, "eval") for d in _assigns(e, "data"))):
            for key, v in _path_options(data.value):
                if key == "tokenizer" and v.value.startswith(PACKAGE_SCHEME):  # the tokenizer shipped with a model
                    paths[v.span] = _package_tokenizer(v)
                else:
                    what = {"tokenizer": "tokenizer directory", "processor": "image processor directory"}.get(key, "data file")
                    paths[v.span] = _spec_file(v, what, base, roots)
    return Located(pretrained, paths)


def _blocks(items: tuple[Any, ...], kind: str) -> Iterator[ast.Block]:
    return (i for i in items if isinstance(i, ast.Block) and i.kind == kind)


def _assigns(block: ast.Block, key: str) -> Iterator[ast.Assign]:
    return (e for e in block.entries if isinstance(e, ast.Assign) and e.key == key)


def _path_options(value: ast.Expr) -> Iterator[tuple[str, ast.Str]]:
    """The path options (schema.DATA_PATH_ARGS) written as strings in a data source call (or the
    sources of a mix(...))."""
    if isinstance(value, ast.Call) and value.func == "mix":
        for part in value.args:
            yield from _path_options(part)
        return
    if not isinstance(value, ast.Call) or value.func not in schema.DATA_ARGS:
        return
    names = list(schema.DATA_ARGS[value.func])
    given = [(names[i], a) for i, a in enumerate(value.args[:len(names)])] + [(k.name, k.value) for k in value.kwargs]
    for key, v in given:
        if key in schema.DATA_PATH_ARGS and isinstance(v, ast.Str):
            yield key, v


def _spec_file(v: ast.Str, what: str, base: Path, roots: tuple[str, ...] | None) -> FoundPath:
    """A path relative to the spec's directory (``~`` expanded), refused outside `roots`."""
    path = os.path.abspath(base / os.path.expanduser(v.value))
    return FoundPath(path, outside_error(v.span, f"{what} '{v.value}'") if outside(path, roots) else None)


def _package_tokenizer(v: ast.Str) -> FoundPath:
    try:
        return FoundPath(str(resolve_pretrained_dir(v.value, require_config=False)), None)
    except PretrainedDirError as exc:
        return FoundPath(None, missing_error(v.span, f"tokenizer: {exc}",
                                             hint="install the package, or give the tokenizer's directory"))


def _pretrained(call: ast.Call, target: str, base: Path, roots: tuple[str, ...] | None) -> Pretrained:
    """The directory (a relative path against the spec's directory, ``package:NAME`` inside the
    installed package) and its config.json."""
    if not target.startswith(PACKAGE_SCHEME) and outside(base / os.path.expanduser(target), roots):
        return Pretrained(None, {}, outside_error(call.span, f"hf_pretrained: '{target}'"))
    try:
        path = resolve_pretrained_dir(target, require_config=False, base=base)
    except PretrainedDirError as exc:
        return Pretrained(None, {}, warning(
            "W0401", call.span, f"hf_pretrained: {exc}",
            hint="give a local directory holding an HF config.json (relative paths start at the spec's directory), "
                 "or \"package:NAME\" for one shipped inside an installed Python package"))
    try:
        config = read_pretrained_config(path)
    except (OSError, ValueError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        return Pretrained(str(path), {}, warning("W0401", call.span, f"cannot read {path / 'config.json'}: {why}",
                                                 hint="the directory must hold an HF config.json"))
    return Pretrained(str(path), config, None)
