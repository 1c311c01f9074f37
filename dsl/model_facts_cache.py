"""What `ppdsl check` learns from building the model, kept on disk between runs.

Building the model on the meta device costs seconds, nearly all of it importing torch and
transformers. What check takes from it is `introspect(kind, target, config, dataflow=True)`: a
`ModelInfo` (module tree, shapes, parameter counts, ties, the HF config) and the `DataFlow` of
one meta forward. That depends on the model source and its config only, never on the rest of the
spec: the tensor-parallel rules, tp, the pipeline and the world size are judged afterwards,
torch-free, by `ppdsl.dsl.model_check` on those facts (the trace tags every linear, Conv1D and
embedding of the model and watches every norm, whichever the spec splits; its sequence length
comes from the model's config). So an entry is keyed by:

- the source kind, its target and the spec's config (canonical JSON);
- the torch and transformers versions, Python's major.minor, ppdsl's version and a digest of the
  modules that compute the facts (`_OWN_SOURCES`: this file, the meta traces, core/build.py, ...);
- ``python(...)``: the factory module's file and every other ``.py`` file of its top-level
  package (a module outside a package: the ``.py`` files beside it), by content;
- ``hf_pretrained(...)``: the directory's config.json, by content (nothing else of it is read).

An entry is plain JSON (never a pickle) under ``$PPDSL_CACHE_DIR``, else
``$XDG_CACHE_HOME/ppdsl``, else ``~/.cache/ppdsl``, in ``model-facts-v<FORMAT>/``; ``PPDSL_NO_CACHE=1``
turns the cache off. Reading it never imports torch or transformers. An entry that cannot be read,
does not parse, carries another key or fails its checksum is ignored (and rebuilt); writes go to
a temporary file moved into place with os.replace, so concurrent checks never see half an entry;
a cache directory that cannot be written just means nothing is cached. Builds that fail
(`ModelLoadError`) are not cached: the next check tries again.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.machinery
import importlib.util
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attr  # the classic namespace: its asdict takes retain_collection_types in every attrs release
import attrs

from ppdsl.core.build import is_stdlib
from ppdsl.core.user_cache import ENV_DIR, ENV_OFF, caching_off, user_cache_root
from .introspect import ModelInfo, ModuleInfo, introspect
from .attention_probe import AttentionCall, AttentionProbe
from .own_layout import OwnLayout
from .saved_activations import SavedActivations, SavedGroup
from .tp_dataflow import DataFlow

__all__ = ["ENV_DIR", "ENV_OFF", "cache_dir", "cached_answer", "cached_introspect", "facts_key", "lookup"]

FORMAT = 15  # 15: ModuleInfo.position_wise; 13, 14: OwnLayout.carried (14: floating only); 12: OwnLayout.above_late; 3: ModelInfo.saved (the saved activations); 4: its temporaries; 5: OwnLayout's inputs, positions; 6: width; 7: idle; 8: uncuttable; 9: block_shapes; 10: block_plain; 11: the image_width refusal
SUBDIR = f"model-facts-v{FORMAT}"
MAX_ENTRIES = 512  # beyond this many entries a write removes the oldest
MAX_SOURCE_FILES = 2000  # a python factory's package larger than this is not cached (hashing it would cost)
# the modules that compute the facts (dsl/ modules, or a full name): any change to one is a new key
_OWN_SOURCES = ("introspect", "tp_dataflow", "saved_activations", "block_sample", "attention_probe", "packing_probe", "own_layout", "own_cut_proof", "model_facts_cache",
                "own_tp_proof", "column_groups",
                "ppdsl.core.build", "ppdsl.core.own_cut", "ppdsl.core.task_loss", "ppdsl.core.model_inputs",
                "ppdsl.core.meta_values", "ppdsl.core.module_paths", "ppdsl.core.document_masks", "ppdsl.core.own_tp",
                "ppdsl.core.sequence_regions")


class _Uncachable(Exception):
    """This model or value cannot be keyed or stored exactly: build it every time."""


# --------------------------------------------------------------------------------------------
# Where
# --------------------------------------------------------------------------------------------


def cache_dir() -> Path | None:
    """The folder of the model-facts entries, or None when caching is turned off."""
    if caching_off():
        return None
    return user_cache_root() / SUBDIR


# --------------------------------------------------------------------------------------------
# The key
# --------------------------------------------------------------------------------------------


def facts_key(kind: str, target: str, config: Mapping[str, object]) -> dict[str, Any] | None:
    """Everything the facts of this model depend on, as JSON; None when it cannot be told without
    importing code (then the model is built every time). Call it with sys.path as the build will
    see it (after `ppdsl.core.build.add_model_path`)."""
    try:
        key: dict[str, Any] = {
            "format": FORMAT, "ppdsl": _ppdsl_digest(), "python": "%d.%d" % sys.version_info[:2],
            "torch": _dist_version("torch"), "transformers": _dist_version("transformers"),
            "kind": kind, "target": target, "config": _encode(dict(config), sort=True),
        }
        if kind == "python":
            key["sources"] = _factory_sources(target)
        elif kind == "hf_pretrained":
            key["sources"] = _pretrained_sources(target)
    except (_Uncachable, OSError, ValueError, ImportError):
        return None
    return key


@functools.lru_cache(maxsize=None)
def _ppdsl_digest() -> str:
    from ppdsl import __version__

    h = hashlib.sha256(__version__.encode())
    here = Path(__file__).resolve().parent
    for name in _OWN_SOURCES:
        path = here / f"{name}.py" if "." not in name else Path(importlib.util.find_spec(name).origin)
        h.update(b"\0" + path.read_bytes())
    return f"{__version__}+{h.hexdigest()[:16]}"


@functools.lru_cache(maxsize=None)
def _site_listing(entry: str) -> tuple[str, ...]:
    try:
        return tuple(os.listdir(entry or "."))
    except OSError:
        return ()


def _dist_version(name: str) -> str | None:
    """The installed version of distribution ``name`` from its ``.dist-info`` folder name, found the
    way importlib.metadata finds it (the first sys.path entry holding one) without importing it."""
    prefix = name + "-"
    for entry in sys.path:
        for item in _site_listing(entry):
            if item.startswith(prefix) and item.endswith(".dist-info"):
                return item[len(prefix):-len(".dist-info")]
    return None


def _locate(module_name: str) -> str:
    """The file of module ``module_name``, found without importing it (or its packages)."""
    parts = module_name.split(".")
    if not all(p.isidentifier() for p in parts):
        raise _Uncachable(module_name)
    loaded = sys.modules.get(module_name)
    if loaded is not None:
        origin = getattr(loaded, "__file__", None)
        if not origin:
            raise _Uncachable(module_name)
        return origin
    spec = importlib.util.find_spec(parts[0])  # a top-level name: nothing is imported
    for i in range(1, len(parts)):
        if spec is None or not spec.submodule_search_locations:
            raise _Uncachable(module_name)
        name = ".".join(parts[: i + 1])
        if ".".join(parts[:i]) in sys.modules:
            spec = importlib.util.find_spec(name)  # the parent is imported already: nothing new runs
        else:
            spec = importlib.machinery.PathFinder.find_spec(name, list(spec.submodule_search_locations))
    if spec is None or not spec.has_location or not spec.origin or not spec.origin.endswith(".py"):
        raise _Uncachable(module_name)
    return spec.origin


def _top_folder(origin: str, module_name: str) -> tuple[Path, bool]:
    """The folder whose ``.py`` files the factory may import (its top-level package, walked
    recursively; for a module outside a package, its own folder, not walked)."""
    path = Path(origin).resolve()
    depth = module_name.count(".") + (1 if path.name == "__init__.py" else 0)
    if depth == 0:
        return path.parent, False
    folder = path.parent
    for _ in range(depth - 1):
        folder = folder.parent
    return folder, True


def _factory_sources(target: str) -> dict[str, str]:
    module_name = target.partition(":")[0]
    if is_stdlib(module_name):  # refused before import (E0401): nothing to key
        raise _Uncachable(target)
    origin = _locate(module_name)
    folder, recursive = _top_folder(origin, module_name)
    files = [Path(origin).resolve()]
    if recursive:
        for root, dirs, names in os.walk(folder):
            dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")
            files += [Path(root, n) for n in sorted(names) if n.endswith(".py")]
            if len(files) > MAX_SOURCE_FILES:
                raise _Uncachable(target)
    else:
        files += sorted(p for p in folder.glob("*.py"))
        if len(files) > MAX_SOURCE_FILES:
            raise _Uncachable(target)
    return {str(p): _file_digest(p) for p in dict.fromkeys(files)}


def _pretrained_sources(target: str) -> dict[str, str]:
    from ppdsl.core.locate import PretrainedDirError, resolve_pretrained_dir

    try:
        folder = resolve_pretrained_dir(target, require_config=False)
    except PretrainedDirError as exc:
        raise _Uncachable(target) from exc
    config = Path(folder, "config.json").resolve()
    return {str(config): _file_digest(config)}


def _file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --------------------------------------------------------------------------------------------
# Values as exact JSON: lists stay arrays; every JSON object is a tagged value, so a tuple, a
# dict with int keys (HF's id2label) or an infinite float comes back as it was.
# --------------------------------------------------------------------------------------------


def _encode(v: Any, sort: bool = False) -> Any:
    """``sort``: dicts in key order (a key: the order of a config's keys changes nothing built)."""
    t = type(v)
    if v is None or t in (bool, int, str):
        return v
    if t is float:
        return v if math.isfinite(v) else {"f": repr(v)}
    if t is list:
        return [_encode(x, sort) for x in v]
    if t is tuple:
        return {"t": [_encode(x, sort) for x in v]}
    if t is dict:
        pairs = [[_encode(k, sort), _encode(x, sort)] for k, x in v.items()]
        return {"d": sorted(pairs, key=lambda p: json.dumps(p[0])) if sort else pairs}
    raise _Uncachable(t.__name__)


def _decode(v: Any) -> Any:
    if isinstance(v, list):
        return [_decode(x) for x in v]
    if not isinstance(v, dict):
        return v
    (tag, body), = v.items()
    if tag == "t":
        return tuple(_decode(x) for x in body)
    if tag == "d":
        return {_decode(k): _decode(x) for k, x in body}
    if tag == "f":
        return float(body)
    raise ValueError(f"unknown tag {tag!r}")


_MODULE_FIELDS = tuple(f.name for f in attrs.fields(ModuleInfo))


def info_to_json(info: ModelInfo) -> dict[str, Any]:
    flow = info.dataflow
    return {
        "class_name": info.class_name,
        "module_fields": list(_MODULE_FIELDS),
        "modules": [[_encode(getattr(m, f)) for f in _MODULE_FIELDS] for m in info.modules.values()],
        "config": _encode(dict(info.config)),
        "tied": [list(t) for t in info.tied],
        "total_params": info.total_params,
        "dataflow": None if flow is None else {
            "producers": [[k, sorted(v)] for k, v in flow.producers.items()],
            "fused_parts": [[k, n] for k, n in flow.fused_parts.items()],
            "outputs": sorted(flow.outputs), "watched": sorted(flow.watched),
            "part_widths": [[k, list(w)] for k, w in flow.part_widths.items()]},
        "dataflow_error": info.dataflow_error,
        "own_layout": None if info.own_layout is None else _encode(attr.asdict(info.own_layout, retain_collection_types=True)),
        "attention": None if info.attention is None else {
            "calls": [attrs.astuple(c) for c in info.attention.calls],
            "takes_position_ids": info.attention.takes_position_ids},
        "attention_error": info.attention_error,
        "packed_documents": info.packed_documents,
        "document_masks": info.document_masks,
        "saved": None if info.saved is None else {
            "lengths": list(info.saved.lengths), "groups": [attrs.astuple(g) for g in info.saved.groups],
            "temporaries": [attrs.astuple(g) for g in info.saved.temporaries]},
        "saved_error": info.saved_error,
    }


def info_from_json(data: Mapping[str, Any]) -> ModelInfo:
    if tuple(data["module_fields"]) != _MODULE_FIELDS:
        raise ValueError("another ModuleInfo layout")
    modules = {}
    for row in data["modules"]:
        m = ModuleInfo(*(_decode(v) for v in row))
        modules[m.path] = m
    flow = data["dataflow"]
    return ModelInfo(
        class_name=data["class_name"], modules=modules, config=_decode(data["config"]),
        tied=tuple((a, b) for a, b in data["tied"]), total_params=data["total_params"],
        dataflow=None if flow is None else DataFlow(
            producers={k: frozenset(v) for k, v in flow["producers"]},
            fused_parts={k: n for k, n in flow["fused_parts"]},
            outputs=frozenset(flow["outputs"]), watched=frozenset(flow["watched"]),
            part_widths={k: tuple(w) for k, w in flow.get("part_widths", [])}),
        dataflow_error=data["dataflow_error"],
        own_layout=None if data.get("own_layout") is None else OwnLayout(**_decode(data["own_layout"])),
        attention=None if data.get("attention") is None else AttentionProbe(
            tuple(AttentionCall(*c) for c in data["attention"]["calls"]), data["attention"]["takes_position_ids"]),
        attention_error=data.get("attention_error"),
        packed_documents=data.get("packed_documents"), document_masks=bool(data.get("document_masks")),
        saved=None if data["saved"] is None else SavedActivations(
            tuple(data["saved"]["lengths"]), tuple(SavedGroup(*g) for g in data["saved"]["groups"]),
            tuple(SavedGroup(*g) for g in data["saved"]["temporaries"])),
        saved_error=data["saved_error"],
    )


# --------------------------------------------------------------------------------------------
# Reading and writing entries
# --------------------------------------------------------------------------------------------


def _canonical(key: Mapping[str, Any]) -> str:
    return json.dumps(key, sort_keys=True, separators=(",", ":"))


def _entry_path(folder: Path, key: Mapping[str, Any]) -> Path:
    return folder / f"{hashlib.sha256(_canonical(key).encode()).hexdigest()[:32]}.json"


def load(key: Mapping[str, Any]) -> ModelInfo | None:
    """The facts stored under ``key``, or None (no entry, or one that is unreadable or wrong)."""
    facts = _load_entry(key)
    try:
        return None if facts is None else info_from_json(json.loads(facts))
    except Exception:  # an entry of another layout: the caller rebuilds it
        return None


def _load_entry(key: Mapping[str, Any]) -> str | None:
    """The JSON text stored under ``key``, or None (no entry, or one that is unreadable or wrong)."""
    folder = cache_dir()
    if folder is None:
        return None
    try:
        entry = json.loads(_entry_path(folder, key).read_bytes())
        facts = entry["facts"]
        if entry["key"] != json.loads(_canonical(key)) or \
                entry["sha256"] != hashlib.sha256(facts.encode()).hexdigest():
            return None
        return str(facts)
    except Exception:  # missing, unreadable, truncated, edited by hand: the caller rebuilds it
        return None


def store(key: Mapping[str, Any], info: ModelInfo) -> bool:
    """Write the facts under ``key``; False when they cannot be stored exactly or the folder is
    not writable. Never raises."""
    try:
        data = info_to_json(info)
        if info_from_json(json.loads(json.dumps(data))) != info:  # only what comes back exactly
            return False
    except Exception:  # an unencodable value: no caching
        return False
    return _store_entry(key, json.dumps(data, separators=(",", ":")))


def _store_entry(key: Mapping[str, Any], facts: str) -> bool:
    """Write the JSON text ``facts`` under ``key``; False when the folder is not writable. Never raises."""
    folder = cache_dir()
    if folder is None:
        return False
    try:
        entry = {"format": FORMAT, "key": json.loads(_canonical(key)), "sha256": hashlib.sha256(facts.encode()).hexdigest(),
                 "facts": facts}
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=folder)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                json.dump(entry, fh)
            os.replace(tmp, _entry_path(folder, key))
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        _prune(folder)
        return True
    except Exception:  # an unwritable or full cache folder, an unencodable value: no caching
        return False


def _prune(folder: Path) -> None:
    """Keep the newest MAX_ENTRIES entries (one per model source and config ever checked), and
    remove temporary files a killed check left (older than an hour: not one being written)."""
    def mtime(p: Path) -> float:
        try:
            return p.stat().st_mtime
        except OSError:
            return 0.0
    names = list(folder.iterdir())
    entries = [p for p in names if p.suffix == ".json" and not p.name.startswith(".")]
    stale = [p for p in names if p.name.startswith(".tmp-") and mtime(p) < time.time() - 3600]
    for p in stale + sorted(entries, key=mtime)[: max(0, len(entries) - MAX_ENTRIES)]:
        with contextlib.suppress(OSError):
            p.unlink()


# --------------------------------------------------------------------------------------------
# The entry points
# --------------------------------------------------------------------------------------------


def lookup(kind: str, target: str, config: Mapping[str, object]) -> ModelInfo | None:
    """The cached facts of this model, or None; never builds anything (torch is not imported)."""
    key = facts_key(kind, target, config) if cache_dir() is not None else None
    return None if key is None else load(key)


def cached_answer(kind: str, target: str, config: Mapping[str, object], question: Mapping[str, Any],
                  compute: Callable[[], Any]) -> Any:
    """The answer (plain JSON) to ``question`` (plain JSON) about this model, from the cache when it
    holds it, else ``compute()``, stored: a proof check runs on the built model whose verdict
    depends on the model's facts and the question alone (the own forward's split at local shapes,
    dsl/own_tp_proof.py), so a warm check neither imports torch nor builds the model for it."""
    base = facts_key(kind, target, config) if cache_dir() is not None else None
    try:
        key = None if base is None else {**base, "question": _encode(dict(question), sort=True)}
    except _Uncachable:
        key = None
    if key is not None:
        found = _load_entry(key)
        if found is not None:
            return json.loads(found)["answer"]
    answer = compute()
    if key is not None and (kind != "python" or target.partition(":")[0] not in sys.modules):
        _store_entry(key, json.dumps({"answer": answer}, separators=(",", ":")))
    return answer


def cached_introspect(kind: str, target: str, config: Mapping[str, object]) -> ModelInfo:
    """`introspect(kind, target, config, dataflow=True)`, from the cache when it holds the entry.
    Raises `ModelLoadError` as introspect does (a failure is not cached)."""
    key = facts_key(kind, target, config) if cache_dir() is not None else None
    if key is not None:
        info = load(key)
        if info is not None:
            return info
    # A factory module imported before (the language server's long life) may be older than the
    # files the key hashed: its facts are returned but not stored.
    fresh = kind != "python" or target.partition(":")[0] not in sys.modules
    info = introspect(kind, target, config, dataflow=True)
    if key is not None and fresh:
        store(key, info)
    return info
