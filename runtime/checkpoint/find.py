"""Finding checkpoints and checking them without loading them (no torch, no process group: the
launcher uses these too).

A complete checkpoint's ``meta.json`` lists the files it holds, ``"files": {name: {"size": N,
"crc32": C}}`` (the DCP ``.metadata`` and every rank's ``.distcp``; each rank sums its own files
after DCP fsynced them, rank 0 records them), so damage is found from the file system alone:

- *cheap* (`problem`, done by the resume decision on rank 0 and by rotation): ``meta.json``
  readable, every listed file present at its recorded size, ``.metadata``'s checksum;
- *full* (`share_problem`, done by every rank before a load, each a share of the data files):
  the data files' checksums too (a flipped byte inside a tensor's payload loads silently
  otherwise: DCP has no checksum of its own).

Checkpoints written before ``files`` was recorded pass with ``meta.json`` and ``.metadata``
present.
"""

from __future__ import annotations

import json
import re
import zlib
from pathlib import Path
from typing import Any, NamedTuple

META_FILE = "meta.json"
DCP_METADATA = ".metadata"
STEP_RE = re.compile(r"^step-(\d{6,})$")
TMP_RE = re.compile(r"^\.step-(\d{6,})\.tmp-[0-9a-f]+$")
OLD_RE = re.compile(r"^\.step-\d{6,}\.old-[0-9a-f]+$")
_CHUNK = 1 << 20


def step_name(step: int) -> str:
    return f"step-{step:06d}"


def read_meta(path: str | Path) -> dict[str, Any]:
    return json.loads((Path(path) / META_FILE).read_text(encoding="utf-8"))


def crc32_of(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def file_record(path: Path) -> dict[str, int]:
    """What ``meta.json`` records of one file of a checkpoint."""
    return {"size": path.stat().st_size, "crc32": crc32_of(path)}


class Entry(NamedTuple):
    step: int
    path: Path
    tmp: bool  # a save that did not finish (``.step-N.tmp-*``)


def scan(root: str | Path) -> list[Entry]:
    """Every published checkpoint directory (complete or not) and every leftover save under
    `root`, newest first (at one step, the published one first)."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = STEP_RE.match(p.name) or TMP_RE.match(p.name)
        if m and p.is_dir():
            out.append(Entry(int(m.group(1)), p, p.name.startswith(".")))
    return sorted(out, key=lambda e: (-e.step, e.tmp))


def complete_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every published checkpoint under `root` that holds ``meta.json``, oldest
    first (whether its files are intact is `problem`'s question)."""
    return sorted((e.step, e.path) for e in scan(root) if not e.tmp and (e.path / META_FILE).is_file())


def latest_checkpoint(root: str | Path) -> tuple[int, Path] | None:
    """The newest checkpoint with ``meta.json``: the one ``latest`` names if it is the newest,
    else the newest directory (``latest`` may lag by one save if a run died between the rename
    and the pointer update, or hold anything at all)."""
    found = complete_checkpoints(root)
    if not found:
        return None
    try:
        name = (Path(root) / "latest").read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        name = ""
    by_name = {p.name: (s, p) for s, p in found}
    newest = found[-1]
    if name in by_name and by_name[name][0] >= newest[0]:
        return by_name[name]
    return newest


def _meta_problem(path: Path) -> tuple[str | None, dict[str, Any] | None]:
    if not path.is_dir():
        return "it is gone (removed since it was chosen)", None
    if not (path / META_FILE).is_file():
        return f"{META_FILE} is missing", None
    try:
        meta = read_meta(path)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        return f"{META_FILE} is unreadable ({type(exc).__name__}: {str(exc)[:120]})", None
    if not isinstance(meta, dict) or not isinstance(meta.get("step"), int) or "fingerprint" not in meta:
        return f"{META_FILE} is unreadable (no step or fingerprint)", None
    files = meta.get("files")
    if files is not None and not (isinstance(files, dict) and all(
            isinstance(r, dict) and isinstance(r.get("size"), int) for r in files.values())):
        return f"{META_FILE} is unreadable (a bad file list)", None
    return None, meta


def _file_problem(path: Path, name: str, rec: dict[str, int], checksum: bool) -> str | None:
    f = path / name
    try:
        size = f.stat().st_size
    except OSError:
        return f"{name} is missing"
    if size != rec["size"]:
        how = "truncated" if size < rec["size"] else "longer than written"
        return f"{name} is {size} bytes, {META_FILE} records {rec['size']} ({how})"
    if checksum and "crc32" in rec:
        try:
            crc = crc32_of(f)
        except OSError as exc:
            return f"{name} is unreadable ({exc.strerror or exc})"
        if crc != rec["crc32"]:
            return f"{name} is damaged (its checksum differs from the one {META_FILE} records)"
    return None


def problem(path: str | Path) -> tuple[str | None, dict[str, Any] | None]:
    """(why the checkpoint at `path` cannot be used, or None; its meta.json when readable).
    Cheap: reads ``meta.json`` and ``.metadata``, stats the data files."""
    path = Path(path)
    why, meta = _meta_problem(path)
    if why is not None:
        return why, None
    assert meta is not None
    files = meta.get("files")
    if files is None:  # written before meta.json listed the files
        return (None if (path / DCP_METADATA).is_file() else f"{DCP_METADATA} is missing"), meta
    for name in sorted(files, key=lambda n: n != DCP_METADATA):
        why = _file_problem(path, name, files[name], checksum=name == DCP_METADATA)
        if why is not None:
            return why, meta
    return None, meta


def share_problem(path: str | Path, rank: int, world: int) -> tuple[str | None, dict[str, Any] | None]:
    """`problem`, and the checksums of this rank's share of the data files (file i of the
    sorted list on rank i % world): together the ranks read every file once."""
    why, meta = problem(path)
    if why is not None or meta is None or meta.get("files") is None:
        return why, meta
    data = sorted(n for n in meta["files"] if n != DCP_METADATA)
    for i, name in enumerate(data):
        if i % world == rank:
            why = _file_problem(Path(path), name, meta["files"][name], checksum=True)
            if why is not None:
                return why, meta
    return None, meta
