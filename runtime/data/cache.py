"""Token ids of a document source, tokenized once and memory-mapped by every rank.

The sources that tokenize (``hf_dataset`` documents for a causal LM, ``text``) write their ids
once into an entry of three files and every later start, and every rank, maps them:

- ``<base>.tokens``: the ids, one document after another (each with its separator, when the
  source adds one), raw uint16 (a vocabulary of at most 65536 ids) or uint32;
- ``<base>.starts``: raw int64, ``documents + 1`` offsets: document d is
  ``tokens[starts[d] : starts[d + 1]]``;
- ``<base>.json``: what the entry holds (its key, dtype, counts, the tokenizer's pad and separator
  ids). Written last, by an atomic rename: it is the done marker.

The key (``<base>`` ends with its digest): each data file's absolute path, size and mtime; each
file of the tokenizer directory (weights excluded) by name, size and mtime; the fields read; the
tokenizers / transformers versions and this module's `FORMAT`. A data file or tokenizer that
changes is a new key, so a stale entry is never read; once the new one is built, the old entries
of the same source (same data path, tokenizer and fields) are removed.

Where: beside the data (``.ppdsl-cache/`` in the folder of its first file), else, when that
cannot be written, in the user's cache folder (``ppdsl.core.user_cache``: ``$PPDSL_CACHE_DIR``,
``$XDG_CACHE_HOME/ppdsl`` or ``~/.cache/ppdsl``), in ``data-tokens-v<FORMAT>/``. With
``PPDSL_NO_CACHE=1``, or where neither can be written, each process tokenizes into a temporary
file of its own, removed at once (mapped all the same).

One process builds: the builder holds an exclusive `flock` on ``<base>.lock`` (released by the
kernel if it dies), the others wait on it, then find the done marker and map the entry. A wait
longer than ``$PPDSL_DATA_CACHE_TIMEOUT`` seconds (default 3600) ends the run (`RunFault`) naming
the lock and the process that holds it. Tokenizing streams: the builder holds one chunk of rows
at a time, never the corpus.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import itertools
import json
import os
import re
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from ppdsl.core.user_cache import caching_off, user_cache_root

from ppdsl.runtime.run.failure import RunFault

__all__ = ["BESIDE", "FORMAT", "Tokenized", "Writer", "cache_folders", "cached_tokens"]

FORMAT = 1
BESIDE = ".ppdsl-cache"  # the folder beside the data
SUBDIR = f"data-tokens-v{FORMAT}"  # the folder in the user's cache
TIMEOUT_ENV = "PPDSL_DATA_CACHE_TIMEOUT"
TIMEOUT_S = 3600.0
_POLL_S = 0.1
_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".onnx", ".ckpt", ".gguf", ".npz")


@dataclass(frozen=True)
class Tokenized:
    """A mapped entry: `tokens` (1-D ids) and `starts` (int64, documents + 1), `meta` its json."""

    tokens: Any
    starts: Any
    meta: Mapping[str, Any]
    where: str  # the token file ("" for a temporary one)

    @property
    def documents(self) -> int:
        return int(self.starts.shape[0]) - 1

    def document(self, d: int) -> Any:
        return self.tokens[int(self.starts[d]) : int(self.starts[d + 1])]


class Writer:
    """What a build writes to: `begin` with the vocabulary size, then `add` documents in order."""

    def __init__(self, tokens: IO[bytes], starts: IO[bytes]) -> None:
        self._tokens, self._starts = tokens, starts
        self.dtype: Any = None
        self.count = 0  # ids written
        self.documents = 0
        np.zeros(1, dtype=np.int64).tofile(starts)

    def begin(self, vocab_size: int) -> None:
        self.dtype = np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)

    def add(self, docs: Sequence[Sequence[int]]) -> None:
        if not docs:
            return
        lengths = np.fromiter((len(d) for d in docs), dtype=np.int64, count=len(docs))
        total = int(lengths.sum())
        np.fromiter(itertools.chain.from_iterable(docs), dtype=self.dtype, count=total).tofile(self._tokens)
        (self.count + np.cumsum(lengths)).tofile(self._starts)
        self.count += total
        self.documents += len(docs)


Build = Callable[[Writer], Mapping[str, Any]]  # writes the documents; returns what meta keeps


def cache_folders(first_file: str) -> list[Path]:
    """Where an entry may live, in order: beside the data, then the user's cache."""
    return [Path(os.path.abspath(first_file)).parent / BESIDE, user_cache_root() / SUBDIR]


def cached_tokens(name: str, files: Sequence[str], tokenizer: str, fields: Mapping[str, Any], build: Build) -> Tokenized:
    """The entry of source `name` (its path as written) reading `files` with the tokenizer
    directory `tokenizer` and `fields`: mapped if built, else built by `build` first (one process;
    the others wait). ValueError from `build` (bad data) passes through, nothing cached."""
    key = _key(files, tokenizer, fields)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    slot = hashlib.sha256(json.dumps([os.path.abspath(name), os.path.abspath(tokenizer), dict(fields)],
                                     sort_keys=True).encode()).hexdigest()
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", os.path.basename(name.rstrip("/")) or "data")[:48]
    prefix = f"{stem}-{slot[:8]}-"
    base = prefix + digest[:16]
    if caching_off() or not files:
        return _build_temporary(build)
    for folder in cache_folders(files[0]):
        hit = _open(folder, base, digest)
        if hit is not None:
            return hit
        try:
            folder.mkdir(parents=True, exist_ok=True)
            lock = os.open(folder / f"{base}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            continue  # not writable here: the next folder
        try:
            _acquire(lock, folder / f"{base}.lock", name)
            hit = _open(folder, base, digest)  # built by another process while this one waited
            if hit is not None:
                return hit
            try:
                _build_into(folder, base, key, digest, build)
            except OSError:
                continue  # full, or read-only after all: the next folder
            _remove_stale(folder, prefix, base)
            hit = _open(folder, base, digest)
            if hit is not None:
                return hit
        finally:
            os.close(lock)  # releases the flock
    return _build_temporary(build)


# ---------------------------------------------------------------------------------------------
# key, lock, build, open
# ---------------------------------------------------------------------------------------------


def _stat(path: str) -> list[Any]:
    st = os.stat(path)
    return [os.path.abspath(path), st.st_size, st.st_mtime_ns]


def _key(files: Sequence[str], tokenizer: str, fields: Mapping[str, Any]) -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    def v(dist: str) -> str | None:
        try:
            return version(dist)
        except PackageNotFoundError:
            return None

    tok_files = []
    if os.path.isdir(tokenizer):
        for entry in sorted(os.scandir(tokenizer), key=lambda e: e.name):
            if entry.is_file() and not entry.name.endswith(_WEIGHTS):
                tok_files.append(_stat(entry.path))
    return {"format": FORMAT, "files": [_stat(f) for f in files], "tokenizer": tok_files, "fields": dict(fields),
            "tokenizers": v("tokenizers"), "transformers": v("transformers")}


def _acquire(fd: int, lock: Path, name: str) -> None:
    """The exclusive build lock, waiting at most the timeout."""
    try:
        wait = float(os.environ.get(TIMEOUT_ENV, TIMEOUT_S))
    except ValueError:
        wait = TIMEOUT_S
    deadline = time.monotonic() + wait
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() >= deadline:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
                raise RunFault(f"waited {wait:.0f} s for the token cache of {name}: {lock} is held by process "
                               f"{holder}, which is still tokenizing (raise ${TIMEOUT_ENV}, or remove the lock if "
                               "that process is gone)") from None
            time.sleep(_POLL_S)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)


def _build_into(folder: Path, base: str, key: Mapping[str, Any], digest: str, build: Build) -> None:
    tmp = f".tmp{os.getpid()}"
    paths = {part: folder / f"{base}.{part}" for part in ("tokens", "starts", "json")}
    try:
        with open(str(paths["tokens"]) + tmp, "wb") as t, open(str(paths["starts"]) + tmp, "wb") as s:
            w = Writer(t, s)
            extra = build(w)
        meta = {**extra, "key": key, "digest": digest, "dtype": w.dtype.name if w.dtype is not None else "uint16",
                "tokens": w.count, "documents": w.documents}
        Path(str(paths["json"]) + tmp).write_text(json.dumps(meta, sort_keys=True))
        os.replace(str(paths["tokens"]) + tmp, paths["tokens"])
        os.replace(str(paths["starts"]) + tmp, paths["starts"])
        os.replace(str(paths["json"]) + tmp, paths["json"])  # the done marker, last
    finally:
        for p in paths.values():
            with contextlib.suppress(OSError):
                os.unlink(str(p) + tmp)


def _open(folder: Path, base: str, digest: str) -> Tokenized | None:
    """The built entry, mapped; None when absent, partial or another key's."""
    try:
        meta = json.loads((folder / f"{base}.json").read_text())
        if meta.get("digest") != digest:
            return None
        dtype = np.dtype(meta["dtype"])
        n, docs = int(meta["tokens"]), int(meta["documents"])
        tokens_path, starts_path = folder / f"{base}.tokens", folder / f"{base}.starts"
        if tokens_path.stat().st_size != n * dtype.itemsize or starts_path.stat().st_size != (docs + 1) * 8:
            return None
        tokens = np.memmap(tokens_path, dtype=dtype, mode="r") if n else np.zeros(0, dtype=dtype)
        starts = np.memmap(starts_path, dtype=np.int64, mode="r")
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return Tokenized(tokens, starts, meta, str(tokens_path))


def _build_temporary(build: Build) -> Tokenized:
    """Caching off or nowhere writable: this process's own entry, unlinked at once."""
    with tempfile.TemporaryFile() as t, tempfile.TemporaryFile() as s:
        w = Writer(t, s)
        meta = dict(build(w))
        t.flush()
        s.flush()
        dtype = w.dtype if w.dtype is not None else np.dtype(np.uint16)
        tokens = np.memmap(t, dtype=dtype, mode="r") if w.count else np.zeros(0, dtype=dtype)
        starts = np.memmap(s, dtype=np.int64, mode="r")
    return Tokenized(tokens, starts, {**meta, "dtype": dtype.name, "tokens": w.count, "documents": w.documents}, "")


def _remove_stale(folder: Path, prefix: str, keep: str) -> None:
    """The entries of the same source under an older key (a changed file or tokenizer). A run
    that still maps one keeps reading it: unlinking does not unmap."""
    for p in folder.glob(f"{prefix}*"):
        if not p.name.startswith(keep + ".") and ".tmp" not in p.name:
            with contextlib.suppress(OSError):
                p.unlink()
