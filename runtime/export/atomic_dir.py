"""An export's destination, written atomically: everything goes to a hidden sibling
``.OUT.tmp-XXXX`` that is renamed to OUT at the end, so a crash never leaves a half-written OUT.
An existing OUT that is not empty is refused unless ``force`` replaces an earlier export (one
that holds `EXPORT_MARKER`), again by renames.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    pass



EXPORT_MARKER = "ppdsl_export.json"  # in every export: `--force` replaces only a directory that holds it
FINAL_DIR = "final"  # where a run leaves its trained model, inside the run directory


class ExportError(ValueError):
    """An export that cannot be made: a bad run directory, an occupied OUT_DIR, ..."""


# ---------------------------------------------------------------------------------------------
# The destination, written atomically
# ---------------------------------------------------------------------------------------------


def check_destination(out: Path, force: bool) -> None:
    """ExportError unless ``out`` can be written: absent, empty, or (with ``force``) an
    earlier export. Nothing is created here."""
    try:
        if out.exists() and not out.is_dir():
            raise ExportError(f"OUT_DIR {out} exists and is not a directory")
        if out.is_dir() and any(out.iterdir()):
            if not force:
                raise ExportError(f"OUT_DIR {out} exists and is not empty (pass --force to replace an earlier export)")
            if not (out / EXPORT_MARKER).is_file():
                raise ExportError(f"OUT_DIR {out} holds files and is not an earlier ppdsl export (no {EXPORT_MARKER}): "
                                  "ppdsl never replaces it")
    except OSError as exc:
        raise ExportError(f"cannot use OUT_DIR {out}: {exc}") from None


def check_final_destination(run_dir: str | os.PathLike[str]) -> None:
    """Before training: ExportError when the run could not write ``RUN_DIR/final`` at its end."""
    final = Path(run_dir) / FINAL_DIR
    try:
        check_destination(final, True)
    except ExportError as exc:
        raise ExportError(f"the run would end by writing its model to {final}, but: {exc}. Move it away, "
                          "choose another --out, or set train.save_final = false") from None


@contextmanager
def atomic_dir(out: Path, force: bool) -> Iterator[Path]:
    """A fresh hidden sibling of ``out`` to write into; renamed to ``out`` when the block
    succeeds, removed when it fails."""
    parent = out.resolve().parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ExportError(f"cannot create {parent}: {exc}") from None
    for stale in (*parent.glob(f".{out.name}.tmp-*"), *parent.glob(f".{out.name}.old-*")):
        shutil.rmtree(stale, ignore_errors=True)  # what an export killed midway left behind
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=parent))
    try:
        yield tmp
        umask = _umask()
        for f in tmp.rglob("*"):
            if f.is_file():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
                os.chmod(f, 0o666 & ~umask)  # safetensors writes 0600: make it an ordinary file
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it 0700
        _publish(tmp, out, force)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _umask() -> int:
    current = os.umask(0o022)
    os.umask(current)
    return current


def _publish(tmp: Path, out: Path, force: bool) -> None:
    if out.is_dir():
        if not any(out.iterdir()):
            out.rmdir()
        elif not force:
            raise ExportError(f"OUT_DIR {out} exists and is not empty (pass --force to replace it)")
        else:
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.resolve().parent))
            old.rmdir()
            os.rename(out, old)
            try:
                os.rename(tmp, out)
            except BaseException:
                os.rename(old, out)  # put the previous export back
                raise
            shutil.rmtree(old, ignore_errors=True)
            return
    os.rename(tmp, out)
