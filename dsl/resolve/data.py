"""A data source, `train.data` or `train.eval.data`: `kind(path, options...)` typed, its required
options present, its paths absolute as the locate pass found them."""

from __future__ import annotations

from typing import Any

from .. import ast, schema
from ..spec import DataSpec
from .coerce import call_value
from .scope import Scope, Unresolved, did_you_mean

_DATA_EXAMPLES = {
    "synthetic": "e.g. synthetic(seed = 0)",
    "tokens": 'e.g. tokens("data/train.bin", dtype = "uint16")',
    "text": 'e.g. text("data/corpus.txt", tokenizer = "tokenizer_dir")',
    "jsonl": 'e.g. jsonl("data/train.jsonl", tokenizer = "tokenizer_dir", text = "text", label = "label")',
    "csv": 'e.g. csv("data/train.csv", tokenizer = "tokenizer_dir", text = "text", label = "label")',
    "hf_dataset": 'e.g. hf_dataset("data/shards", tokenizer = "tokenizer_dir", split = "train", text = "text")',
    "image_folder": 'e.g. image_folder("data/images", processor = "processor_dir")',
    "audio_folder": 'e.g. audio_folder("data/speech", tokenizer = "tokenizer_dir", processor = "extractor_dir")',
    "image_text_folder": 'e.g. image_text_folder("data/captioned", tokenizer = "tokenizer_dir")',
}


def resolve_data(scope: Scope, entries: dict[str, ast.Assign], seed: int, where: str = "train.data") -> DataSpec:
    """`data = kind(...)` (`where`: train.data or train.eval.data). Spans of the call and of each
    option given go to `spans[where + ".call"]` and `spans[where + ".<option>"]` for
    dsl/data_check.py."""
    if "data" not in entries:  # train.data left out (train.eval.data is required: E0102)
        name = schema.BLOCKS["train"]["data"].default
        return DataSpec(name, _seeded({k: d for k, (_, d) in schema.DATA_ARGS[name].items()}, seed))
    if isinstance(entries["data"].value, ast.Call) and entries["data"].value.func in schema.DATA_MIX_ARGS:
        from .data_mix import resolve_mix  # mix(...), holdout(...)

        return resolve_mix(scope, entries["data"].value, seed, where, resolve_data)
    name, opts = call_value(scope, entries["data"], "data", schema.DATA_ARGS)
    opts = _seeded(opts, seed)
    v = entries["data"].value
    scope.spans[f"{where}.call"] = v.span
    call = v if isinstance(v, ast.Call) else None
    names = list(schema.DATA_ARGS[name])
    if call is not None:
        for i, a in enumerate(call.args[:len(names)]):
            scope.spans[f"{where}.{names[i]}"] = a.span
        for k in call.kwargs:
            scope.spans[f"{where}.{k.name}"] = k.value.span
    ok = True
    for req in schema.DATA_REQUIRED[name]:
        if opts.get(req) is None:
            what = {"tokenizer": "a tokenizer directory", "path": "a folder path" if name.endswith("_folder") else "a file path"}[req]
            scope.bad_value(v.span, f"{name}(...) needs {what} ({req})", hint=_DATA_EXAMPLES[name])
            ok = False
    for key in ("path", "tokenizer", "text", "label", "split", "messages", "chat_template", "processor", "target"):
        if opts.get(key) == "":
            scope.bad_value(scope.spans.get(f"{where}.{key}", v.span), f"{key} must not be empty")
            ok = False
    dtype = opts.get("dtype")
    if dtype is not None and dtype not in schema.TOKEN_DTYPES:
        scope.unknown_choice(scope.spans.get(f"{where}.dtype", v.span), f"unknown token dtype '{dtype}'",
                  hint=did_you_mean(dtype, schema.TOKEN_DTYPES) or f"choose one of: {', '.join(schema.TOKEN_DTYPES)}")
        ok = False
    if not ok:
        raise Unresolved()
    for key in schema.DATA_PATH_ARGS:
        if opts.get(key) is None:
            continue
        found = scope.located.paths[scope.spans[f"{where}.{key}"]]
        if found.problem is not None:
            scope.diags.append(found.problem)
            ok = False
        else:
            opts[key] = found.path
    if not ok:
        raise Unresolved()
    return DataSpec(name, opts)


def _seeded(opts: dict[str, Any], seed: int) -> dict[str, Any]:
    """A source's options; one without a seed of its own takes `seed`."""
    if opts.get("seed") is None:
        opts["seed"] = seed
    return opts
