"""The identity of the data files a run reads, which checkpoints record: a resume whose file
differs warns (runtime/checkpoint/resume.py)."""

from __future__ import annotations

import hashlib
import os
from typing import Any

from ppdsl.lowering.plan import Plan

__all__ = ["changed_data_files", "data_file_identities", "file_identity", "folder_identity"]


DIGEST_BYTES = 1 << 20  # the digest reads this much at each end of a file


def file_identity(path: str) -> dict[str, Any] | None:
    """Size and a SHA-256 of the first and last `DIGEST_BYTES` (cheap for a large token file;
    an edit in the middle that keeps the size is not seen); a folder (`image_folder`): the
    `folder_identity`. None: not a readable file."""
    if os.path.isdir(path):
        return folder_identity(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            h = hashlib.sha256(f.read(DIGEST_BYTES))
            if size > DIGEST_BYTES:
                f.seek(max(DIGEST_BYTES, size - DIGEST_BYTES))
                h.update(f.read(DIGEST_BYTES))
    except OSError:
        return None
    return {"size": size, "sha256_ends": h.hexdigest()}


def folder_identity(path: str) -> dict[str, Any] | None:
    """An image folder's files (hidden ones left out): their count, total size and a SHA-256 of the
    sorted (relative path, size) list. No file is read, so it is cheap for many images; an image
    rewritten in place at the same size is not seen."""
    listing = []
    try:
        for top, dirs, files in os.walk(path):
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            for name in files:
                if not name.startswith("."):
                    full = os.path.join(top, name)
                    listing.append((os.path.relpath(full, path), os.path.getsize(full)))
    except OSError:
        return None
    h = hashlib.sha256()
    for rel, n in sorted(listing):
        h.update(f"{rel}\0{n}\n".encode())
    return {"size": sum(n for _, n in listing), "files": len(listing), "sha256_listing": h.hexdigest()}


def data_file_identities(plan: Plan) -> dict[str, Any]:
    """path -> `file_identity` of each file train.data and train.eval.data read (each file of an
    `hf_dataset` folder, glob or save_to_disk directory; an `image_folder` as one folder)."""
    from ppdsl.runtime.data.mix import parts_of

    sources = [plan.train.data] + ([plan.train.eval.data] if plan.train.eval is not None else [])
    sources = [part for d in sources for part in parts_of(d)]  # each source of a mix(...)
    paths: list[str] = []
    for d in sources:
        opts = d.options_dict
        path = opts.get("path")
        if d.kind == "synthetic" or not isinstance(path, str):
            continue
        if d.kind == "hf_dataset":
            from ppdsl.core.tables import TableError, find_table

            try:
                paths += find_table(path, opts.get("split")).files
            except TableError:
                paths.append(path)  # recorded as unreadable (None): a resume does not compare it
        else:
            paths.append(path)
    return {p: file_identity(p) for p in paths}


def changed_data_files(saved: dict[str, Any], checkpoint: Any) -> list[str]:
    """Warning lines for a resume: the data files the checkpoint's run read that are missing
    now or differ (the resumed steps would read other samples than the saved run's)."""
    out = []
    for path, was in sorted(saved.items()):
        now = file_identity(path)
        if was is None or now == was:
            continue
        if now is None:
            out.append(f"ppdsl: warning: data file {path}, which the run of checkpoint {checkpoint} read, "
                       "is missing now")
        else:
            how = f"{was['size']} -> {now['size']} bytes" if now["size"] != was["size"] else "same size, other contents"
            out.append(f"ppdsl: warning: data file {path} changed since the run of checkpoint {checkpoint} read it "
                       f"({how}); the resumed run reads other samples than that run would")
    return out
