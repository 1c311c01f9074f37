"""The model behind a spec, for the editor: its module paths, and a printout to jump into.

Building a model imports torch and transformers (seconds) and, for a `python(...)` source, runs
the user's factory: never on the keystroke path. The server asks for it when a document's model
checks, a completion of a module path, a go-to-definition or a hover on a path need it: the facts
`ppdsl check` keeps in the user's cache (dsl/model_facts_cache.py) are read at once, torch-free;
without them the model is built on the meta device on a worker thread, as `ppdsl check` builds it
(and stored there for the next check), once per (source, config). The result is kept (a failure
too, so a broken config is not rebuilt at every request).
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import re
import tempfile
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Mapping

import attrs

from ppdsl.dsl.patterns import match
from ppdsl.dsl.spec import PatternIndex, PatternSegment, Spec

_SEGMENT = re.compile(r"([A-Za-z_][A-Za-z0-9_]*|[0-9]+)(?:\[(\*|[0-9]+|[0-9]*:[0-9]*)\])?")


@attrs.frozen
class ModelKey:
    kind: str
    target: str
    config: str  # the config as canonical JSON

    @classmethod
    def of(cls, spec: Spec) -> "ModelKey":
        return cls.make(spec.model.source.kind, spec.model.source.target, spec.model.config)

    @classmethod
    def make(cls, kind: str, target: str, config: Mapping[str, object]) -> "ModelKey":
        return cls(kind, target, json.dumps(dict(config), sort_keys=True, default=str))

    def describe(self) -> str:
        return f'{self.kind}("{self.target}")'


@attrs.frozen
class ModelView:
    """A built model: what completion and definition need, and where its printout lies."""

    key: ModelKey
    info: Any  # the introspect.ModelInfo, dataflow included: what the model checks judge
    class_name: str
    modules: Mapping[str, Any]  # path -> introspect.ModuleInfo ("" is the root)
    config: Mapping[str, object]
    printout: Path  # the text file the definitions point into
    line_of: Mapping[str, int]  # module path -> 0-based line in the printout

    def children(self, path: str) -> tuple[str, ...]:
        info = self.modules.get(path)
        return tuple(info.children) if info is not None else ()

    def resolve(self, pattern: str) -> list[str]:
        """The module paths a pattern (`transformer.h[*].attn`) names, in model order."""
        segments = parse_pattern(pattern)
        return match(segments, self.modules) if segments else []


def parse_pattern(text: str) -> tuple[PatternSegment, ...]:
    """`transformer.h[*].attn` -> segments; () for text that is not a pattern. `h.3` is `h[3]`."""
    out: list[PatternSegment] = []
    for part in text.split("."):
        m = _SEGMENT.fullmatch(part)
        if m is None:
            return ()
        name, index = m.groups()
        if name.isdigit():
            if not out or out[-1].index is not None or index is not None:
                return ()
            out[-1] = PatternSegment(out[-1].name, PatternIndex("one", int(name)))
            continue
        out.append(PatternSegment(name, _index(index) if index is not None else None))
    return tuple(out)


def _index(text: str) -> PatternIndex:
    if text == "*":
        return PatternIndex("all")
    if ":" not in text:
        return PatternIndex("one", int(text))
    a, b = text.split(":")
    return PatternIndex("range", int(a) if a else None, int(b) if b else None)


def render_printout(class_name: str, modules: Mapping[str, Any], source: str, total: int,
                    tied: tuple[tuple[str, str], ...] = ()) -> tuple[str, dict[str, int]]:
    """The module tree as text, one module a line (as `print(model)`, with every block listed and
    each line ending in the module's full path); and the line of each path."""
    lines = [f"# {class_name}: {total:,} parameters, built on the meta device from {source}",
             "# ppdsl lsp: go-to-definition lands here; one module a line, its full path on the right",
             *(f"# tied: {a} is {b} (its parameters are counted at {b})" for b, a in tied), ""]
    line_of: dict[str, int] = {}
    rows: list[tuple[str, str]] = []

    def walk(path: str, name: str, depth: int) -> None:
        info = modules[path]
        line_of[path] = len(lines) + len(rows)
        head = f"{'  ' * depth}({name}): {info.type_name}{_shape(info)}" if path else info.type_name
        note = f"{info.num_params:,} params" if info.num_params else ""
        rows.append((head, f"{path or '<root>'}{'  ' + note if note else ''}"))
        for child in info.children:
            walk(f"{path}.{child}" if path else child, child, depth + 1)

    walk("", "", 0)
    width = min(max(len(h) for h, _ in rows) + 2, 80)
    lines += [f"{h.ljust(width)}# {p}" for h, p in rows]
    return "\n".join(lines) + "\n", line_of


def _shape(info: Any) -> str:
    if info.in_features is not None and info.out_features is not None:
        return f"({info.in_features} -> {info.out_features}{', bias' if info.has_bias else ''})"
    if info.num_embeddings is not None:
        return f"({info.num_embeddings}, {info.embedding_dim})"
    if info.children and all(c.isdigit() for c in info.children):
        return f"({len(info.children)} blocks)"
    return ""


def printout_dir() -> Path:
    return Path(tempfile.gettempdir()) / f"ppdsl-lsp-{os.getuid() if hasattr(os, 'getuid') else 'user'}"


def build_view(key: ModelKey) -> ModelView:
    """Build the model on meta (as `ppdsl check` does: its cached facts when there are) and write
    its printout. Raises ppdsl.core.build.ModelLoadError with a message for the user."""
    from ppdsl.dsl.model_facts_cache import cached_introspect

    return view_of(key, cached_introspect(key.kind, key.target, json.loads(key.config)))


def view_of(key: ModelKey, info: Any) -> ModelView:
    """The view of a model's facts (introspect.ModelInfo); writes its printout."""
    text, line_of = render_printout(info.class_name, info.modules, key.describe(), info.total_params, info.tied)
    digest = hashlib.sha256(f"{key.kind}\0{key.target}\0{key.config}".encode()).hexdigest()[:12]
    folder = printout_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{info.class_name}-{digest}.txt"
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return ModelView(key, info, info.class_name, dict(info.modules), dict(info.config), path, line_of)


class ModelCache:
    """Model views by key, built one at a time on a worker thread; failures are kept as messages.

    The worker is a daemon thread: an editor that closes the server while a model builds (an
    open document's checks start one) does not wait for the build to end."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._futures: dict[ModelKey, Future] = {}
        self._queue: queue.SimpleQueue[tuple[ModelKey, Future]] = queue.SimpleQueue()
        self._worker: threading.Thread | None = None

    def _submit(self, key: ModelKey) -> Future:
        fut: Future = Future()
        self._queue.put((key, fut))
        if self._worker is None:
            self._worker = threading.Thread(target=self._work, name="ppdsl-model", daemon=True)
            self._worker.start()
        return fut

    def _work(self) -> None:
        while True:
            key, fut = self._queue.get()
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(_build_or_message(key))
                except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
                    fut.set_exception(exc)

    def get(self, key: ModelKey) -> Future:
        """A future of the ModelView (or of a str: why it could not be built): done at once when the
        facts are in the cache of `ppdsl check`, else built on the worker thread."""
        with self._lock:
            fut = self._futures.get(key)
            if fut is None:
                fut = self._futures[key] = _cached(key) or self._submit(key)
            return fut

    def ready(self, key: ModelKey) -> ModelView | None:
        fut = self._futures.get(key)
        if fut is None or not fut.done():
            return None
        view = fut.result()
        return view if isinstance(view, ModelView) else None


def _cached(key: ModelKey) -> Future | None:
    """A done future of the view of the cached facts, or None (not cached, or cannot be told)."""
    from ppdsl.dsl.model_facts_cache import lookup

    try:
        info = lookup(key.kind, key.target, json.loads(key.config))
        if info is None:
            return None
        fut: Future = Future()
        fut.set_result(view_of(key, info))
        return fut
    except Exception:  # an unwritable printout folder, ...: build it the usual way
        return None


FAILED = "cannot build the model: "  # how a failure's message begins


class Failure(str):
    """A failed build's message (beginning with FAILED), with the ModelLoadError's config key
    (a path: a nested block's key) and code, so that the editor marks the key as check does."""

    key: tuple[str, ...] = ()
    code: str = ""  # the ModelLoadError's (empty: its default)


def _build_or_message(key: ModelKey) -> ModelView | str:
    from ppdsl.core.build import ModelLoadError

    try:
        return build_view(key)
    except ModelLoadError as exc:
        failure = Failure(f"{FAILED}{exc}")
        failure.key, failure.code = exc.key, exc.code
        return failure
    except Exception as exc:  # a factory of the user's that raises anything: the editor must go on
        return f"{FAILED}{type(exc).__name__}: {exc}"
