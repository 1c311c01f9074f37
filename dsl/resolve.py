"""AST -> Spec: bind names, type values, fill defaults. Collects every error it finds."""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Any, Callable, Iterable

import attrs

from ppdsl.dsl import ast, schema
from ppdsl.dsl.diagnostics import Diagnostic, error, warning
from ppdsl.dsl.exact import ZERO, Expr, Term
from ppdsl.dsl.expr import Divisions, ExprError, source_text, to_expr
from ppdsl.dsl.families import family_of, fused_parts, hf_class_of
from ppdsl.core.locate import PACKAGE_SCHEME, PretrainedDirError, outside, read_pretrained_config, resolve_pretrained_dir
from ppdsl.dsl.span import Span
from ppdsl.dsl.spec import (
    WORLD, CheckpointSpec, DataSpec, EvalSpec, LrScheduleSpec, MeshSpec, ModelSource, ModelSpec, OptimizerSpec,
    PatternIndex, PatternSegment, PipelineSpec, Requirement, Spec, TensorParallelSpec, TpRule, TrainSpec,
)

LANGUAGE_VERSION = 1
MIN_HANG_TIMEOUT_S = 5.0  # train.hang_timeout below this: W0320
# E0419: with --no-model, check reads only files under the spec's directory
OUTSIDE_HINT = ("with --no-model, check reads no file outside the spec's directory; pass --allow-path DIR to "
                "let it read DIR, or check without --no-model if you trust this spec")
_NUMERIC_SECTIONS = ("mesh", "pipeline", "train")


def did_you_mean(name: str, options: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(options), n=1, cutoff=0.6)
    return f"did you mean '{close[0]}'?" if close else ""


def resolve(doc: ast.Document, text: str, roots: tuple[str, ...] | None = None) -> tuple[Spec | None, list[Diagnostic]]:
    """`roots`: the directories files may be read from (None: anywhere); see locate.outside."""
    r = _Resolver(doc, text)
    r.roots = roots
    spec = r.run()
    return spec, r.diags


class _Unresolved(Exception):
    """A value could not be resolved; its diagnostic is already recorded."""


class _Resolver:
    def __init__(self, doc: ast.Document, text: str):
        self.doc = doc
        self.text = text
        self.diags: list[Diagnostic] = []
        self.spans: dict[str, Span] = {}
        self.blocks: dict[str, ast.Block] = {}
        self.requires: list[ast.Require] = []
        self.entries: dict[str, dict[str, ast.Assign]] = {}  # block -> key -> assign
        self.config: dict[str, Any] = {}
        self.config_exprs: dict[str, ast.Assign] = {}
        self.dims: dict[str, int] = {}
        self.values: dict[str, Term] = {}  # "mesh.tp" -> value
        self.evaluating: dict[str, None] = {}  # the chain being evaluated, in order (for cycles)
        self.divisions = Divisions()
        self.family: Any = None  # the model family, once the model block is resolved
        self.hf_class: str | None = None  # the HF model class the source builds, if any
        self.roots: tuple[str, ...] | None = None  # where files may be read (None: anywhere)

    # ---- driver
    def run(self) -> Spec | None:
        self._version()
        self._collect_blocks()
        model = self._model()
        mesh = self._guard(self._mesh)
        tp = self._guard(self._tensor_parallel)
        pipeline = self._guard(self._pipeline)
        train = self._guard(self._train)
        requires = self._requires()
        if any(d.is_error for d in self.diags) or None in (model, mesh, tp, pipeline, train):
            return None
        return Spec(
            file=self.doc.file, model=model, mesh=mesh, tensor_parallel=tp, pipeline=pipeline, train=train,
            requires=tuple(requires), exact_divisions=tuple(self.divisions.items), spans=dict(self.spans),
        )

    def _guard(self, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except _Unresolved:
            return None

    def _err(self, code: str, span: Span | None, message: str, **kw: str) -> None:
        self.diags.append(error(code, span, message, **kw))

    # ---- structure
    def _version(self) -> None:
        if self.doc.version is None:
            self._err("E0106", self._first_span(),
                      "the spec does not start with its language version",
                      hint=f"add `ppspec {LANGUAGE_VERSION}` as the first line")
        elif self.doc.version != LANGUAGE_VERSION:
            self._err("E0106", self.doc.version_span, f"unsupported language version {self.doc.version}",
                      label=f"this ppdsl reads version {LANGUAGE_VERSION}", hint=f"write `ppspec {LANGUAGE_VERSION}`")

    def _collect_blocks(self) -> None:
        for item in self.doc.items:
            if isinstance(item, ast.Require):
                self.requires.append(item)
                continue
            if item.kind not in schema.BLOCKS:
                self._err("E0100", item.kind_span, f"unknown block '{item.kind}'",
                          hint=did_you_mean(item.kind, schema.BLOCKS) or f"blocks are: {', '.join(schema.BLOCKS)}")
                continue
            if item.kind in self.blocks:
                self._err("E0104", item.kind_span, f"block '{item.kind}' is given twice",
                          label="second one here", hint=f"the first is at line {self.blocks[item.kind].span.line}")
                continue
            if item.label is not None and item.kind != "model":
                self._err("E0100", item.kind_span, f"block '{item.kind}' takes no name", label=f"remove '{item.label}'")
            self.blocks[item.kind] = item
            self.spans[item.kind] = item.kind_span
            self.entries[item.kind] = self._block_entries(item, schema.BLOCKS[item.kind], item.kind)
        for required in ("model", "train"):
            if required not in self.blocks:
                keys = ", ".join(f"{k.name} = ..." for k in schema.BLOCKS[required].values() if k.required)
                self._err("E0102", self.doc.version_span or self._first_span(), f"the spec has no '{required}' block",
                          hint=f"add `{required} {{ {keys} }}` (see docs/language.md)")

    def _first_span(self) -> Span:
        """Where a diagnostic about the whole file points: the start of its first entry."""
        first = self.doc.items[0].span if self.doc.items else Span.point(self.doc.file)
        return Span(first.file, first.line, first.column, first.line, first.column + 1)

    def _block_entries(self, block: ast.Block, keys: dict[str, schema.Key], where: str) -> dict[str, ast.Assign]:
        out: dict[str, ast.Assign] = {}
        for entry in block.entries:
            if isinstance(entry, ast.Require):
                self.requires.append(entry)
                continue
            if isinstance(entry, ast.TpRule):
                if where != "tensor_parallel":
                    self._err("E0101", entry.span, f"a split rule `path : style` belongs in tensor_parallel, not in {where}")
                continue
            name = entry.kind if isinstance(entry, ast.Block) else entry.key
            span = entry.kind_span if isinstance(entry, ast.Block) else entry.key_span
            key = keys.get(name)
            if key is None:
                self._err("E0101", span, f"unknown key '{name}' in {where}",
                          hint=did_you_mean(name, keys) or f"keys of {where}: {', '.join(keys) or '(none)'}")
                continue
            if (key.kind == "block") != isinstance(entry, ast.Block):
                if key.kind == "block":
                    self._err("E0103", span, f"'{name}' is a block: write `{name} {{ ... }}`")
                else:
                    self._err("E0103", span, f"'{name}' is a value: write `{name} = ...`")
                continue
            if name in out:
                self._err("E0104", span, f"'{name}' is given twice in {where}", label="second one here",
                          hint=f"the first is at line {out[name].span.line}")
                continue
            out[name] = entry  # type: ignore[assignment]
            self.spans[f"{where}.{name}"] = entry.span
        for key in keys.values():
            if key.required and key.name not in out:
                self._err("E0102", block.kind_span, f"{where} has no '{key.name}'", hint=f"add `{key.name} = ...`: {key.doc}")
        return out

    # ---- model
    def _model(self) -> ModelSpec | None:
        block = self.blocks.get("model")
        if block is None:
            return None
        entries = self.entries["model"]
        source = self._source(entries.get("source"))
        cfg_block = entries.get("config")
        if isinstance(cfg_block, ast.Block):
            self._config(cfg_block)
        if source is None:
            return None
        fam_config = dict(self.config)
        if source.kind == "hf_pretrained":
            source, pretrained_config = self._pretrained(source, entries["source"])
            fam_config = {**pretrained_config, **fam_config}
        family = family_of(source.kind, source.target, fam_config)
        hf_class = hf_class_of(source.kind, source.target, fam_config)
        self.hf_class = hf_class
        dims = {k: v for k, v in family.dims(fam_config, hf_class).items()
                if isinstance(v, int) and not isinstance(v, bool)}
        self.dims = dims
        self.family = family
        self._family_refusals(family, fam_config)
        return ModelSpec(block.label or "model", source, dict(self.config), family.name, dims,
                         {**family.defaults(hf_class), **fam_config})

    def _family_refusals(self, family: Any, config: dict[str, Any]) -> None:
        """Config values the family's stages cannot run (its descriptor's ``refuse``)."""
        for key, (allowed, why) in family.refuse.items():
            value = config.get(key)
            if value is not None and value != allowed:
                spell = lambda v: str(v).lower() if isinstance(v, bool) else repr(v)  # noqa: E731
                self._err("E0407", self.spans.get(f"model.config.{key}") or self.spans.get("model.source"),
                          f"{family.name} models run with {key} = {spell(allowed)} only, not {spell(value)}: {why}",
                          hint=f"set {key} = {spell(allowed)} (or leave it out)")

    def _source(self, assign: ast.Assign | None) -> ModelSource | None:
        if assign is None:
            return None
        v = assign.value
        if not isinstance(v, ast.Call) or v.func not in schema.SOURCES:
            self._err("E0103", v.span, "source must be hf(\"Class\"), hf_pretrained(\"dir\") or python(\"pkg.module:factory\")",
                      hint=did_you_mean(v.func, schema.SOURCES) if isinstance(v, ast.Call) else "")
            return None
        if len(v.args) != 1 or v.kwargs or not isinstance(v.args[0], ast.Str):
            self._err("E0103", v.span, f"{v.func}(...) takes one string")
            return None
        target = v.args[0].value
        if v.func == "python" and (":" not in target or not all(target.partition(":")[::2])):
            self._err("E0103", v.args[0].span, f"python source '{target}' is not of the form 'pkg.module:callable'")
            return None
        if v.func == "hf" and not target.isidentifier():
            self._err("E0103", v.args[0].span, f"'{target}' is not a transformers class name")
            return None
        return ModelSource(v.func, target)

    def _pretrained(self, source: ModelSource, assign: ast.Assign) -> tuple[ModelSource, dict[str, Any]]:
        """The source with its directory resolved (a relative path against the spec's directory,
        ``package:NAME`` inside the installed package), and the directory's config.json."""
        base = Path(self.doc.file).parent
        if not source.target.startswith(PACKAGE_SCHEME) and outside(base / os.path.expanduser(source.target), self.roots):
            self._err("E0419", assign.value.span, f"hf_pretrained: '{source.target}' is outside the spec's directory",
                      label="not read", hint=OUTSIDE_HINT)
            return source, {}
        try:
            path = resolve_pretrained_dir(source.target, require_config=False, base=base)
        except PretrainedDirError as exc:
            self.diags.append(warning("W0401", assign.value.span, f"hf_pretrained: {exc}",
                                      hint="give a local directory holding an HF config.json (relative paths start at "
                                           "the spec's directory), or \"package:NAME\" for one shipped inside an "
                                           "installed Python package"))
            return source, {}
        config_file = path / "config.json"
        try:
            config = read_pretrained_config(path)
        except (OSError, ValueError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            self.diags.append(warning("W0401", assign.value.span, f"cannot read {config_file}: {why}",
                                      hint="the directory must hold an HF config.json"))
            return ModelSource(source.kind, str(path)), {}
        return ModelSource(source.kind, str(path)), config

    def _config(self, block: ast.Block) -> None:
        for entry in block.entries:
            if not isinstance(entry, ast.Assign):
                self._err("E0101", entry.span, "config holds `key = value` entries only")
                continue
            if entry.key in self.config_exprs:
                self._err("E0104", entry.key_span, f"config key '{entry.key}' is given twice")
                continue
            self.config_exprs[entry.key] = entry
            self.spans[f"model.config.{entry.key}"] = entry.span
        for key, entry in self.config_exprs.items():
            try:
                self.config[key] = self._literal(entry.value, config_scope=True)
            except ExprError as exc:
                self.diags.append(exc.diagnostic)

    def _literal(self, v: ast.Expr, config_scope: bool = False) -> Any:
        """A plain value: number, string, bool, none, list; arithmetic over config values."""
        if isinstance(v, ast.Str):
            return v.value
        if isinstance(v, ast.NoneLit):
            return None
        if isinstance(v, ast.Bool):
            return v.value
        if isinstance(v, ast.ListExpr):
            return [self._literal(i, config_scope) for i in v.items if not isinstance(i, ast.RangeItem)]
        if isinstance(v, ast.Call):
            raise ExprError(error("E0103", v.span, f"a call '{v.func}(...)' is not a config value"))
        value = to_expr(v, self._config_lookup if config_scope else self._lookup)
        return _plain_number(value, v.span)

    def _config_lookup(self, name: ast.Name) -> Term:
        key = name.parts[-1] if len(name.parts) == 2 and name.parts[0] in ("config", "model") else name.text
        if key in self.config_exprs and len(name.parts) <= 2:
            if key in self.evaluating:
                raise ExprError(error("E0105", name.span, f"'{key}' is defined in terms of itself",
                                      label=_cycle(self.evaluating, key)))
            if key not in self.config:
                self.evaluating[key] = None
                try:
                    self.config[key] = self._literal(self.config_exprs[key].value, config_scope=True)
                finally:
                    self.evaluating.pop(key, None)
            value = self.config[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ExprError(error("E0103", name.span, f"config '{key}' = {value!r} is not a number"))
            return Expr.const(value)
        raise ExprError(error("E0105", name.span, f"unknown name '{name.text}' in config",
                              hint=did_you_mean(name.text, self.config_exprs) or "config values may refer to other config values only"))

    # ---- names in numeric expressions
    def _known_names(self) -> dict[str, str]:
        """bare or dotted name -> qualified name ("tp" -> "mesh.tp")."""
        names: dict[str, str] = {"world": "world"}
        for k in self.dims:
            names[k] = f"dims.{k}"
        for block in ("train", "pipeline"):
            for k, key in schema.BLOCKS[block].items():
                if key.kind == "int":
                    names[k] = f"{block}.{k}"
                    names[f"{block}.{k}"] = f"{block}.{k}"
        for k in self.config:
            names[k] = f"config.{k}"
            names[f"config.{k}"] = f"config.{k}"
            names[f"model.{k}"] = f"config.{k}"
        for k in ("tp", "pp", "dp"):
            names[k] = f"mesh.{k}"
            names[f"mesh.{k}"] = f"mesh.{k}"
        return names

    def _lookup(self, name: ast.Name) -> Term:
        names = self._known_names()
        q = names.get(name.text)
        if q is None:
            raise ExprError(error("E0105", name.span, f"unknown name '{name.text}'",
                                  hint=did_you_mean(name.text, names) or "names are world, tp, pp, dp, config keys and pipeline/train numbers"))
        if q == "world":
            return WORLD
        if q.startswith("dims."):
            return Expr.const(self.dims[q[5:]])
        if q.startswith("config."):
            value = self.config[q[7:]]
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ExprError(error("E0103", name.span, f"'{name.text}' = {value!r} is not a number"))
            return Expr.const(value)
        return self._numeric(q, name.span)

    def _numeric(self, q: str, use_span: Span | None = None) -> Term:
        if q in self.values:
            return self.values[q]
        if q in self.evaluating:
            raise ExprError(error("E0105", use_span, f"'{q}' is defined in terms of itself",
                                  label=_cycle(self.evaluating, q)))
        block, _, key = q.partition(".")
        assign = self.entries.get(block, {}).get(key)
        self.evaluating[q] = None
        try:
            if assign is not None:
                value = to_expr(assign.value, self._lookup, self.divisions)
                if not isinstance(value, Expr):
                    raise ExprError(error("E0103", assign.value.span, f"{q} must be a number"))
            else:
                value = self._default_numeric(q)
        finally:
            self.evaluating.pop(q, None)
        self.values[q] = value
        return value

    def _default_numeric(self, q: str) -> Term:
        if q == "mesh.dp":
            tp, pp = self._numeric("mesh.tp"), self._numeric("mesh.pp")
            return _ratio(WORLD, tp * pp)
        if q == "pipeline.microbatches":
            if "microbatch_size" in self.entries.get("pipeline", {}):
                return _ratio(self._numeric("train.global_batch"), self._numeric("mesh.dp") * self._numeric("pipeline.microbatch_size"))
            return Expr.const(1)
        if q == "pipeline.microbatch_size":
            return _ratio(self._numeric("train.global_batch"), self._numeric("mesh.dp") * self._numeric("pipeline.microbatches"))
        block, _, key = q.partition(".")
        spec_key = schema.BLOCKS[block][key]
        if spec_key.default is None:
            raise _Unresolved()
        return Expr.const(spec_key.default)

    def _int_value(self, q: str) -> Expr:
        try:
            return self._numeric(q)
        except ExprError as exc:
            self.diags.append(exc.diagnostic)
            raise _Unresolved() from None

    def _concrete_int(self, q: str, minimum: int = 0) -> int:
        v = self._int_value(q)
        span = self.spans.get(q)
        if v.free_symbols:
            self._err("E0103", span, f"{q} cannot depend on the world size", label=str(v))
            raise _Unresolved()
        return _plain_int(v, span, q, minimum, self.diags)

    # ---- mesh
    def _mesh(self) -> MeshSpec:
        values = {}
        for k in ("tp", "pp", "dp"):
            values[k] = self._int_value(f"mesh.{k}")
        return MeshSpec(**values)

    # ---- tensor parallel
    def _tensor_parallel(self) -> TensorParallelSpec:
        block = self.blocks.get("tensor_parallel")
        rules: list[TpRule] = []
        seq_par = False
        if block is not None:
            for entry in block.entries:
                if isinstance(entry, ast.TpRule):
                    rule = self._tp_rule(entry)
                    if rule is not None:
                        rules.append(rule)
            sp = self.entries["tensor_parallel"].get("sequence_parallel")
            if sp is not None:
                seq_par = self._bool(sp)
            hf = self.entries["tensor_parallel"].get("hf_plan")
            if hf is not None and self._bool(hf):
                written = {r.text for r in rules}  # a rule written in the spec wins over HF's
                rules.extend(r for r in self._hf_plan_rules(hf) if r.text not in written)
        return TensorParallelSpec(tuple(rules), seq_par)

    def _hf_plan_rules(self, assign: ast.Assign) -> list[TpRule]:
        """`hf_plan = true`: the split rules the HF class declares, as ppdsl rules (colwise ->
        column, rowwise -> row, embedding_rowwise -> vocab, colwise_gather_output ->
        column(gather_output = true)); entries with no ppdsl equivalent stay replicated (W0223)."""
        splits = self.family.hf_splits(self.hf_class) if self.family is not None else None
        if not splits:
            self._err("E0223", assign.span, f"hf_plan: {self.hf_class or 'the model'} declares no tensor-parallel plan",
                      hint="write the split rules (`path : column` ...) in tensor_parallel")
            return []
        family = self.family
        embedding, head = family.first[0], family.last[-1]
        config = {**family.defaults(self.hf_class), **self.config}
        if config.get("tie_word_embeddings") and not any(s.pattern == embedding and s.style for s in splits):
            # one tensor with the embedding, which HF's plan keeps whole: the head stays whole too
            splits = tuple(attrs.evolve(s, style=None, hf_style=f"{s.hf_style}, tied to the whole {embedding}")
                           if s.pattern == head else s for s in splits)
        lost = [s for s in splits if s.style is None]
        if lost:
            self.diags.append(warning(
                "W0223", assign.span,
                f"hf_plan: {len(lost)} entr{'y' if len(lost) == 1 else 'ies'} of {self.hf_class}'s tensor-parallel plan "
                "cannot be expressed and stay replicated: " + ", ".join(f"{s.pattern} ({s.hf_style})" for s in lost),
                hint="write a rule for them yourself if a ppdsl split style fits"))
        out = []
        in_block = family.blocks + "[*]."
        for s in splits:
            if s.style is None:
                continue
            segs = tuple(PatternSegment(seg[:-3], PatternIndex("all")) if seg.endswith("[*]") else PatternSegment(seg)
                         for seg in s.pattern.split("."))
            # a fused projection (Phi-3's qkv_proj, gate_up_proj) splits each of its parts
            fused = fused_parts(family.name, s.pattern[len(in_block):]) \
                if s.style == "column" and s.pattern.startswith(in_block) else 1
            out.append(TpRule(segs, s.pattern, s.style, fused, s.gather_output, None, assign.span))
        return out

    def _tp_rule(self, entry: ast.TpRule) -> TpRule | None:
        if entry.style not in schema.TP_STYLES:
            self._err("E0107", entry.style_span, f"unknown split style '{entry.style}'",
                      hint=did_you_mean(entry.style, schema.TP_STYLES) or f"styles: {', '.join(schema.TP_STYLES)}")
            return None
        opts = self._call_args(entry.style, entry.args, entry.kwargs, schema.TP_STYLE_ARGS[entry.style], entry.style_span)
        if opts is None:
            return None
        segs = tuple(PatternSegment(s.name, None if s.index is None else PatternIndex(s.index.kind, s.index.start, s.index.stop))
                     for s in entry.pattern.segments)
        if opts.get("fused", 1) < 1:
            self._err("E0103", entry.span, "fused must be at least 1")
            return None
        if opts.get("pad_to") is not None and opts["pad_to"] < 1:
            self._err("E0103", entry.span, "pad_to must be at least 1")
            return None
        return TpRule(segs, entry.pattern.text, entry.style, opts.get("fused", 1), opts.get("gather_output", False),
                      opts.get("pad_to"), entry.span)

    # ---- pipeline
    def _pipeline(self) -> PipelineSpec:
        entries = self.entries.get("pipeline", {})
        style = self._enum("pipeline", "style", entries)
        balance = self._enum("pipeline", "balance", entries)
        chunks = self._int_value("pipeline.chunks")
        if "microbatches" in entries and "microbatch_size" in entries:
            pass  # both given: check requires batch == microbatch_size * microbatches * dp
        microbatches = self._int_value("pipeline.microbatches")
        microbatch_size = self._int_value("pipeline.microbatch_size")
        model = self.blocks.get("model")
        fam = self.family  # for hf_pretrained: from the directory's config.json too
        if fam is None and model is not None and "source" in self.entries.get("model", {}):
            src = self._source_quiet()
            if src is not None:
                fam = family_of(src.kind, src.target, self.config)
        blocks = self._path(entries["blocks"]) if "blocks" in entries else (fam.blocks if fam else "layers")
        first = self._paths(entries["first"]) if "first" in entries else (fam.first if fam else ())
        last = self._paths(entries["last"]) if "last" in entries else (fam.last if fam else ())
        split = self._split(entries["split"]) if "split" in entries else None
        seen: dict[str, str] = {}  # path -> "first" / "last": each module is held by one stage
        for key, paths in (("first", first), ("last", last)):
            for path in paths:
                other = next(((p, k) for p, k in seen.items()
                              if p == path or p.startswith(path + ".") or path.startswith(p + ".")), None)
                if other is not None:
                    self._err("E0109", self.spans.get(f"pipeline.{key}") or self.spans.get("pipeline"),
                              f"pipeline.{key} names '{path}', and pipeline.{other[1]} names '{other[0]}': one module "
                              "would be held by two stages, each training its own copy",
                              hint="list each module once, in first (before the blocks) or last (after them)")
                seen.setdefault(path, key)
                if path == blocks or path.startswith(blocks + ".") or blocks.startswith(path + "."):
                    what = "is" if path == blocks else "lies inside" if path.startswith(blocks + ".") else "contains"
                    self._err("E0109", self.spans.get(f"pipeline.{key}") or self.spans.get("pipeline"),
                              f"pipeline.{key} names '{path}', which {what} the block list '{blocks}'",
                              hint=f"the blocks are cut into stages by split; {key} lists the modules "
                                   f"{'before them (embeddings)' if key == 'first' else 'after them (final norm, head)'}")
        return PipelineSpec(style, chunks, microbatches, microbatch_size, blocks, first, last, split, balance,
                            self._profile(entries, balance))

    def _profile(self, entries: dict[str, ast.Assign], balance: str) -> str | None:
        """`profile = "file"`: made absolute against the spec's directory like a data path (E0419);
        `balance = measured` needs one (E0313). dsl/profile_check.py reads it."""
        if "profile" not in entries:
            if balance == "measured" and "balance" in entries:
                self._err("E0313", entries["balance"].value.span, "balance = measured needs a cost profile",
                          hint='give pipeline.profile = "runs/<name>/profile.json" (ppdsl tune writes one)')
            return None
        v = entries["profile"].value
        if not isinstance(v, ast.Str) or not v.value:
            self._err("E0103", v.span, "profile must be a file path, e.g. \"runs/tiny/profile.json\"")
            raise _Unresolved()
        self.spans["pipeline.profile"] = v.span
        path = os.path.abspath(Path(self.doc.file).parent / os.path.expanduser(v.value))
        if outside(path, self.roots):
            self._err("E0419", v.span, f"cost profile '{v.value}' is outside the spec's directory", label="not read",
                      hint=OUTSIDE_HINT)
            raise _Unresolved()
        return path

    def _source_quiet(self) -> ModelSource | None:
        v = self.entries["model"]["source"].value
        if isinstance(v, ast.Call) and v.func in schema.SOURCES and len(v.args) == 1 and isinstance(v.args[0], ast.Str):
            return ModelSource(v.func, v.args[0].value)
        return None

    def _path(self, assign: ast.Assign) -> str:
        v = assign.value
        if isinstance(v, ast.Name):
            return v.text
        if isinstance(v, ast.Str):
            return v.value
        self._err("E0103", v.span, f"{assign.key} must be a module path such as transformer.h")
        raise _Unresolved()

    def _paths(self, assign: ast.Assign) -> tuple[str, ...]:
        v = assign.value
        items = v.items if isinstance(v, ast.ListExpr) else (v,)
        out = []
        for item in items:
            if isinstance(item, ast.Name):
                out.append(item.text)
            elif isinstance(item, ast.Str):
                out.append(item.value)
            else:
                self._err("E0103", item.span, f"{assign.key} lists module paths: [transformer.wte, transformer.wpe]")
                raise _Unresolved()
        return tuple(out)

    def _split(self, assign: ast.Assign) -> tuple[tuple[int, int], ...] | None:
        v = assign.value
        if isinstance(v, ast.Name) and v.text == "auto":
            return None
        if not isinstance(v, ast.ListExpr) or not v.items:
            self._err("E0103", v.span, "split is `auto` or a list of block ranges such as [0:3, 3:6]")
            raise _Unresolved()
        ranges = []
        for item in v.items:
            if not isinstance(item, ast.RangeItem):
                self._err("E0103", item.span, "each split entry is a range start:stop", hint="e.g. [0:3, 3:6]")
                raise _Unresolved()
            try:
                a = to_expr(item.start, self._lookup)
                b = to_expr(item.stop, self._lookup)
            except ExprError as exc:
                self.diags.append(exc.diagnostic)
                raise _Unresolved() from None
            if a.free_symbols or b.free_symbols or not (a.is_Integer and b.is_Integer):
                self._err("E0103", item.span, "split ranges must be whole numbers")
                raise _Unresolved()
            ranges.append((int(a), int(b)))
            self.spans[f"pipeline.split.{len(ranges) - 1}"] = item.span
        return tuple(ranges)

    # ---- train
    def _train(self) -> TrainSpec:
        entries = self.entries.get("train", {})
        if "train" not in self.blocks:
            raise _Unresolved()
        global_batch = self._int_value("train.global_batch")
        seq_len = self._concrete_int("train.seq_len", 1)
        steps = self._concrete_int("train.steps", 0)
        seed = self._concrete_int("train.seed", 0)
        zero = self._concrete_int("train.zero", 0)
        log_every = self._concrete_int("train.log_every", 1)
        precision = self._enum("train", "precision", entries)
        opt_name, opt = self._train_call(entries, "optimizer", schema.OPTIMIZER_ARGS)
        lrs_name, lrs = self._train_call(entries, "lr_schedule", schema.LR_SCHEDULE_ARGS)
        self._option_ranges(entries, "optimizer", opt)
        self._option_ranges(entries, "lr_schedule", {**lrs, "lr": opt["lr"]})
        data = self._data(entries, seed)
        grad_clip = None
        if "grad_clip" in entries:
            gv = entries["grad_clip"].value
            if not isinstance(gv, ast.NoneLit):
                grad_clip = self._float(entries["grad_clip"])
                if grad_clip <= 0:
                    self._err("E0103", gv.span, "grad_clip must be positive (or none)")
        checkpoint = None
        if "checkpoint" in entries:
            checkpoint = self._checkpoint(entries["checkpoint"])  # type: ignore[arg-type]
        act_ckpt = self._bool(entries["activation_checkpointing"]) if "activation_checkpointing" in entries else False
        save_final = self._bool(entries["save_final"]) if "save_final" in entries else True
        evaluation = None
        if "eval" in entries:
            evaluation = self._eval(entries["eval"], data)  # type: ignore[arg-type]
        metrics = self._enum("train", "metrics", entries)
        peak_tflops = None
        if "peak_tflops" in entries and not isinstance(entries["peak_tflops"].value, ast.NoneLit):
            peak_tflops = self._float(entries["peak_tflops"])
            if peak_tflops <= 0:
                self._err("E0103", entries["peak_tflops"].value.span, "peak_tflops must be positive (or none)")
        trace = self._bool(entries["trace"]) if "trace" in entries else False
        reshard = self._bool(entries["reshard_after_forward"]) if "reshard_after_forward" in entries else False
        hang_timeout = self._hang_timeout(entries.get("hang_timeout"))
        on_nonfinite = self._enum("train", "on_nonfinite", entries)
        max_nonfinite = self._concrete_int("train.max_nonfinite", 1)
        return TrainSpec(
            global_batch=global_batch, seq_len=seq_len, steps=steps, seed=seed,
            optimizer=OptimizerSpec(opt_name, opt["lr"], opt.get("weight_decay", 0.0), tuple(opt.get("betas", (0.9, 0.999))),
                                    opt.get("eps", 1e-8), opt.get("momentum", 0.0)),
            lr_schedule=LrScheduleSpec(lrs_name, lrs["warmup"], lrs.get("min_lr", 0.0)),
            precision=precision, grad_clip=grad_clip, zero=zero, data=data,
            checkpoint=checkpoint, activation_checkpointing=act_ckpt, log_every=log_every, save_final=save_final,
            eval=evaluation, metrics=metrics, peak_tflops=peak_tflops,
            trace=trace, reshard_after_forward=reshard, hang_timeout=hang_timeout,
            on_nonfinite=on_nonfinite, max_nonfinite=max_nonfinite,
        )

    def _hang_timeout(self, assign: ast.Assign | None) -> float | None:
        """train.hang_timeout: seconds (E0320 unless positive; W0320 when so short that a slow
        step or a loaded machine passes for a hang), or off / none."""
        if assign is None:
            return schema.BLOCKS["train"]["hang_timeout"].default
        v = assign.value
        if isinstance(v, ast.NoneLit) or (isinstance(v, ast.Name) and v.text == "off"):
            return None
        value = None if isinstance(v, (ast.Name, ast.Str, ast.Bool)) else self._expr_value(v)
        seconds = float(value) if isinstance(value, Expr) and not value.free_symbols and value.is_number else None
        if seconds is None or not seconds > 0 or seconds == float("inf"):
            self._err("E0320", v.span, "hang_timeout must be a positive number of seconds, or off",
                      hint="e.g. hang_timeout = 60; hang_timeout = off turns the hang watchdog off")
            return None
        if seconds < MIN_HANG_TIMEOUT_S:
            self.diags.append(warning(
                "W0320", v.span, f"hang_timeout = {seconds:g} s is shorter than {MIN_HANG_TIMEOUT_S:g} s: a slow step "
                "or a loaded machine may be taken for a hung rank",
                hint=f"the watchdog looks twice a second; use at least {MIN_HANG_TIMEOUT_S:g} s (default 60)"))
        return seconds

    def _train_call(self, entries: dict[str, ast.Assign], key: str, table: dict[str, dict[str, tuple[str, Any]]]) -> tuple[str, dict[str, Any]]:
        default = schema.BLOCKS["train"][key].default
        if key not in entries:
            return default, {k: d for k, (_, d) in table[default].items()}
        return self._call_value(entries[key], key, table)

    def _call_value(self, assign: ast.Assign, key: str, table: dict[str, dict[str, tuple[str, Any]]]) -> tuple[str, dict[str, Any]]:
        v = assign.value
        if isinstance(v, ast.Name) and len(v.parts) == 1:
            v = ast.Call(v.parts[0], (), (), v.span)
        if not isinstance(v, ast.Call) or v.func not in table:
            name = v.func if isinstance(v, ast.Call) else ""
            self._err("E0107", v.span, f"{key} must be one of: {', '.join(f'{n}(...)' for n in table)}",
                      hint=did_you_mean(name, table) if name else "")
            raise _Unresolved()
        opts = self._call_args(v.func, v.args, v.kwargs, table[v.func], v.span)
        if opts is None:
            raise _Unresolved()
        return v.func, opts

    def _option_ranges(self, entries: dict[str, ast.Assign], key: str, opts: dict[str, Any]) -> None:
        """E0108: an option torch would refuse (or that means nothing), before anything runs."""
        if key not in entries:
            return
        call = entries[key].value
        spans = {k.name: k.value.span for k in getattr(call, "kwargs", ())}
        names = list((schema.OPTIMIZER_ARGS if key == "optimizer" else schema.LR_SCHEDULE_ARGS).get(getattr(call, "func", ""), ()))
        spans.update({names[i]: a.span for i, a in enumerate(getattr(call, "args", ())[:len(names)])})
        for name, (ok, want) in schema.OPTION_RANGES.items():
            value = opts.get(name)
            if name not in spans or value is None:
                continue
            values = value if isinstance(value, tuple) else (value,)
            bad = next((v for v in values if not ok(v, opts)), None)
            if bad is not None:
                shown = f"{name} = {bad:g}" if len(values) == 1 else f"{name} = [{', '.join(f'{v:g}' for v in values)}]"
                self._err("E0108", spans[name], f"{shown} is out of range: {name} must be {want}",
                          label=f"{bad:g} is out of range" if len(values) > 1 else "")

    def _data(self, entries: dict[str, ast.Assign], seed: int, where: str = "train.data") -> DataSpec:
        """`data = kind(...)` (`where`: train.data or train.eval.data): options typed, required
        ones present, paths made absolute against the spec file's directory. Spans of the call
        and of each option given go to `spans[where + ".call"]` and `spans[where + ".<option>"]`
        for dsl/data_check.py."""
        if where == "train.data":
            name, opts = self._train_call(entries, "data", schema.DATA_ARGS)
        else:
            name, opts = self._call_value(entries["data"], "data", schema.DATA_ARGS)
        if opts.get("seed") is None:
            opts["seed"] = seed
        if "data" not in entries:
            return DataSpec(name, opts)
        v = entries["data"].value
        self.spans[f"{where}.call"] = v.span
        call = v if isinstance(v, ast.Call) else None
        names = list(schema.DATA_ARGS[name])
        if call is not None:
            for i, a in enumerate(call.args[:len(names)]):
                self.spans[f"{where}.{names[i]}"] = a.span
            for k in call.kwargs:
                self.spans[f"{where}.{k.name}"] = k.value.span
        ok = True
        for req in schema.DATA_REQUIRED[name]:
            if opts.get(req) is None:
                what = "a tokenizer directory" if req == "tokenizer" else "a file path"
                self._err("E0103", v.span, f"{name}(...) needs {what} ({req})", hint=_DATA_EXAMPLES[name])
                ok = False
        for key in ("path", "tokenizer", "text", "label"):
            if opts.get(key) == "":
                self._err("E0103", self.spans.get(f"{where}.{key}", v.span), f"{key} must not be empty")
                ok = False
        dtype = opts.get("dtype")
        if dtype is not None and dtype not in schema.TOKEN_DTYPES:
            self._err("E0107", self.spans.get(f"{where}.dtype", v.span), f"unknown token dtype '{dtype}'",
                      hint=did_you_mean(dtype, schema.TOKEN_DTYPES) or f"choose one of: {', '.join(schema.TOKEN_DTYPES)}")
            ok = False
        if not ok:
            raise _Unresolved()
        base = Path(self.doc.file).parent
        for key in schema.DATA_PATH_ARGS:
            value = opts.get(key)
            if value is None:
                continue
            if key == "tokenizer" and value.startswith(PACKAGE_SCHEME):  # the tokenizer shipped with a model
                try:
                    opts[key] = str(resolve_pretrained_dir(value, require_config=False))
                except PretrainedDirError as exc:
                    self._err("E0410", self.spans.get(f"{where}.tokenizer", v.span), f"tokenizer: {exc}",
                              hint="install the package, or give the tokenizer's directory")
                    raise _Unresolved() from None
            else:
                opts[key] = os.path.abspath(base / os.path.expanduser(value))
                if outside(opts[key], self.roots):
                    what = "tokenizer directory" if key == "tokenizer" else "data file"
                    self._err("E0419", self.spans.get(f"{where}.{key}", v.span),
                              f"{what} '{value}' is outside the spec's directory", label="not read", hint=OUTSIDE_HINT)
                    ok = False
        if not ok:
            raise _Unresolved()
        return DataSpec(name, opts)

    def _eval(self, block: ast.Block, train_data: DataSpec) -> EvalSpec | None:
        """`eval { data = ..., every = N, batches = K }`. Synthetic eval data without a seed
        takes the training data's seed + 1, so it is not the training stream."""
        entries = self._block_entries(block, schema.EVAL_KEYS, "train.eval")
        if "data" not in entries:
            return None  # E0102 said so
        data = self._data(entries, int(train_data.options.get("seed", 0)) + 1, where="train.eval.data")
        values = {"every": 0, "batches": 1}
        ok = True
        for key, minimum in (("every", 0), ("batches", 1)):
            if key in entries:
                v = entries[key].value
                try:
                    values[key] = _plain_int(self._expr_value(v), v.span, f"eval.{key}", minimum, self.diags)
                except _Unresolved:
                    ok = False
        if not ok:
            raise _Unresolved()
        return EvalSpec(data, values["every"], values["batches"])

    def _checkpoint(self, block: ast.Block) -> CheckpointSpec | None:
        entries = self._block_entries(block, schema.CHECKPOINT_KEYS, "train.checkpoint")
        if "dir" not in entries:
            return None
        d = entries["dir"].value
        if not isinstance(d, ast.Str):
            self._err("E0103", d.span, "checkpoint dir must be a string")
            return None
        every = 0
        if "every" in entries:
            every = _plain_int(self._expr_value(entries["every"].value), entries["every"].span, "every", 0, self.diags)
        return CheckpointSpec(d.value, every)

    # ---- requirements
    def _requires(self) -> list[Requirement]:
        out = []
        for req in self.requires:
            try:
                cond = to_expr(req.expr, self._lookup, self.divisions)
            except ExprError as exc:
                self.diags.append(exc.diagnostic)
                continue
            except _Unresolved:
                continue
            if isinstance(cond, Expr):
                self._err("E0103", req.expr.span, "require needs a condition such as `n_embd % (tp * 64) == 0`")
                continue
            out.append(Requirement(cond, source_text(req.expr.span, self.text), req.message, req.span))
        return out

    # ---- small typed readers
    def _expr_value(self, v: ast.Expr) -> Term:
        try:
            return to_expr(v, self._lookup)
        except ExprError as exc:
            self.diags.append(exc.diagnostic)
            raise _Unresolved() from None

    def _bool(self, assign: ast.Assign) -> bool:
        v = assign.value
        if not isinstance(v, ast.Bool):
            self._err("E0103", v.span, f"{assign.key} must be true or false")
            raise _Unresolved()
        return v.value

    def _float(self, assign: ast.Assign) -> float:
        value = self._expr_value(assign.value)
        if not isinstance(value, Expr) or value.free_symbols or not value.is_number:
            self._err("E0103", assign.value.span, f"{assign.key} must be a number")
            raise _Unresolved()
        try:
            return float(value)
        except OverflowError:
            self._err("E0103", assign.value.span, f"{assign.key} is out of range")
            raise _Unresolved() from None

    def _enum(self, block: str, key: str, entries: dict[str, ast.Assign]) -> str:
        spec_key = schema.BLOCKS[block][key]
        if key not in entries:
            return spec_key.default
        v = entries[key].value
        name = v.text if isinstance(v, ast.Name) else v.value if isinstance(v, ast.Str) else None
        if isinstance(v, ast.Num) and v.text in spec_key.choices:  # `precision = 1f1b` can't lex as a name
            name = v.text
        if name is None or name not in spec_key.choices:
            shown = name if name is not None else source_text(v.span, self.text)
            self._err("E0107", v.span, f"unknown {key} '{shown}'",
                      hint=did_you_mean(str(shown), spec_key.choices) or f"choose one of: {', '.join(spec_key.choices)}")
            raise _Unresolved()
        return name

    def _call_args(self, func: str, args: tuple[ast.Expr, ...], kwargs: tuple[ast.KwArg, ...],
                   table: dict[str, tuple[str, Any]], span: Span) -> dict[str, Any] | None:
        out = {k: d for k, (_, d) in table.items()}
        names = list(table)
        ok = True
        if len(args) > len(names):
            self._err("E0103", span, f"{func}(...) takes at most {len(names)} values", hint=f"arguments: {', '.join(names) or 'none'}")
            return None
        pairs = [(names[i], a, a.span) for i, a in enumerate(args)] + [(k.name, k.value, k.span) for k in kwargs]
        seen: set[str] = set()
        for name, value, vspan in pairs:
            if name not in table:
                self._err("E0107", vspan, f"{func}(...) has no option '{name}'",
                          hint=did_you_mean(name, table) or f"options: {', '.join(names) or 'none'}")
                ok = False
                continue
            if name in seen:
                self._err("E0104", vspan, f"option '{name}' is given twice")
                ok = False
                continue
            seen.add(name)
            kind = table[name][0]
            try:
                out[name] = self._typed(kind, value, name)
            except (ExprError, _Unresolved) as exc:
                if isinstance(exc, ExprError):
                    self.diags.append(exc.diagnostic)
                ok = False
        return out if ok else None

    def _typed(self, kind: str, v: ast.Expr, name: str) -> Any:
        if kind == "bool":
            if not isinstance(v, ast.Bool):
                raise ExprError(error("E0103", v.span, f"{name} must be true or false"))
            return v.value
        if kind == "floats2":
            if not isinstance(v, ast.ListExpr) or len(v.items) != 2:
                raise ExprError(error("E0103", v.span, f"{name} must be a list of two numbers, e.g. [0.9, 0.95]"))
            return tuple(self._typed("float", i, name) for i in v.items)  # type: ignore[arg-type]
        if kind == "str":
            if not isinstance(v, ast.Str):
                raise ExprError(error("E0103", v.span, f"{name} must be a string"))
            return v.value
        value = _plain_number(to_expr(v, self._lookup), v.span)
        if kind == "int":
            if not isinstance(value, int):
                raise ExprError(error("E0103", v.span, f"{name} must be a whole number"))
            return value
        try:
            return float(value)
        except OverflowError:
            raise ExprError(error("E0103", v.span, f"{name} is out of range")) from None


_DATA_EXAMPLES = {
    "synthetic": "e.g. synthetic(seed = 0)",
    "tokens": 'e.g. tokens("data/train.bin", dtype = "uint16")',
    "text": 'e.g. text("data/corpus.txt", tokenizer = "tokenizer_dir")',
    "jsonl": 'e.g. jsonl("data/train.jsonl", tokenizer = "tokenizer_dir", text = "text", label = "label")',
    "csv": 'e.g. csv("data/train.csv", tokenizer = "tokenizer_dir", text = "text", label = "label")',
}


def _cycle(chain: dict[str, None], name: str) -> str:
    names = list(chain)
    return " -> ".join(names[names.index(name):] + [name])


def _ratio(a: Expr, b: Expr) -> Expr:
    """A derived default a / b. A zero b (tp = 0, microbatches = 0) is reported by the rules on
    the value the user wrote; the derived value becomes 0, which no rule accepts either."""
    return ZERO if b.is_zero else a / b


def _plain_number(value: Term, span: Span) -> int | float:
    if not isinstance(value, Expr) or value.free_symbols or not value.is_number:
        raise ExprError(error("E0103", span, "expected a number here", label="cannot depend on the world size"
                              if isinstance(value, Expr) and value.free_symbols else "not a number"))
    if value.is_Integer:
        return int(value)
    try:
        f = float(value)  # a fraction such as `1 / 1000` in a float option or config value
    except OverflowError:
        f = float("inf")
    if f != f or f in (float("inf"), float("-inf")):
        raise ExprError(error("E0103", span, "number out of range"))
    return f


def _plain_int(v: Term, span: Span | None, what: str, minimum: int, diags: list[Diagnostic]) -> int:
    if not isinstance(v, Expr) or not v.is_Integer:
        diags.append(error("E0103", span, f"{what} must be a whole number", label=str(v)))
        raise _Unresolved()
    if int(v) < minimum:
        diags.append(error("E0103", span, f"{what} must be at least {minimum}", label=f"is {int(v)}"))
        raise _Unresolved()
    return int(v)
