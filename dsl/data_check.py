"""Check-time diagnostics of `train.data` and `train.eval.data` (E0410 to E0418, E0431, E0450 to E0453;
E0454 to E0456 for mix and holdout: dsl/data_check_mix.py):
the files a data source names.

`ppdsl check` reads what it can of them, cheaply and without importing anything from the spec:
whether each file exists and is a regular file, a token file's size, `.npy` header and the ids of
a bounded prefix, the tokenizer directory, the first lines of a JSON-lines or CSV file, and
whether the kind of data fits the model (labelled examples for a classifier, token streams for a
causal language model). numpy is imported only when a token file is declared, so a spec with
`synthetic` data stays instant.

What cannot be known without running (a text corpus' token count, a label on line 10,000) is
checked again when the data is first read (runtime/data/source.py), with a ValueError naming the file.
"""

from __future__ import annotations

import codecs
import json
import os
from typing import Any

from ppdsl.core.labels import is_classification
from .data_check_examples import ExampleChecks
from .data_check_images import ImageChecks
from .data_check_speech import SpeechChecks
from .data_check_tables import TableChecks
from .data_quote import show
from .diagnostics import Diagnostic, error
from .exact import Expr
from ppdsl.core.locate import outside
from .resolve.located import missing_error, outside_error
from .span import Span
from .spec import WORLD, DataSpec, Spec

SAMPLE_TOKENS = 1 << 20  # token ids checked against the vocabulary: the first 1M
HEAD_BYTES = 1 << 20  # text corpus bytes checked for UTF-8
MAX_TOKENIZER_JSON = 64 << 20  # a tokenizer.json larger than this is not parsed at check time (real ones: < 40 MiB)
TOKEN_KINDS = ("tokens", "text")  # token streams: causal language models
EXAMPLE_KINDS = ("jsonl", "csv")  # labelled examples: classification models


def check_data(spec: Spec, world: int | None, roots: tuple[str, ...] | None = None,
               render: bool = True) -> list[Diagnostic]:
    """The training data's files, then the held-out (`train.eval.data`) ones: the same checks,
    the eval file holding at least `eval.batches` global batches. `roots`: where files may be
    read (None: anywhere). The locate pass has refused data paths outside them (E0419); here a
    file inside the tokenizer directory must not lead out of it either. `render`: whether
    conversations are rendered by their chat template (transformers; not under --no-model)."""
    from .data_check_mix import check_mix, leaves  # mix(...) and holdout(...) (E0454 to E0456)

    from .packing_check import check_packing  # train.packing (E0470, E0473)

    out = check_mix(spec, world) + check_packing(spec)
    for where, data, batches in leaves(spec):  # a mixture's parts one by one
        out += _Checker(spec, world, data, where, batches, roots, render).run()
    return out


class _Checker(ExampleChecks, TableChecks, ImageChecks, SpeechChecks):
    """One data source's checks. `where`: its spans' prefix (train.data, train.eval.data);
    `batches`: the global batches it must hold at least (an evaluation reads each once);
    `roots`: where files may be read (None: anywhere)."""

    def __init__(self, spec: Spec, world: int | None, data: DataSpec, where: str, batches: int = 1,
                 roots: tuple[str, ...] | None = None, render: bool = True):
        self.roots = roots
        self.render = render
        self.spec = spec
        self.data = data
        self.opts = dict(data.options)
        self.world = world
        self.where = where
        self.batches = batches
        self.out: list[Diagnostic] = []
        self.classification = is_classification(spec.model.family, spec.model.source.kind, spec.model.source.target,
                                                spec.model.resolved_config)
        self.vocab = _positive(spec.model.dims.get("vocab"))
        self.labels = _positive(spec.model.dims.get("labels"))
        self.call = spec.span(f"{where}.call")
        self.tokenizer_doc: dict[str, Any] | None = None  # the tokenizer.json, once read

    def span(self, option: str) -> Span | None:
        return self.spec.spans.get(f"{self.where}.{option}", self.call)

    def needed(self) -> str:
        """How the minimum is put in messages."""
        return "one global batch" if self.batches == 1 else f"{self.batches} eval batches"

    def err(self, code: str, option: str, message: str, **kw: str) -> None:
        self.out.append(error(code, self.span(option), message, **kw))

    # one rule each, whatever the file's format
    def unreadable(self, option: str, message: str, **kw: str) -> None:
        """E0411: not a regular file (or directory), or it cannot be read."""
        self.err("E0411", option, message, **kw)

    def too_little(self, message: str, **kw: str) -> None:
        """E0414: less data than the run needs."""
        self.err("E0414", "path", message, **kw)

    def malformed(self, option: str, message: str, **kw: str) -> None:
        """E0416: what the file holds is not what its kind says."""
        self.err("E0416", option, message, **kw)

    def bad_tokenizer(self, message: str, **kw: str) -> None:
        """E0415: the tokenizer directory holds no tokenizer ppdsl can use."""
        self.err("E0415", "tokenizer", message, **kw)

    def run(self) -> list[Diagnostic]:
        kind = self.data.kind
        self._task()
        if "tokenizer" in self.opts:
            self._tokenizer(self.opts["tokenizer"])
        if kind == "hf_dataset":  # a file, a folder, a glob or a save_to_disk directory
            self._hf_dataset(self.opts["path"])
        elif kind == "image_folder":  # class sub-folders of images (dsl/data_check_images.py)
            self._image_folder(self.opts["path"])
        elif kind == "image_text_folder":  # images and their captions (dsl/data_check_images.py)
            self._image_text_folder(self.opts["path"])
        elif kind == "audio_folder":  # wav files and their transcripts (dsl/data_check_speech.py)
            self._audio_folder(self.opts["path"])
        elif self._file(self.opts["path"]):
            getattr(self, f"_{kind}")(self.opts["path"])
        return self.out

    def global_batch(self) -> int | None:
        gb = self.spec.train.global_batch
        if self.world is not None and isinstance(gb, Expr):
            gb = gb.subs(WORLD, self.world)
        if isinstance(gb, Expr) and gb.is_Integer and int(gb) > 0:
            return int(gb) * self.batches  # the samples the source must hold
        return None  # depends on the world size: checked when the data is first read

    # ---- the model's task
    def _task(self) -> None:
        kind, family = self.data.kind, self.spec.model.family
        if self.classification and kind in TOKEN_KINDS:
            self.out.append(error(
                "E0418", self.call, f"{kind}(...) is a token stream for causal language models, but this model "
                f"classifies sequences ({_model_name(self.spec)})",
                label="needs labelled examples",
                hint='use jsonl("train.jsonl", tokenizer = "...") or csv(...) with a text and a label column'))
        elif self.classification and kind == "hf_dataset" and self.opts.get("messages") is not None:
            self.out.append(error(
                "E0418", self.call, "hf_dataset(..., messages = ...) gives conversations for a causal language "
                f"model, but this model classifies sequences ({_model_name(self.spec)})",
                label="needs labelled examples", hint="leave messages out: a text and a label column"))
        elif not self.classification and kind in EXAMPLE_KINDS:
            self.out.append(error(
                "E0418", self.call, f"{kind}(...) gives labelled examples for classification, but this model is a "
                f"causal language model ({_model_name(self.spec)}, family {family})",
                label="needs a token stream",
                hint='use tokens("train.bin") or text("corpus.txt", tokenizer = "..."); for documents with a '
                     'text field, hf_dataset("f.jsonl", tokenizer = "...")'))

    # ---- files and directories
    def _exists(self, path: str, option: str, subject: str, hint: str) -> bool:
        """E0410 unless `path` exists (a dangling symbolic link does: E0411 says what it is)."""
        if os.path.lexists(path):
            return True
        self.out.append(missing_error(self.span(option), f"{subject} does not exist", hint=hint))
        return False

    def _folder(self, path: str, subject: str, holds: str) -> bool:
        """E0410 / E0411 unless `path` is a folder (of a folder source: `subject` names it, `holds`
        says what it holds)."""
        if not self._exists(path, "path", f"{subject} '{show(path)}'",
                            f"a folder holding {holds}; relative paths are relative to the spec's directory"):
            return False
        if not os.path.isdir(path):
            self.unreadable("path", f"{subject} '{show(path)}' is not a folder", label="a file",
                            hint=f"{self.data.kind}(...) reads a folder holding {holds}")
            return False
        return True

    def _file(self, path: str, option: str = "path") -> bool:
        base = os.path.dirname(os.path.abspath(self.spec.file))
        if not self._exists(path, option, f"data file '{show(path)}'",
                            f"relative paths are relative to the spec's directory ({show(base) or '.'})"):
            return False
        if not os.path.isfile(path):
            what = "a directory" if os.path.isdir(path) else "not a regular file"
            self.unreadable(option, f"data file '{show(path)}' is not a regular file", label=what,
                     hint=f"{self.data.kind}(...) reads one file")
            return False
        if not os.access(path, os.R_OK):
            self.unreadable(option, f"data file '{show(path)}' cannot be read", label="permission denied")
            return False
        return True

    def _tokenizer(self, path: str) -> None:
        if not self._exists(path, "tokenizer", f"tokenizer directory '{show(path)}'",
                            "a directory saved by save_pretrained(), holding tokenizer.json; relative paths are "
                            "relative to the spec's directory"):
            return
        if not os.path.isdir(path):
            self.unreadable("tokenizer", f"tokenizer '{show(path)}' is not a directory",
                     hint="name the directory that holds tokenizer.json, not the file")
            return
        tj = os.path.join(path, "tokenizer.json")
        if self.roots is not None and outside(tj, (path,)):
            self.out.append(outside_error(self.span("tokenizer"), f"'{show(tj)}'", "the tokenizer directory"))
            return
        if os.path.isfile(tj):
            self._tokenizer_json(tj)
        elif not os.path.isfile(os.path.join(path, "tokenizer_config.json")):
            self.err("E0415", "tokenizer", f"'{show(path)}' holds no tokenizer.json or tokenizer_config.json",
                     hint="save the tokenizer there with tokenizer.save_pretrained(dir) (transformers) or "
                          "tokenizer.save(dir + \"/tokenizer.json\") (tokenizers)")

    def _tokenizer_json(self, tj: str) -> None:
        try:
            if os.path.getsize(tj) > MAX_TOKENIZER_JSON:
                return
            with open(tj, "rb") as f:
                doc = json.loads(f.read())
        except (OSError, ValueError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            self.err("E0415", "tokenizer", f"cannot read '{show(tj)}': {why}",
                     hint="a tokenizer.json as written by the tokenizers library")
            return
        if not isinstance(doc, dict) or not isinstance(doc.get("model"), dict):
            self.err("E0415", "tokenizer", f"'{show(tj)}' is not a tokenizer.json (it has no \"model\")",
                     hint="a tokenizer.json as written by the tokenizers library")
            return
        self.tokenizer_doc = doc
        top = _max_token_id(doc)
        if top is not None and self.vocab is not None and top >= self.vocab:
            self.err("E0413", "tokenizer", f"the tokenizer's ids go up to {top}, beyond the model's vocabulary "
                     f"(vocab_size = {self.vocab})", label=f"{top + 1} tokens",
                     hint=f"set vocab_size to at least {top + 1} (a multiple of 64 is faster), or use the model's "
                          f"own tokenizer")

    # ---- token files
    def _tokens(self, path: str) -> None:
        import numpy as np  # only when a token file is declared

        try:
            with open(path, "rb") as f:
                magic = f.read(6)
                size = os.fstat(f.fileno()).st_size
                if magic == b"\x93NUMPY":
                    f.seek(0)
                    found = self._npy_header(f, np, path)
                    if found is None:
                        return
                    dtype, n, offset = found
                else:
                    if path.endswith(".npy"):
                        self.err("E0412", "path", f"'{show(path)}' is not a .npy file", label="no NUMPY header",
                                 hint="write it with numpy.save, or name a raw binary token file *.bin")
                        return
                    dtype = np.dtype(self.opts.get("dtype") or "uint16")
                    if size % dtype.itemsize:
                        self.err("E0412", "path", f"'{show(path)}' holds {size} bytes, not a whole number of "
                                 f"{dtype.name} tokens ({dtype.itemsize} bytes each)",
                                 hint="a raw token file is a flat array of uint16 or uint32; check its dtype "
                                      "(dtype = \"uint32\"?) or whether it was cut short")
                        return
                    n, offset = size // dtype.itemsize, 0
        except OSError as exc:
            self.unreadable("path", f"cannot read '{show(path)}': {exc.strerror or exc}")
            return
        if n == 0:
            self.too_little(f"token file '{show(path)}' is empty", hint="it must hold at least one global batch")
            return
        gb = self.global_batch()
        seq_len = self.spec.train.seq_len
        if gb is not None and seq_len is not None and n < gb * seq_len:
            if self.batches == 1:
                why = f"one global batch needs (global_batch * seq_len = {gb} * {seq_len} = {gb * seq_len})"
            else:
                why = (f"{self.batches} eval batches need (eval.batches * global_batch * seq_len = {self.batches} * "
                       f"{gb // self.batches} * {seq_len} = {gb * seq_len})")
            self.too_little(f"'{show(path)}' holds {n} tokens, fewer than {why}",
                     hint="use more data, or a smaller global_batch or seq_len"
                          + ("" if self.batches == 1 else ", or fewer eval.batches"))
        if self.vocab is not None:
            count = min(n, SAMPLE_TOKENS)
            try:
                ids = np.fromfile(path, dtype=dtype, count=count, offset=offset)
            except (OSError, ValueError) as exc:
                self.unreadable("path", f"cannot read '{show(path)}': {exc}")
                return
            if ids.size and int(ids.max()) >= self.vocab:
                at = int(np.argmax(ids >= self.vocab))
                sampled = "" if count == n else f" (checked the first {count:,} tokens)"
                self.err("E0413", "path", f"token id {int(ids[at])} at position {at} of '{show(path)}' is outside the "
                         f"model's vocabulary (vocab_size = {self.vocab}){sampled}",
                         hint="the file was made with another tokenizer, or vocab_size is too small"
                              + ("; or the dtype is wrong" if not path.endswith(".npy") else ""))

    def _npy_header(self, f: Any, np: Any, path: str) -> tuple[Any, int, int] | None:
        fmt = np.lib.format
        try:
            version = fmt.read_magic(f)
            if version == (1, 0):
                shape, _fortran, dtype = fmt.read_array_header_1_0(f)
            elif version == (2, 0):
                shape, _fortran, dtype = fmt.read_array_header_2_0(f)
            else:
                shape, _fortran, dtype = fmt._read_array_header(f, version)  # (3, 0): a UTF-8 header
            offset = f.tell()
        except (ValueError, OSError, SyntaxError, TypeError) as exc:
            self.err("E0412", "path", f"'{show(path)}' has a malformed .npy header ({type(exc).__name__})",
                     hint="write it with numpy.save(path, ids.astype(numpy.uint16))")
            return None
        if dtype.byteorder == ">" or dtype.name not in ("uint16", "uint32"):
            self.err("E0412", "path", f"'{show(path)}' holds {dtype.str if dtype.byteorder == '>' else dtype.name} "
                     "values; a token file holds uint16 or uint32 token ids", label=f"dtype {dtype.str}",
                     hint="save it with ids.astype(numpy.uint16) (vocabularies up to 65536) or numpy.uint32")
            return None
        if len(shape) != 1:
            self.err("E0412", "path", f"'{show(path)}' has shape {tuple(shape)}; a token file is one flat "
                     "sequence of token ids (1-D)", hint="save ids.reshape(-1): documents one after another")
            return None
        want = self.opts.get("dtype")
        if want is not None and want != dtype.name:
            self.err("E0412", "dtype", f"dtype = \"{want}\", but '{show(path)}' holds {dtype.name}",
                     hint="a .npy file states its dtype: leave dtype out")
            return None
        n = int(shape[0])
        size = os.fstat(f.fileno()).st_size
        if offset + n * dtype.itemsize > size:
            self.err("E0412", "path", f"'{show(path)}' is cut short: its header promises {n} tokens "
                     f"({offset + n * dtype.itemsize} bytes), the file has {size} bytes")
            return None
        return dtype, n, offset

    # ---- text corpus
    def _text(self, path: str) -> None:
        try:
            with open(path, "rb") as f:
                head = f.read(HEAD_BYTES)
        except OSError as exc:
            self.unreadable("path", f"cannot read '{show(path)}': {exc.strerror or exc}")
            return
        if not head:
            self.too_little(f"text corpus '{show(path)}' is empty", hint="it must hold at least one global batch of tokens")
            return
        try:
            codecs.getincrementaldecoder("utf-8")().decode(head, final=len(head) < HEAD_BYTES)
        except UnicodeDecodeError as exc:
            self.malformed("path", f"'{show(path)}' is not UTF-8 text (byte {exc.start})",
                     hint="convert the corpus to UTF-8")

    def _enough(self, path: str, count: int, gb: int) -> None:
        if count == 0:
            self.too_little(f"'{show(path)}' holds no examples", hint="it must hold at least one global batch")
        elif gb and count < gb:
            what = "global_batch" if self.batches == 1 else "eval.batches * global_batch"
            self.too_little(f"'{show(path)}' holds {count} examples, fewer than {self.needed()} "
                     f"({what} = {gb})", hint="use more data or a smaller global_batch"
                     + ("" if self.batches == 1 else " or eval.batches"))


def _positive(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def _max_token_id(doc: dict[str, Any]) -> int | None:
    """The largest id a tokenizer.json can produce: its model's vocabulary and added tokens."""
    ids: list[int] = []
    vocab = doc["model"].get("vocab")
    if isinstance(vocab, dict):
        ids += [v for v in vocab.values() if isinstance(v, int)]
    elif isinstance(vocab, list):  # Unigram: [[piece, score], ...], ids are positions
        ids.append(len(vocab) - 1)
    for tok in doc.get("added_tokens") or ():
        if isinstance(tok, dict) and isinstance(tok.get("id"), int):
            ids.append(tok["id"])
    return max(ids) if ids else None


def _model_name(spec: Spec) -> str:
    src = spec.model.source
    return f'{src.kind}("{src.target}")'


__all__ = ["check_data", "SAMPLE_TOKENS"]
