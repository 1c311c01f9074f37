"""Tables of rows on the local disk: what ``hf_dataset(path, ...)`` reads. Written once for both
readers, `ppdsl check`'s bounded sample (dsl/data_check_tables.py) and the ranks' whole read
(runtime/data/docs.py, runtime/data/files.py).

Stdlib at import. pyarrow is imported only to read a Parquet or Arrow file (about 0.25 s, against
about 1 s for the `datasets` library, which is not used: pyarrow reads what
``datasets.Dataset.save_to_disk`` writes, and nothing here touches the Hugging Face Hub or a
cache directory). Nothing is ever downloaded.

What a path names (`find_table`), relative paths already made absolute against the spec's
directory:

- a directory written by ``datasets.DatasetDict.save_to_disk`` (it holds ``dataset_dict.json``):
  the split ``split`` (default ``"train"``), itself a Dataset directory;
- a directory written by ``datasets.Dataset.save_to_disk`` (``state.json``): its Arrow files,
  in the order ``state.json`` lists them;
- any other directory: its ``*.parquet`` files (or, without any, its ``*.arrow``, else its
  ``*.jsonl`` / ``*.json`` files, else its ``*.csv``), sorted by name;
- one ``.parquet``, ``.arrow`` (IPC file or stream format), ``.jsonl`` / ``.json`` (JSON lines)
  or ``.csv`` (a header row, then one row per record; every value a string) file; another name
  is recognised by its first bytes (not CSV);
- a glob pattern (``*``, ``?``, ``[...]``) matching such files, sorted by name, all of one format.

Rows are read in that order: file by file, each from its first row. A problem is a `TableError`
(a ValueError) whose `why` says which rule it breaks, for check's diagnostics.
"""

from __future__ import annotations

import glob
import json
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["BATCH_ROWS", "Table", "TableError", "count_rows", "file_columns", "find_table", "hub_like",
           "iter_rows", "jsonl_lines", "require_columns", "row_place"]

BATCH_ROWS = 1024  # rows per record batch read from a Parquet file
SUFFIXES = {".parquet": "parquet", ".arrow": "arrow", ".jsonl": "jsonl", ".json": "jsonl", ".csv": "csv"}
FORMAT_NAMES = {"parquet": "Parquet", "arrow": "Arrow", "jsonl": "JSON-lines", "csv": "CSV"}
LINES = ("jsonl", "csv")  # text formats: rows are numbered by line, their fields checked row by row
DATA_HINT = "pip install 'ppdsl[data]' (or pip install pyarrow) where check and the run take place"
# a Hub dataset id: "name" or "owner/name" (letters, digits, - _ .), no file suffix of ours
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?")


class TableError(ValueError):
    """What is wrong with a table, for a message and a diagnostic. `why`:

    - ``missing``: a path, a glob's files, a split or a listed file does not exist (E0410);
    - ``hub``: a missing path that looks like a Hugging Face Hub dataset name (E0410);
    - ``unreadable``: not a regular file or directory, or it cannot be read or opened as its
      format (a corrupt Parquet shard) (E0411);
    - ``empty``: a file of 0 bytes, or a directory without data files (E0414);
    - ``malformed``: a JSON line that is not an object, a column or field that is missing or
      not a string, `split` for what is not a DatasetDict, formats mixed (E0416);
    - ``pyarrow``: pyarrow, needed for Parquet and Arrow files, is not installed (E0431).

    `option`: the call option it is about (path, split, text, label); `columns`: the columns
    the file has (a missing column's message); `hint`: how to fix it."""

    def __init__(self, why: str, message: str, option: str = "path", hint: str = "",
                 columns: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.why, self.message, self.option, self.hint, self.columns = why, message, option, hint, tuple(columns)


@dataclass(frozen=True)
class Table:
    """What a path names: its `format` (parquet | arrow | jsonl | csv) and its `files`, in reading order.
    `what` describes it for messages ("Parquet folder 'x'")."""

    path: str
    format: str
    files: tuple[str, ...]
    what: str


def hub_like(written: str) -> bool:
    """Whether a path as written looks like a Hugging Face Hub dataset id ("wikitext",
    "HuggingFaceFW/fineweb-edu"): no leading ./ / ~, no glob, no data-file suffix."""
    return bool(_HUB_ID.fullmatch(written)) and os.path.splitext(written)[1].lower() not in SUFFIXES


def _no_such(path: str, show: Callable[[str], str], written: str | None) -> TableError:
    if written is not None and hub_like(written):
        return TableError(
            "hub", f"'{written}' is not a file or directory on this machine ({show(path)}): hf_dataset reads local "
                   "files only and downloads nothing",
            hint=f"relative paths are relative to the spec's directory; if '{written}' names a Hugging Face Hub "
                 f"dataset, save it to a local directory once, e.g. datasets.load_dataset(\"{written}\")"
                 f".save_to_disk(\"data/{written.rpartition('/')[2]}\"), and name that directory")
    return TableError("missing", f"'{show(path)}' does not exist (hf_dataset reads local data only)",
                      hint="relative paths are relative to the spec's directory")


def find_table(path: str, split: str | None = None, show: Callable[[str], str] = str,
               written: str | None = None) -> Table:
    """The table `path` names (see the module docstring); `split`: a DatasetDict's split (None:
    "train"); `show`: how messages put a path; `written`: the path as the spec wrote it (relative
    to the spec's directory), to recognise a Hub name. TableError when it names none."""
    if not os.path.lexists(path):
        if any(c in path for c in "*?["):
            return _globbed(path, split, show)
        raise _no_such(path, show, written)
    if os.path.isdir(path):
        return _directory(path, split, show)
    if not os.path.isfile(path):
        what = "a broken symbolic link" if os.path.islink(path) and not os.path.exists(path) else "not a regular file"
        raise TableError("unreadable", f"'{show(path)}' is {what}",
                         hint="name a .parquet, .arrow or .jsonl file, a directory of them, or a save_to_disk directory")
    _no_split(split, path, show, "a single file")
    fmt = _format_of(path, show)
    return Table(path, fmt, (path,), f"{FORMAT_NAMES[fmt]} file '{show(path)}'")


def _no_split(split: str | None, path: str, show: Callable[[str], str], what: str) -> None:
    if split is not None:
        raise TableError("malformed", f"split = \"{split}\" chooses a split of a DatasetDict saved with save_to_disk, "
                         f"but '{show(path)}' is {what}", option="split",
                         hint="leave split out, or name the directory that holds dataset_dict.json")


def _globbed(pattern: str, split: str | None, show: Callable[[str], str]) -> Table:
    files = sorted(f for f in glob.glob(pattern) if os.path.isfile(f))
    if not files:
        raise TableError("missing", f"no file matches '{show(pattern)}'",
                         hint="relative patterns are relative to the spec's directory")
    _no_split(split, pattern, show, "a glob of files")
    formats = {_format_of(f, show) for f in files}
    if len(formats) > 1:
        raise TableError("malformed", f"'{show(pattern)}' matches files of several formats "
                         f"({', '.join(sorted(FORMAT_NAMES[f] for f in formats))})",
                         hint="a glob names shards of one format, e.g. \"data/*.parquet\"")
    fmt = formats.pop()
    return Table(pattern, fmt, tuple(files), f"{len(files)} {FORMAT_NAMES[fmt]} file(s) matching '{show(pattern)}'")


def _directory(path: str, split: str | None, show: Callable[[str], str]) -> Table:
    marker = os.path.join(path, "dataset_dict.json")
    if os.path.isfile(marker):
        splits = _json_field(marker, "splits", show)
        if not isinstance(splits, list) or not all(isinstance(s, str) for s in splits):
            raise TableError("malformed", f"'{show(marker)}' lists no splits", hint="write it with DatasetDict.save_to_disk")
        name = "train" if split is None else split
        if name not in splits:
            listed = ", ".join(repr(s) for s in splits if re.fullmatch(r"[\w.-]{1,32}", s)) or "none"
            raise TableError("missing", f"'{show(path)}' has no split '{name}' (splits: {listed})",
                             option="split" if split is not None else "path",
                             hint="choose one with split = \"...\"")
        inner = os.path.join(path, name)
        if not os.path.isfile(os.path.join(inner, "state.json")):
            raise TableError("missing", f"split '{name}' of '{show(path)}' has no state.json ({show(inner)})",
                             hint="write the dataset with DatasetDict.save_to_disk")
        table = _saved(inner, show)
        return Table(path, table.format, table.files, f"split '{name}' of the dataset '{show(path)}'")
    if os.path.isfile(os.path.join(path, "state.json")):
        _no_split(split, path, show, "a Dataset (not a DatasetDict) saved with save_to_disk")
        return _saved(path, show)
    _no_split(split, path, show, "a directory of data files")
    try:
        names = sorted(os.listdir(path))
    except OSError as exc:
        raise TableError("unreadable", f"cannot list '{show(path)}': {exc.strerror or exc}") from None
    by_format: dict[str, list[str]] = {}
    for n in names:
        fmt = SUFFIXES.get(os.path.splitext(n)[1].lower())
        full = os.path.join(path, n)
        if fmt is not None and not n.startswith(".") and os.path.isfile(full):
            by_format.setdefault(fmt, []).append(full)
    for fmt in ("parquet", "arrow", "jsonl", "csv"):
        if fmt in by_format:
            files = tuple(by_format[fmt])
            return Table(path, fmt, files, f"{FORMAT_NAMES[fmt]} folder '{show(path)}' ({len(files)} file(s))")
    raise TableError("empty", f"directory '{show(path)}' holds no .parquet, .arrow or .jsonl file, and no dataset "
                     "saved with save_to_disk", hint="name the directory that holds the data files, or a glob")


def _saved(path: str, show: Callable[[str], str]) -> Table:
    """A Dataset directory of save_to_disk: the Arrow files state.json lists."""
    state = os.path.join(path, "state.json")
    listed = _json_field(state, "_data_files", show)
    if not isinstance(listed, list) or not all(isinstance(e, dict) and isinstance(e.get("filename"), str)
                                               for e in listed):
        raise TableError("malformed", f"'{show(state)}' lists no data files", hint="write it with save_to_disk")
    files = []
    for e in listed:
        name = e["filename"]
        full = os.path.normpath(os.path.join(path, name))
        if os.path.dirname(full) != os.path.normpath(path):
            raise TableError("malformed", f"'{show(state)}' lists a data file outside its directory")
        if not os.path.lexists(full):
            raise TableError("missing", f"'{show(full)}', listed in {show(state)}, does not exist",
                             hint="copy the whole directory that save_to_disk wrote")
        files.append(full)
    return Table(path, "arrow", tuple(files), f"dataset '{show(path)}'")


def _json_field(path: str, key: str, show: Callable[[str], str]) -> Any:
    try:
        with open(path, "rb") as f:
            doc = json.loads(f.read(1 << 20))
    except OSError as exc:
        raise TableError("unreadable", f"cannot read '{show(path)}': {exc.strerror or exc}") from None
    except ValueError:
        raise TableError("malformed", f"'{show(path)}' is not JSON", hint="write it with save_to_disk") from None
    return doc.get(key) if isinstance(doc, dict) else None


def _format_of(path: str, show: Callable[[str], str]) -> str:
    fmt = SUFFIXES.get(os.path.splitext(path)[1].lower())
    if fmt is not None:
        return fmt
    try:
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError as exc:
        raise TableError("unreadable", f"cannot read '{show(path)}': {exc.strerror or exc}") from None
    if head.startswith(b"PAR1"):
        return "parquet"
    if head.startswith(b"ARROW1") or head.startswith(b"\xff\xff\xff\xff"):
        return "arrow"
    if head.lstrip()[:1] == b"{":
        return "jsonl"
    raise TableError("unreadable", f"'{show(path)}' is not a Parquet, Arrow or JSON-lines file",
                     hint="name a .parquet, .arrow or .jsonl file")


# ---------------------------------------------------------------------------------------------
# reading
# ---------------------------------------------------------------------------------------------


def row_place(table: Table, file: str, number: int, show: Callable[[str], str] = str) -> str:
    """Where a row is, for messages: "line 12 of 'a.jsonl'" (lines from 1) or "row 12 of
    'a.parquet'" (rows from 0, as dataset[12])."""
    return f"{'line' if table.format in LINES else 'row'} {number} of '{show(file)}'"


def _pyarrow(table: Table) -> Any:
    try:
        import pyarrow  # noqa: F401
        import pyarrow.ipc  # noqa: F401
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise TableError("pyarrow", f"reading {table.what} needs pyarrow, which is not installed",
                         hint=DATA_HINT) from None
    return pyarrow


def _arrow_failure(file: str, fmt: str, exc: BaseException, show: Callable[[str], str]) -> TableError:
    if isinstance(exc, (PermissionError, FileNotFoundError, IsADirectoryError)):
        return TableError("unreadable", f"cannot read '{show(file)}': {exc.strerror or exc}")
    reason = (str(exc).strip().splitlines() or [""])[0][:160]
    return TableError("unreadable", f"'{show(file)}' cannot be read as a {FORMAT_NAMES[fmt]} file "
                      f"({type(exc).__name__}{': ' + reason if reason else ''})",
                      hint="the file is cut short or corrupt: write it again (or leave it out of the glob)")


def _check_size(file: str, show: Callable[[str], str]) -> None:
    try:
        size = os.path.getsize(file)
    except OSError as exc:
        raise TableError("unreadable", f"cannot read '{show(file)}': {exc.strerror or exc}") from None
    if size == 0:
        raise TableError("empty", f"'{show(file)}' is empty (0 bytes)", hint="write the data again, or leave it out")


def _record_batches(table: Table, file: str, columns: Sequence[str] | None, show: Callable[[str], str]) -> Iterator[Any]:
    """The record batches of a Parquet or Arrow file (only `columns`, None: all)."""
    pa = _pyarrow(table)
    _check_size(file, show)
    try:
        if table.format == "parquet":
            pf = pa.parquet.ParquetFile(file, memory_map=True)
            for batch in pf.iter_batches(batch_size=BATCH_ROWS, columns=list(columns) if columns is not None else None):
                yield batch
            return
        source = pa.memory_map(file, "r")
        magic = source.read(6)
        source.seek(0)
        if magic == b"ARROW1":
            reader = pa.ipc.open_file(source)
            batches: Any = (reader.get_batch(i) for i in range(reader.num_record_batches))
        else:
            batches = pa.ipc.open_stream(source)
        for batch in batches:
            yield batch if columns is None else batch.select(list(columns))
    except TableError:
        raise
    except (OSError, pa.lib.ArrowException, ValueError) as exc:
        raise _arrow_failure(file, table.format, exc, show) from None


def file_columns(table: Table, file: str, show: Callable[[str], str] = str) -> dict[str, str] | None:
    """column name -> its Arrow type (as text) of a Parquet or Arrow file, from its schema
    (cheap: no data is read); None for JSON lines and CSV (checked row by row)."""
    if table.format in LINES:
        _check_size(file, show)
        return None
    pa = _pyarrow(table)
    _check_size(file, show)
    try:
        if table.format == "parquet":
            schema = pa.parquet.ParquetFile(file, memory_map=True).schema_arrow
        else:
            source = pa.memory_map(file, "r")
            magic = source.read(6)
            source.seek(0)
            schema = (pa.ipc.open_file(source) if magic == b"ARROW1" else pa.ipc.open_stream(source)).schema
    except (OSError, pa.lib.ArrowException, ValueError) as exc:
        raise _arrow_failure(file, table.format, exc, show) from None
    return {f.name: str(f.type) for f in schema}


def count_rows(table: Table, file: str, show: Callable[[str], str] = str, limit: int | None = None,
               max_line: int | None = None) -> int:
    """Rows of one file: a Parquet footer's count, an Arrow file's record batch lengths (memory
    mapped, no data copied), non-blank JSON lines (up to `limit`, None: all; `max_line` as
    `jsonl_lines`)."""
    if table.format in LINES:
        n = 0
        for _ in _lines(table, file, show, max_line):
            n += 1
            if limit is not None and n >= limit:
                break
        return n
    pa = _pyarrow(table)
    if table.format == "parquet":
        _check_size(file, show)
        try:
            return int(pa.parquet.ParquetFile(file, memory_map=True).metadata.num_rows)
        except (OSError, pa.lib.ArrowException, ValueError) as exc:
            raise _arrow_failure(file, table.format, exc, show) from None
    return sum(b.num_rows for b in _record_batches(table, file, [], show))


def _lines(table: Table, file: str, show: Callable[[str], str], max_line: int | None) -> Iterator[tuple[int, Any]]:
    return jsonl_lines(file, show, max_line) if table.format == "jsonl" else csv_rows(file, show)


def csv_rows(file: str, show: Callable[[str], str] = str) -> Iterator[tuple[int, Any]]:
    """(line number, row as a dict of the header's names) of each record of a CSV file (the line
    where the record ends; a missing trailing value is None). TableError when the file cannot be
    read, is not UTF-8 or is not CSV."""
    import csv

    try:
        with open(file, encoding="utf-8", newline="") as f:
            reader = csv.DictReader(f)
            for row in reader:
                yield reader.line_num, row
    except UnicodeDecodeError as exc:
        raise TableError("malformed", f"'{show(file)}' is not UTF-8 text (byte {exc.start})",
                         hint="convert the file to UTF-8") from None
    except csv.Error as exc:
        raise TableError("malformed", f"'{show(file)}' is not CSV: {exc}",
                         hint="a header row, then one row per record") from None
    except OSError as exc:
        raise TableError("unreadable", f"cannot read '{show(file)}': {exc.strerror or exc}") from None


def jsonl_lines(file: str, show: Callable[[str], str] = str, max_line: int | None = None) -> Iterator[tuple[int, Any]]:
    """(line number, JSON value) of each non-blank line of a JSON-lines file. `max_line`: a longer
    line is an error (check reads a bounded head), None: no limit. ValueError naming the line for
    one that is not JSON, TableError when the file cannot be read or is not UTF-8."""
    try:
        with open(file, "rb") as f:
            lineno = 0
            while True:
                raw = f.readline() if max_line is None else f.readline(max_line + 1)
                if not raw:
                    return
                lineno += 1
                if max_line is not None and len(raw) > max_line and not raw.endswith(b"\n"):
                    raise TableError("malformed", f"line {lineno} of '{show(file)}' is longer than {max_line:,} bytes",
                                     hint="one JSON object per line")
                if not raw.strip():
                    continue
                try:
                    value = json.loads(raw)
                except UnicodeDecodeError as exc:
                    raise TableError("malformed", f"line {lineno} of '{show(file)}' is not UTF-8 text "
                                     f"(byte {exc.start})", hint="convert the file to UTF-8") from None
                except ValueError as exc:
                    raise TableError("malformed", f"line {lineno} of '{show(file)}' is not JSON: {exc}",
                                     hint="a JSON-lines file holds one JSON object per line") from None
                yield lineno, value
    except OSError as exc:
        raise TableError("unreadable", f"cannot read '{show(file)}': {exc.strerror or exc}") from None


def require_columns(table: Table, file: str, fields: Mapping[str, str], strings: Sequence[str] = ("text",),
                    show: Callable[[str], str] = str) -> dict[str, str] | None:
    """A Parquet or Arrow file's columns (`file_columns`), each of `fields` (option -> column
    name) among them, of strings for the options in `strings`; TableError (`malformed`, about
    that option) otherwise. None for JSON lines: their fields are checked row by row."""
    have = file_columns(table, file, show)
    for option, name in fields.items() if have is not None else ():
        if name not in have:
            raise TableError("malformed", f"'{show(file)}' has no column '{name}'", option=option,
                             columns=list(have), hint=f"name the {option} column with {option} = \"...\"")
        if option in strings and have[name] not in ("string", "large_string", "string_view"):
            raise TableError("malformed", f"column '{name}' of '{show(file)}' holds {have[name]}, not strings",
                             option=option, hint=f"name the {option} column with {option} = \"...\"")
    return have


def iter_rows(table: Table, fields: Mapping[str, str], show: Callable[[str], str] = str, limit: int | None = None,
              max_line: int | None = None, strings: Sequence[str] = ("text",)) -> Iterator[tuple[str, int, tuple[Any, ...]]]:
    """(file, row number, values) of every row, in reading order, up to `limit` rows (None: all).
    `fields`: option -> column name (``{"text": "text"}``), the values in that order; a missing
    column or field, a null, or (for the options in `strings`) a value that is not a string is a
    TableError (`malformed`, about that option). Rows of JSON lines count from 1 (line numbers),
    of Parquet and Arrow files from 0 in each file."""
    options, names = list(fields), [fields[o] for o in fields]
    done = 0
    for file in table.files:
        if limit is not None and done >= limit:
            return
        if table.format in LINES:
            _check_size(file, show)
            for lineno, row in _lines(table, file, show, max_line):
                if not isinstance(row, dict):
                    raise TableError("malformed", f"line {lineno} of '{show(file)}' is a JSON {type(row).__name__}, "
                                     "not an object", hint='each line is an object such as {"text": "..."}')
                values = tuple(row.get(n) for n in names)
                _values_ok(table, file, lineno, options, names, values, strings, show, list(row))
                yield file, lineno, values
                done += 1
                if limit is not None and done >= limit:
                    return
            continue
        require_columns(table, file, fields, strings, show)
        row = 0
        for batch in _record_batches(table, file, names, show):
            columns = [batch.column(i).to_pylist() for i in range(len(names))]
            for values in zip(*columns):
                _values_ok(table, file, row, options, names, values, strings, show, names)
                yield file, row, values
                row += 1
                done += 1
                if limit is not None and done >= limit:
                    return


def _values_ok(table: Table, file: str, number: int, options: list[str], names: list[str], values: tuple[Any, ...],
               strings: Sequence[str], show: Callable[[str], str], fields: list[str]) -> None:
    for option, name, v in zip(options, names, values):
        if v is None:
            where = row_place(table, file, number, show)
            missing = table.format in LINES
            raise TableError("malformed", f"{where} has no field '{name}'" if missing else f"{where}: '{name}' is null",
                             option=option, columns=fields if missing else (),
                             hint=f"name the {option} field with {option} = \"...\"" if missing else
                                  "drop or fill the rows without a value")
        if option in strings and not isinstance(v, str):
            raise TableError("malformed", f"field '{name}' on {row_place(table, file, number, show)} is not a string",
                             option=option)
