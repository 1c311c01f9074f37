"""`ppdsl lsp`: the language server (pygls) over standard input and output.

- Diagnostics: every open, change and save re-checks the document with `check_text` and
  publishes the result. The checker is loaded and warmed once at start-up, so an edit costs a
  warm check. With the model features on, that includes the model checks of `ppdsl check`, on the
  model's facts: from memory, else from check's cache (torch-free, milliseconds); else the spec is
  checked without them at once while the model is built aside, and checked again when it is.
  Without the model features it is `ppdsl check --no-model`: no code of the spec runs, no torch.
- Hover: a key, block, call or option shows its entry of docs/language.md.
- Completion: blocks, keys, values, call options, split styles; module paths and config keys
  from the model.
- Go to definition: a module path (split rule pattern, pipeline blocks/first/last) jumps into a
  printout of the model; a name used in an expression jumps to where the spec sets it.

The model features build the model on the meta device on demand (the first check or request that
needs it), on a worker thread, once per (source, config). `initializationOptions: {"model": false}`
turns them off: then nothing but the checker runs.
"""

from __future__ import annotations

import asyncio
import gc
import importlib.util
import os
import sys
from typing import Any, Mapping

from lsprotocol import types as lsp
from pygls.lsp.server import LanguageServer
from pygls.uris import to_fs_path

from ppdsl.dsl.spec import Spec
from . import features
from .model_view import FAILED, ModelCache, ModelKey, ModelView

MODEL_TIMEOUT_S = 300.0  # the longest a request waits for a model build

WARM_UP = """ppspec 1
model { source = hf("GPT2LMHeadModel"), config { n_layer = 4 } }
mesh { tp = 2, pp = 2 }
tensor_parallel { transformer.h[*].mlp.c_fc : column }
pipeline { microbatches = 4 }
train { global_batch = 8 * dp, seq_len = 64 }
"""


class PpspecServer(LanguageServer):
    def __init__(self) -> None:
        from .. import __version__

        super().__init__("ppdsl", __version__, text_document_sync_kind=lsp.TextDocumentSyncKind.Incremental)
        self.specs: dict[str, Spec] = {}  # uri -> the last Spec that resolved (for the model features)
        self.models = ModelCache()
        self.model_features = True
        # without torch no model is built: no model checks (rather than a note on every document)
        self.model_checks = importlib.util.find_spec("torch") is not None
        self._awaited: set[tuple[ModelKey, str]] = set()  # (model, document) to check again once built

    def check(self, uri: str) -> None:
        from ppdsl.dsl.check import check_text

        doc = self.workspace.get_text_document(uri)
        lines = doc.lines
        diags = []
        try:
            model = self.model_features and self.model_checks
            result = check_text(doc.source, _file_of(uri), model=model, model_facts=self._facts_for(uri) if model else None)
        except Exception as exc:  # a bug of the checker: say so in the editor, keep serving
            diags.append(lsp.Diagnostic(
                lsp.Range(lsp.Position(0, 0), lsp.Position(0, 0)), severity=lsp.DiagnosticSeverity.Error,
                message=f"ppdsl: internal error: {type(exc).__name__}: {exc} (please report it)", source="ppdsl"))
            result = None
        if result is not None and result.spec is not None:
            self.specs[uri] = result.spec
        for d in result.diagnostics if result is not None else ():
            item = features.to_lsp(d, lines)
            item.range = doc.position_codec.range_to_client_units(lines, item.range)
            diags.append(item)
        self.text_document_publish_diagnostics(
            lsp.PublishDiagnosticsParams(uri=uri, diagnostics=diags, version=doc.version))

    def _facts_for(self, uri: str):
        """What check's model level asks for a model's facts: the ModelInfo when built, None while
        it builds (the document is checked again when it is done), ModelLoadError when it failed."""
        def facts(kind: str, target: str, config: Mapping[str, object]) -> Any:
            from ppdsl.core.build import ModelLoadError

            key = ModelKey.make(kind, target, config)
            fut = self.models.get(key)
            if not fut.done():
                if (key, uri) not in self._awaited:
                    self._awaited.add((key, uri))
                    loop = _running_loop()
                    if loop is not None:  # the build ends on the worker thread: check again on the loop's
                        fut.add_done_callback(lambda _: loop.call_soon_threadsafe(self._built, key, uri))
                return None
            view = fut.result()
            if isinstance(view, str):
                exc = ModelLoadError(view.removeprefix(FAILED))
                exc.key, exc.code = getattr(view, "key", ()), getattr(view, "code", "") or ModelLoadError.code
                raise exc
            return view.info
        return facts

    def _built(self, key: ModelKey, uri: str) -> None:
        self._awaited.discard((key, uri))
        if uri in self.workspace.text_documents:  # still open
            self.check(uri)

    async def model_view(self, uri: str) -> ModelView | None:
        spec = self.specs.get(uri)
        if spec is None or not self.model_features:
            return None
        key = ModelKey.of(spec)
        try:  # shielded: a request that gives up does not cancel the build the next one will use
            view = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(self.models.get(key))), MODEL_TIMEOUT_S)
        except asyncio.TimeoutError:
            return None
        if isinstance(view, str):
            self.window_log_message(lsp.LogMessageParams(lsp.MessageType.Warning, f"ppdsl: {view}"))
            return None
        return view


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:  # called outside the server's loop (a test calling check directly)
        return None


def _file_of(uri: str) -> str:
    """The path check reports and resolves data paths against (the spec's directory)."""
    return to_fs_path(uri) or uri


server = PpspecServer()


@server.feature(lsp.INITIALIZE)
def initialize(ls: PpspecServer, params: lsp.InitializeParams) -> None:
    options = params.initialization_options
    if isinstance(options, dict) and options.get("model") is False:
        ls.model_features = False


@server.feature(lsp.TEXT_DOCUMENT_DID_OPEN)
def did_open(ls: PpspecServer, params: lsp.DidOpenTextDocumentParams) -> None:
    ls.check(params.text_document.uri)


@server.feature(lsp.TEXT_DOCUMENT_DID_CHANGE)
def did_change(ls: PpspecServer, params: lsp.DidChangeTextDocumentParams) -> None:
    ls.check(params.text_document.uri)


@server.feature(lsp.TEXT_DOCUMENT_DID_SAVE)
def did_save(ls: PpspecServer, params: lsp.DidSaveTextDocumentParams) -> None:
    ls.check(params.text_document.uri)


@server.feature(lsp.TEXT_DOCUMENT_DID_CLOSE)
def did_close(ls: PpspecServer, params: lsp.DidCloseTextDocumentParams) -> None:
    ls.specs.pop(params.text_document.uri, None)
    ls.text_document_publish_diagnostics(lsp.PublishDiagnosticsParams(uri=params.text_document.uri, diagnostics=[]))


def _where(ls: PpspecServer, doc_id: lsp.TextDocumentIdentifier, position: lsp.Position):
    doc = ls.workspace.get_text_document(doc_id.uri)
    pos = doc.position_codec.position_from_client_units(doc.lines, position)
    return doc, pos.line, pos.character


def _client_range(doc, line: int, start: int, end: int) -> lsp.Range:
    return doc.position_codec.range_to_client_units(
        doc.lines, lsp.Range(lsp.Position(line, start), lsp.Position(line, end)))


@server.feature(lsp.TEXT_DOCUMENT_HOVER)
async def hover(ls: PpspecServer, params: lsp.HoverParams) -> lsp.Hover | None:
    doc, line, col = _where(ls, params.text_document, params.position)
    view = None
    if features.definition_path(doc.source, line, col) is not None:
        view = await ls.model_view(doc.uri)
    found = features.hover_markdown(doc.source, line, col, view)
    if found is None:
        return None
    text, start, end = found
    return lsp.Hover(lsp.MarkupContent(lsp.MarkupKind.Markdown, text), _client_range(doc, line, start, end))


@server.feature(lsp.TEXT_DOCUMENT_COMPLETION,
                lsp.CompletionOptions(trigger_characters=[".", "=", ":", "(", ","]))
async def completion(ls: PpspecServer, params: lsp.CompletionParams) -> lsp.CompletionList:
    doc, line, col = _where(ls, params.text_document, params.position)
    view = await ls.model_view(doc.uri) if features.wants_model(doc.source, line, col) else None
    start, items = features.completions(doc.source, line, col, view)
    edit_range = _client_range(doc, line, start, col)
    for item in items:
        item.text_edit = lsp.TextEdit(edit_range, item.insert_text or item.label)
        item.insert_text = None
    return lsp.CompletionList(is_incomplete=False, items=items)


@server.feature(lsp.TEXT_DOCUMENT_DEFINITION)
async def definition(ls: PpspecServer, params: lsp.DefinitionParams) -> list[lsp.Location] | None:
    doc, line, col = _where(ls, params.text_document, params.position)
    found = features.definition_path(doc.source, line, col)
    if found is not None:
        view = await ls.model_view(doc.uri)
        if view is None:
            return None
        uri = view.printout.as_uri()
        return [lsp.Location(uri, lsp.Range(lsp.Position(view.line_of[p], 0), lsp.Position(view.line_of[p] + 1, 0)))
                for p in view.resolve(found[2])] or None
    target = features.definition_in_spec(doc.source, line, col)
    if target is None:
        return None
    t_line, start, end = target
    return [lsp.Location(doc.uri, _client_range(doc, t_line, start, end))]


def warm_up() -> None:
    """Load and run the checker once, then set its long-lived objects aside from the cyclic GC
    (as `ppdsl check` does): each edit then costs a warm check and no full collections of them."""
    from ppdsl.dsl.check import check_text
    from ppdsl.dsl import model_check, model_facts_cache  # noqa: F401 - the model checks of the first edit

    check_text(WARM_UP, "<warm-up>", model=False)
    gc.collect()
    gc.freeze()


def serve() -> int:
    """Speak LSP on stdin/stdout. Anything else written to standard output (a print in a model
    factory, a library's warning) goes to standard error instead: it would corrupt the protocol."""
    protocol_out = os.fdopen(os.dup(sys.stdout.fileno()), "wb", buffering=0)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    sys.stdout = sys.stderr
    warm_up()
    server.start_io(sys.stdin.buffer, protocol_out)
    return 0
