"""The model block: its source, its config (with an hf_pretrained directory's config.json
under it), the family that runs it and the config values that family refuses."""

from __future__ import annotations

from typing import Any

from ppdsl.core.config_tree import deep_merge
from ppdsl.core.labels import is_classification

from .. import ast, schema
from ..expr import ExprError
from ..families import family_of, hf_class_of
from ..spec import ModelSource, ModelSpec
from .config_domain import nested_domain_problems
from .scope import Scope, did_you_mean


def resolve_model(scope: Scope) -> ModelSpec | None:
    block = scope.blocks.get("model")
    if block is None:
        return None
    entries = scope.entries["model"]
    source = _source(scope, entries.get("source"))
    cfg_block = entries.get("config")
    if isinstance(cfg_block, ast.Block):
        _config(scope, cfg_block)
    if source is None:
        return None
    fam_config = dict(scope.config)
    if source.kind == "hf_pretrained":
        source, pretrained_config = _pretrained(scope, source, entries["source"])
        fam_config = deep_merge(pretrained_config, fam_config)
    family = family_of(source.kind, source.target, fam_config)
    hf_class = hf_class_of(source.kind, source.target, fam_config)
    scope.hf_class = hf_class
    scope.dims = _dims(family, fam_config, hf_class)
    scope.family = family
    _family_refusals(scope, family, hf_class, fam_config)
    _config_domains(scope, family, source, fam_config)
    config = {**family.build_config, **scope.config} if source.kind != "python" else dict(scope.config)
    return ModelSpec(block.label or "model", source, config, family.name, scope.dims,
                     deep_merge({**family.defaults(hf_class), **family.build_config}, fam_config))


def _dims(family: Any, config: dict[str, Any], hf_class: str | None) -> dict[str, int]:
    """The canonical dims; a composite model's (LLaVA, Blip2) that its top-level config lacks come
    from its language model's sub-config (`text_config`, HF's `get_text_config`), so seq_len is
    held against the positions of the model that reads the tokens (E0216)."""
    dims = family.dims(config, hf_class)
    text = config.get("text_config")
    if isinstance(text, dict):
        dims = {**family.dims(text), **dims}
    return {k: v for k, v in dims.items() if isinstance(v, int) and not isinstance(v, bool)}


def written_source(scope: Scope) -> ModelSource | None:
    """The source as written, without a diagnostic (None when it is malformed or not given)."""
    assign = scope.entries.get("model", {}).get("source")
    v = assign.value if assign is not None else None
    if isinstance(v, ast.Call) and v.func in schema.SOURCES and len(v.args) == 1 and isinstance(v.args[0], ast.Str):
        return ModelSource(v.func, v.args[0].value)
    return None


def _config_domains(scope: Scope, family: Any, source: ModelSource, config: dict[str, Any]) -> None:
    """E0432: config values outside what the model's code runs (`config_domain`)."""
    classification = is_classification(family.name, source.kind, source.target, config)
    for key, message, hint in nested_domain_problems(config, dict(family.config_keys), classification):
        at = scope.spans.get(f"model.config.{key}")
        scope.err("E0432", at or scope.spans.get("model.source"),
                  message + ("" if at else f" (the config.json's {key})"), hint=hint)


def _family_refusals(scope: Scope, family: Any, hf_class: str | None, config: dict[str, Any]) -> None:
    """Config values the family's stages cannot run (its descriptor's ``refuse``)."""
    for key, (allowed, why) in family.refuse.items():
        value = config.get(key)
        if value is not None and value != allowed:
            spell = lambda v: str(v).lower() if isinstance(v, bool) else repr(v)  # noqa: E731
            scope.err("E0407", scope.spans.get(f"model.config.{key}") or scope.spans.get("model.source"),
                      f"{hf_class or family.name} runs with {key} = {spell(allowed)} only, not {spell(value)}: {why}",
                      hint=f"set {key} = {spell(allowed)} (or leave it out)")


def _source(scope: Scope, assign: ast.Assign | None) -> ModelSource | None:
    if assign is None:
        return None
    v = assign.value
    if not isinstance(v, ast.Call) or v.func not in schema.SOURCES:
        scope.bad_value(v.span, "source must be hf(\"Class\"), hf_pretrained(\"dir\") or python(\"pkg.module:factory\")",
                  hint=did_you_mean(v.func, schema.SOURCES) if isinstance(v, ast.Call) else "")
        return None
    if len(v.args) != 1 or v.kwargs or not isinstance(v.args[0], ast.Str):
        scope.bad_value(v.span, f"{v.func}(...) takes one string")
        return None
    target = v.args[0].value
    if v.func == "python" and (":" not in target or not all(target.partition(":")[::2])):
        scope.bad_value(v.args[0].span, f"python source '{target}' is not of the form 'pkg.module:callable'")
        return None
    if v.func == "hf" and not target.isidentifier():
        scope.bad_value(v.args[0].span, f"'{target}' is not a transformers class name")
        return None
    return ModelSource(v.func, target)


def _pretrained(scope: Scope, source: ModelSource, assign: ast.Assign) -> tuple[ModelSource, dict[str, Any]]:
    """The source with its directory as the locate pass found it, and the directory's config.json."""
    found = scope.located.pretrained[assign.value.args[0].span]  # type: ignore[union-attr]
    if found.problem is not None:
        scope.diags.append(found.problem)
    if found.directory is None:
        return source, {}
    return ModelSource(source.kind, found.directory), dict(found.config)


def _config(scope: Scope, block: ast.Block) -> None:
    """The config's values into `scope.config`; a nested block (`text_config { ... }`) is a dict."""
    blocks = _config_entries(scope, block, "", scope.config_exprs)
    for key, entry in scope.config_exprs.items():
        try:
            scope.config[key] = scope.config_value(entry.value)
        except ExprError as exc:
            scope.diags.append(exc.diagnostic)
    for key, sub in blocks.items():
        scope.config[key] = _config_block(scope, sub, key)


def _config_entries(scope: Scope, block: ast.Block, path: str, exprs: dict[str, ast.Assign]) -> dict[str, ast.Block]:
    """The `key = value` entries of a config block (`path`: "" for config itself, else the
    nested block's dotted path) into `exprs`; its nested blocks, returned. Records their spans."""
    blocks: dict[str, ast.Block] = {}
    where = f"config block '{path}'" if path else "config"
    for entry in block.entries:
        if not isinstance(entry, (ast.Assign, ast.Block)):
            scope.unknown_key(entry.span, f"{where} holds `key = value` entries and `key {{ ... }}` blocks only")
            continue
        key = entry.key if isinstance(entry, ast.Assign) else entry.kind
        key_span = entry.key_span if isinstance(entry, ast.Assign) else entry.kind_span
        first = exprs.get(key) or blocks.get(key)
        if first is not None:
            scope.given_twice(key_span, f"config key '{f'{path}.' if path else ''}{key}' is given twice",
                              hint=f"the first is at line {first.span.line}")
            continue
        if isinstance(entry, ast.Block):
            if entry.label is not None:
                scope.unknown_key(entry.kind_span, f"config block '{key}' takes no name", label=f"remove '{entry.label}'")
            blocks[key] = entry
        else:
            exprs[key] = entry
        scope.spans[f"model.config.{f'{path}.' if path else ''}{key}"] = entry.span
    return blocks


def _config_block(scope: Scope, block: ast.Block, path: str) -> dict[str, Any]:
    """A nested config block's values: a dict, its own nested blocks dicts in it. Its values may
    use the block's own keys (`head_dim = hidden_size / num_attention_heads`)."""
    exprs: dict[str, ast.Assign] = {}
    blocks = _config_entries(scope, block, path, exprs)
    values: dict[str, Any] = {}
    lookup = scope.block_lookup(exprs, values, path)
    for key, entry in exprs.items():
        if key in values:
            continue
        try:
            values[key] = scope.config_value(entry.value, lookup)
        except ExprError as exc:
            scope.diags.append(exc.diagnostic)
    out = {key: values[key] for key in exprs if key in values}
    for key, sub in blocks.items():
        out[key] = _config_block(scope, sub, f"{path}.{key}")
    return out
