"""Config fuzz with the model: mutate one `model { config { ... } }` value of every shipped and
test spec, check each mutant with the model, verify a sample of the accepted ones.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/config_fuzz.py [--mutants 520] [--verify 32]
        [--runs 8] [--seed 31] [--out docs/config_fuzz.md] [--cases tests/config_fuzz_cases]
        [--only REGEX] [--check-timeout 60] [--verify-timeout 420] [--confirm-timeout 300]
        [--result RESULT.json]
    .venv/bin/python benchmarks/config_fuzz.py --from-result RESULT.json --out ...   # report again
    .venv/bin/python benchmarks/config_fuzz.py --confirm tests/config_fuzz_cases/failures.json

Base specs (``collect_bases``): ``specs/*.ppspec``; the golden specs whose expected result is ok
(``tests/golden/*.json`` with ``"ok": true``); and the spec texts the tests build, taken from the
tests themselves rather than copied: ``tests/test_families.py``'s ``spec_text(name, "1f1b")`` for
every case of ``ALL_CASES``, ``tests/test_own_forward.py``'s ``spec_text(cls, config)`` for
``CASES`` (pp 2) and ``_tp_spec(cls, config, split)`` for ``TP_CASES`` (pp 2 x tp 2). The test
modules are imported by path with ``tests/`` on ``sys.path``, as pytest's rootdir-relative
imports have it (they import ``_exec_harness`` / ``dist_harness`` from there, and torch); no
test runs. Every base is checked first with the model (world sizes swept); its smallest valid
world is the world its mutants are checked at. A base check refuses is listed, not mutated.

Mutants (``mutate``, seeded): one entry of the config block per mutant, its value replaced (the
rest of the spec byte for byte the base's), or a key of the model's config class the spec does
not write added (its default replaced), or an entry removed. The value kinds, by the type of
the value they replace: for an integer zero, small (1 2 3 5 7), large (64 .. 65536), huge
(2**31 .. 10**30), odd, a non-divisor of what the value must divide or be divided by (heads vs
hidden, kv heads vs heads, an odd ffn or vocab under tp 2, a layer count that is not a multiple
of pp x chunks, positions below seq_len, an odd head_dim, ...), negative, a float (``v + 0.5``,
``1e-3``), an integral float (``32.0``), a bool, a string, ``none``, an expression over another
config key (``hidden_size / 3``, inexact). For floats, bools, strings and lists their own
kinds (0, negative, 1e30, a flipped bool, an unknown activation name, a shorter list, ...).

Each mutant is checked by ``ppdsl check MUTANT --world N --format json`` through
``ppdsl.cli.main`` in a long-lived worker process (torch and transformers imported once; a
check with the model then costs 0.3 - 6 s instead of 5 - 10 s more as a fresh command), its
standard output and error captured (Python level, and the worker's file descriptors 1 and 2,
so a traceback written by anything is seen). The worker is killed and restarted on a timeout,
so a hang or a crash of the interpreter is one mutant's verdict, not the fuzz's end. Verdicts:

- ``ok``: exit 0; then ``ppdsl plan MUTANT --world N --format json`` (lowering; the parameter
  count decides whether the mutant is small enough to verify on CPU): ``plan-failed`` when it
  does not exit 0 although check accepted the spec;
- ``refused``: exit 2 with at least one error diagnostic, each with a line and a column
  (``refused-unplaced`` when an error has no position);
- ``internal-error``: ``ppdsl: internal error`` (an exception ``cli.main`` caught);
- ``traceback``: ``Traceback (most recent call last)`` anywhere in the output, or an exception
  escaping ``cli.main``;
- ``timeout`` (over ``--check-timeout`` s), ``crash`` (the worker process died), ``other``.

Then ``--verify`` accepted mutants whose effective config differs from their base's (not
``32.0`` for ``32``), at most 4 ranks and ``VERIFY_MAX_PARAMS`` parameters, the values at the
edge of meaning first (zero, negative, bool, expression, huge, float, removed, ...), then those of
a shape key, one base after another (``spread``), each run by ``ppdsl verify MUTANT --world N
--steps 2`` in a subprocess (verify itself reruns a later-step fp32 drift in fp64). A FAILED one
that verify did not already rerun in fp64 is run again with ``--set train.precision=fp64``:
``OK``, ``OK (fp64 drift)`` (verify's own rerun called the fp32 drift rounding), ``FAILED (fp32
only)``, ``FAILED (fp64 confirms)``, ``crash`` (accepted by check, but a rank could not run it,
or an internal error / traceback), ``refused`` (verify's check refused what check accepted),
``timeout``. A mutant that changes a dropout rate is not verified (verify sets every rate above
0 to 0 in both runs, so it would compare the base): ``--runs`` of them (an out-of-range rate
first) are trained for one step, ``ppdsl run MUTANT --nproc N --set train.steps=1 --set
train.save_final=false``: ``OK``, ``crash``, ``timeout``.

Commands the fuzz starts, and its check worker, run with their address space limited to
``MEMORY_LIMIT`` (a config can make a library allocate without end).

Every failure (internal error, traceback, timeout, crash, plan-failed, unplaced, a verify
FAILED that fp64 confirms, a verify or run crash) is rerun at the end as a fresh ``ppdsl`` command
(``PPDSL_DEBUG=1``: the traceback) at the working tree's commit then, its distinct causes
saved as ``tests/config_fuzz_cases/NN_<base>_<key>.ppspec`` (a header of ``#`` lines: what,
the command, the output's key lines; a ``# diagnosis:`` line written by hand is kept when the
case is saved again) and all of them in ``tests/config_fuzz_cases/failures.json``; the report
(``--out``) has the figures, the counts per verdict and per value kind, every verify, and every
failure with its mutant.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import io
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
CASES_DIR = TESTS / "config_fuzz_cases"
VERIFY_MAX_PARAMS = 2_000_000  # a verify of 4 ranks + one process on 2 CPU cores: about 30 - 90 s
VERIFY_MAX_WORLD = 4
RUN_SETS = "--set train.steps=1 --set train.save_final=false"  # a run of a mutant: one step, no model written
MEMORY_LIMIT = 6 << 30  # address space of the check worker and of each command the fuzz starts: a config
# that makes a library allocate without end (num_labels = 2**31: an id2label dict of that many
# entries) ends in a MemoryError instead of filling a shared machine
FAILING_CHECK = ("internal-error", "traceback", "timeout", "crash", "plan-failed", "refused-unplaced", "other")
FAILING_VERIFY = ("FAILED (fp64 confirms)", "crash", "timeout", "refused")
FAILING_RUN = ("crash", "timeout")


# ---- base specs -----------------------------------------------------------------------------------


@dataclass
class Base:
    name: str  # "specs/gpt2", "golden/E0224_constant_groups_fixed", "families/llama", "own/...", "own_tp/..."
    origin: str  # where the text comes from
    text: str
    directory: str  # where its relative paths (data/...) are looked up
    world: int = 0  # smallest world check accepts (set by the base check)
    status: str = ""  # "ok" or why it is not mutated
    config: dict[str, Any] = field(default_factory=dict)


def _import_test_module(name: str) -> Any:
    """tests/<name>.py imported by path, with tests/ on sys.path (its own helper imports)."""
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, TESTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def collect_bases(only: str | None = None) -> list[Base]:
    bases: list[Base] = []
    for path in sorted((ROOT / "specs").glob("*.ppspec")):
        bases.append(Base(f"specs/{path.stem}", str(path.relative_to(ROOT)), path.read_text(encoding="utf-8"),
                          str(path.parent)))
    for path in sorted((TESTS / "golden").glob("*.ppspec")):
        expected = path.with_suffix(".json")
        try:
            ok = json.loads(expected.read_text(encoding="utf-8")).get("ok") is True
        except (OSError, ValueError, AttributeError):
            ok = False
        if ok:
            bases.append(Base(f"golden/{path.stem}", str(path.relative_to(ROOT)), path.read_text(encoding="utf-8"),
                              str(path.parent)))
    fam = _import_test_module("test_families")
    for name in fam.ALL_CASES:
        bases.append(Base(f"families/{name}", f'tests/test_families.py spec_text("{name}", "1f1b")',
                          fam.spec_text(name, "1f1b"), str(TESTS)))
    own = _import_test_module("test_own_forward")
    for cls, config in own.CASES.items():
        bases.append(Base(f"own/{cls}", f'tests/test_own_forward.py spec_text("{cls}", CASES["{cls}"])',
                          own.spec_text(cls, config), str(TESTS)))
    for name, (cls, config, split) in own.TP_CASES.items():
        bases.append(Base(f"own_tp/{name}", f'tests/test_own_forward.py _tp_spec(*TP_CASES["{name}"])',
                          own._tp_spec(cls, config, split), str(TESTS)))
    if only:
        bases = [b for b in bases if re.search(only, b.name)]
    return bases


# ---- config entries and their mutation ----------------------------------------------------------------


@dataclass
class Entry:
    key: str
    value: Any  # as resolved (spec.model.config)
    start: int  # offsets of "key = value" in the text
    end: int


@dataclass
class Mutant:
    id: str
    base: str
    key: str
    kind: str  # value kind: zero, small, nondiv, ...
    action: str  # replace / add / remove
    old: str
    new: str
    text: str
    world: int
    path: str = ""
    check: dict[str, Any] = field(default_factory=dict)
    plan_params: int | None = None
    differs: bool = True
    verify: dict[str, Any] = field(default_factory=dict)
    run: dict[str, Any] = field(default_factory=dict)


def _offset(text: str, line: int, column: int) -> int:
    lines = text.splitlines(keepends=True)
    return sum(len(x) for x in lines[: line - 1]) + column - 1


def load(text: str) -> Any:
    from ppdsl.dsl.check import load_text

    spec, _diags, _ = load_text(text, "<fuzz>.ppspec", ())
    return spec


def config_entries(text: str) -> tuple[list[Entry], Any, int | None]:
    """The config block's entries (key, resolved value, text offsets), the spec, and the offset
    where a new entry can be written (after the last one); ([], spec, None) without a block."""
    spec = load(text)
    if spec is None:
        return [], None, None
    entries = []
    for key, value in spec.model.config.items():
        span = spec.spans.get(f"model.config.{key}")
        if span is None:
            continue
        entries.append(Entry(key, value, _offset(text, span.line, span.column),
                             _offset(text, span.end_line, span.end_column)))
    entries.sort(key=lambda e: e.start)
    if entries:
        return entries, spec, entries[-1].end
    block = spec.spans.get("model.config")
    if block is None:
        return [], spec, None
    close = _offset(text, block.end_line, block.end_column) - 1  # the closing brace
    return [], spec, close if text[close] == "}" else None


def spec_value(value: Any) -> str:
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))
    from _front_end import spec_value as tests_spec_value  # the tests' writer of config values

    if isinstance(value, float) and (math.isinf(value) or math.isnan(value)):
        return "1e999" if value > 0 else "-1e999"
    return tests_spec_value(value)


_ROLES = [  # (dimension, key pattern): what a config key is, for the non-divisor mutation
    ("kv_heads", r"key_value_heads|kv_heads|^n_kv|multi_query_group"),
    ("head_dim", r"head_dim|kv_channels|^d_kv$|rotary_dim|head_size"),
    ("experts_per_tok", r"experts_per_tok|top_k|moe_topk"),
    ("experts", r"experts$|local_experts|n_routed_experts"),
    ("heads", r"heads|n_head$"),
    ("layers", r"layers$|n_layer$|num_layers|max_window_layers"),
    ("ffn", r"intermediate|inner|ffn|^hidden_dim$|^d_ff$"),
    ("hidden", r"hidden_size|n_embd|d_model|^dim$|emb_dim|embedding_size|word_embed_proj_dim"),
    ("vocab", r"vocab"),
    ("positions", r"position|max_seq_len|n_ctx"),
    ("window", r"sliding_window|window"),
    ("labels", r"num_labels"),
]


def role_of(key: str) -> str:
    for role, pattern in _ROLES:
        if re.search(pattern, key):
            return role
    return "other"


def _int_kinds() -> list[tuple[str, float]]:
    return [("zero", 1.0), ("small", 2.0), ("large", 1.5), ("huge", 0.5), ("odd", 1.0), ("nondiv", 3.0),
            ("negative", 1.0), ("float", 1.0), ("integral_float", 0.5), ("bool", 0.4), ("string", 0.4),
            ("none", 0.4), ("expr", 0.8)]


def _weighted(rng: random.Random, choices: list[tuple[str, float]]) -> str:
    return rng.choices([c for c, _ in choices], weights=[w for _, w in choices])[0]


def _nondiv(rng: random.Random, key: str, v: int, spec: Any) -> int:
    """A value that breaks a divisibility the value takes part in."""
    dims = dict(spec.model.dims)
    tp, pp = _mesh_int(spec, "tp"), _mesh_int(spec, "pp")
    chunks = _int_or(getattr(spec.pipeline, "chunks", 1), 1)
    hidden, heads = dims.get("hidden") or 32, dims.get("heads") or 4
    seq = _int_or(getattr(spec.train, "seq_len", 16), 16)
    role = role_of(key)
    picks: list[int]
    if role == "heads":
        picks = [h for h in (3, 5, 6, 7, 9, 10, 12, 24, 48, heads + 1) if hidden % h or h % max(tp, 1)]
    elif role == "hidden":
        picks = [x for x in (v + 1, v + 2, v + max(heads // 2, 1), v * 3 // 2, v - 2) if x > 0 and x % heads]
    elif role == "kv_heads":
        picks = [x for x in (3, heads - 1, heads + 1, heads * 2, 5, 6) if x > 0 and (heads % x or x > heads)]
    elif role == "head_dim":
        picks = [7, 5, 6, 3, v + 1, v * 2, max(hidden // heads * 2, 1)]
    elif role in ("ffn", "vocab", "labels"):
        picks = [x for x in (v + 1, v - 1, v // 2 + 1, v * 3 // 2 + 1, 3, 5) if x > 0 and x % max(tp, 2)]
    elif role == "layers":
        stages = max(pp * chunks, 2)
        picks = [x for x in (1, 3, 5, 7, v + 1, v - 1, stages + 1) if x > 0 and x % stages]
    elif role == "positions":
        picks = [x for x in (seq - 1, seq // 2, 1, seq + 1) if x > 0]
    elif role == "window":
        picks = [1, 2, 3, seq - 1, seq, seq + 1]
    elif role == "experts":
        picks = [3, 5, 7, v + 1, 1]
    elif role == "experts_per_tok":
        experts = dims.get("experts") or 4
        picks = [experts + 1, experts, 3, 0]
    else:
        picks = [v + 1, v - 1, v * 3 + 1, 3, 7]
    picks = [x for x in picks if x != v] or [v + 1]
    return rng.choice(picks)


def _mesh_int(spec: Any, name: str) -> int:
    return _int_or(getattr(spec.mesh, name, 1), 1)


def _int_or(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def new_value(rng: random.Random, key: str, value: Any, spec: Any, others: list[str]) -> tuple[str, str]:
    """(kind, the new value as spec text) for the entry `key = value`."""
    if isinstance(value, bool):
        kind = _weighted(rng, [("flip", 3), ("int", 1), ("string", 1), ("none", 0.5)])
        return kind, {"flip": spec_value(not value), "int": rng.choice(["0", "1", "2"]),
                      "string": rng.choice(['"true"', '"false"', '"yes"']), "none": "none"}[kind]
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        v = value if isinstance(value, int) else _default_for(key, spec)
        kind = _weighted(rng, _int_kinds())
        if kind == "zero":
            return kind, "0"
        if kind == "small":
            return kind, str(rng.choice([x for x in (1, 2, 3, 5, 7) if x != v] or [1]))
        if kind == "large":
            return kind, str(rng.choice([64, 100, 256, 1000, 4096, 65536]))
        if kind == "huge":
            return kind, str(rng.choice([2**31 - 1, 2**31, 2**53 + 1, 10**12, 10**30]))
        if kind == "odd":
            return kind, str(rng.choice([v + 1 if v % 2 == 0 else v + 2, 2 * v + 1, max(v - 1, 1) | 1]))
        if kind == "nondiv":
            return kind, str(_nondiv(rng, key, v, spec))
        if kind == "negative":
            return kind, str(rng.choice([-1, -v if v else -2]))
        if kind == "float":
            return kind, rng.choice([repr(v + 0.5), "1e-3", repr(v / 3)])
        if kind == "integral_float":
            return kind, repr(float(v))
        if kind == "bool":
            return kind, rng.choice(["true", "false"])
        if kind == "string":
            return kind, rng.choice([f'"{v}"', '"auto"', '""'])
        if kind == "none":
            return kind, "none"
        # expr: arithmetic over another config key
        other = rng.choice(others) if others else None
        if other is None or other == key:
            return kind, f"{v} / 3"
        return kind, rng.choice([f"{other} / 3", f"{other} * 2 + 1", f"{other} - {other}", f"{other} / 2"])
    if isinstance(value, float):
        kind = _weighted(rng, [("zero", 1), ("negative", 1), ("one", 1), ("large", 1), ("tiny", 0.6), ("int", 0.6),
                               ("string", 0.4), ("none", 0.4), ("bool", 0.3)])
        return kind, {"zero": "0.0", "negative": rng.choice(["-0.1", repr(-abs(value) or -1.0)]), "one": "1.0",
                      "large": rng.choice(["1e30", "1e300", "65536.0"]), "tiny": rng.choice(["1e-30", "1e-300"]),
                      "int": rng.choice(["0", "1", "2"]), "string": '"0.1"', "none": "none",
                      "bool": "true"}[kind]
    if isinstance(value, str):
        kind = _weighted(rng, [("other", 3), ("unknown", 1), ("empty", 0.5), ("int", 0.5), ("none", 0.5)])
        if kind == "other":
            pool = ([x for x in ("relu", "gelu", "gelu_new", "silu", "tanh", "swish", "gelu_pytorch_tanh", "sigmoid")
                     if x != value] if re.search(r"act|activation", key) else
                    ["float64", "bfloat16", "eager", "sdpa", "rope", "absolute", "relative_key", value.upper()])
            return kind, spec_value(rng.choice(pool))
        return kind, {"unknown": '"no_such_value"', "empty": '""', "int": "1", "none": "none"}[kind]
    if isinstance(value, (list, tuple)):
        items = list(value)
        kind = _weighted(rng, [("shorter", 1), ("longer", 1), ("empty", 0.6), ("wrong_item", 1), ("scalar", 0.6)])
        if kind == "shorter":
            return kind, spec_value(items[:-1])
        if kind == "longer":
            return kind, spec_value(items + items[-1:] if items else [1])
        if kind == "empty":
            return kind, "[]"
        if kind == "wrong_item":
            if items:
                items[rng.randrange(len(items))] = rng.choice(["no_such_value", 0, -1])
            return kind, spec_value(items or ["no_such_value"])
        return kind, spec_value(items[0] if items else 0)
    return "int", "1"


def _default_for(key: str, spec: Any) -> int:
    dims = dict(spec.model.dims)
    return {"hidden": dims.get("hidden"), "heads": dims.get("heads"), "layers": dims.get("layers"),
            "ffn": dims.get("ffn"), "vocab": dims.get("vocab"), "kv_heads": dims.get("kv_heads"),
            "positions": dims.get("positions")}.get(role_of(key)) or 8


def _addable(spec: Any, present: set[str]) -> list[tuple[str, Any]]:
    """Keys of the model's config (its class's defaults) the spec does not write: numbers,
    bools, and None where the key names a size."""
    out = []
    for key, value in sorted((getattr(spec.model, "resolved_config", None) or {}).items()):
        if key in present or key.startswith("_") or key in ("architectures", "model_type", "transformers_version"):
            continue
        if isinstance(value, (bool, int, float)) or (value is None and role_of(key) != "other"):
            out.append((key, value))
    return out


def mutate(rng: random.Random, base: Base, serial: int) -> Mutant | None:
    entries, spec, insert_at = config_entries(base.text)
    if spec is None:
        return None
    present = {e.key for e in entries}
    others = [k for k, v in spec.model.config.items() if isinstance(v, int) and not isinstance(v, bool)]
    r = rng.random()
    addable = _addable(spec, present) if insert_at is not None else []
    if entries and (r < 0.78 or not addable):
        e = rng.choice(entries)
        kind, new = new_value(rng, e.key, e.value, spec, others)
        if rng.random() < 0.04:
            kind, new = "remove", ""
        old = base.text[e.start:e.end]
        if kind == "remove":
            start, end = e.start, e.end
            if base.text[end:end + 1] == ",":  # "a = 1, b = 2": drop "a = 1, "
                end += 1
                while base.text[end:end + 1] == " ":
                    end += 1
            text = base.text[:start] + base.text[end:]
            return Mutant(f"m{serial:04d}", base.name, e.key, "remove", "remove", old, "", text, base.world)
        text = base.text[:e.start] + f"{e.key} = {new}" + base.text[e.end:]
        return Mutant(f"m{serial:04d}", base.name, e.key, kind, "replace", old, f"{e.key} = {new}", text, base.world)
    if not addable:
        return None
    key, value = rng.choice(addable)
    kind, new = new_value(rng, key, value, spec, others)
    sep = ", " if entries else " "
    text = base.text[:insert_at] + f"{sep}{key} = {new}" + (" " if not entries else "") + base.text[insert_at:]
    return Mutant(f"m{serial:04d}", base.name, key, kind, "add", f"(default {spec_value(value)})",
                  f"{key} = {new}", text, base.world)


def effective_config(text: str) -> dict[str, str] | None:
    spec = load(text)
    if spec is None:
        return None
    return {k: f"{type(v).__name__}:{v!r}" for k, v in spec.model.config.items()}


# ---- the check worker ---------------------------------------------------------------------------------


def _limit_memory() -> None:
    import resource

    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def _serve(conn: Any, log_path: str) -> None:
    """The worker: run `ppdsl.cli.main(argv)` per request, output captured."""
    _limit_memory()
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.environ.pop("PPDSL_DEBUG", None)
    import warnings

    warnings.simplefilter("ignore")
    from ppdsl import cli
    import ppdsl.dsl.check  # noqa: F401 - the imports a check needs, before the first request is timed
    import ppdsl.lowering.fit  # noqa: F401
    import torch

    torch.set_num_threads(1)
    try:
        import transformers

        transformers.logging.set_verbosity_error()
    except ImportError:
        pass
    conn.send(("ready", os.getpid()))
    while True:
        try:
            request = conn.recv()
        except EOFError:
            return
        if request is None:
            return
        argv, cwd = request
        out, err = io.StringIO(), io.StringIO()
        before = os.lseek(log, 0, os.SEEK_END)
        escaped = ""
        t0 = time.perf_counter()
        old = os.getcwd()
        try:
            os.chdir(cwd)
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                rc = cli.main(argv)
        except SystemExit as exc:
            rc = exc.code if isinstance(exc.code, int) else 2
        except BaseException:  # noqa: BLE001 - what escapes cli.main is the finding
            rc, escaped = -1, traceback.format_exc()
        finally:
            os.chdir(old)
        seconds = time.perf_counter() - t0
        sys.stdout.flush()
        sys.stderr.flush()
        after = os.lseek(log, 0, os.SEEK_END)
        stray = ""
        if after > before:
            with open(log_path, "rb") as fh:
                fh.seek(before)
                stray = fh.read(after - before).decode("utf-8", "replace")
        conn.send((rc, out.getvalue(), err.getvalue() + stray, escaped, seconds))


class Worker:
    """A long-lived process running cli.main; restarted after a timeout or a death."""

    def __init__(self, tmp: Path, env: dict[str, str]) -> None:
        self.tmp, self.env, self.proc, self.conn, self.jobs = tmp, env, None, None, 0

    def start(self) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        saved = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)
        try:
            self.proc = ctx.Process(target=_serve, args=(child, str(self.tmp / f"worker-{time.time_ns()}.log")),
                                    daemon=True)
            self.proc.start()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        child.close()
        self.conn = parent
        if not parent.poll(300):
            raise RuntimeError("the check worker did not start in 300 s")
        parent.recv()
        self.jobs = 0

    def stop(self) -> None:
        if self.proc is not None:
            try:
                self.conn.send(None)
            except (OSError, BrokenPipeError):
                pass
            self.proc.join(5)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(5)
        self.proc = None

    def run(self, argv: list[str], cwd: str, timeout: float) -> dict[str, Any]:
        if self.proc is None or not self.proc.is_alive() or self.jobs >= 120:  # recycle: bounded memory
            self.stop()
            self.start()
        self.jobs += 1
        self.conn.send((argv, cwd))
        t0 = time.perf_counter()
        try:
            ready = self.conn.poll(timeout)
        except (EOFError, OSError):
            ready = True
        if not ready:
            self.proc.kill()
            self.proc.join(5)
            self.proc = None
            return {"rc": None, "stdout": "", "stderr": "", "escaped": "", "seconds": time.perf_counter() - t0,
                    "verdict": "timeout"}
        try:
            rc, out, err, escaped, seconds = self.conn.recv()
        except (EOFError, OSError):
            code = self.proc.exitcode if self.proc is not None else None
            self.proc = None
            return {"rc": code, "stdout": "", "stderr": f"worker died (exit code {code})", "escaped": "",
                    "seconds": time.perf_counter() - t0, "verdict": "crash"}
        return {"rc": rc, "stdout": out, "stderr": err, "escaped": escaped, "seconds": seconds}


def classify_check(res: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    """(verdict, the diagnostics of check's JSON)."""
    if res.get("verdict"):
        return res["verdict"], []
    text = res["stdout"] + "\n" + res["stderr"]
    if res["escaped"] or "Traceback (most recent call last)" in text:
        return "traceback", []
    if "ppdsl: internal error" in text:
        return "internal-error", []
    diags: list[dict[str, Any]] = []
    try:
        doc = json.loads(res["stdout"])
        diags = doc.get("diagnostics", []) if isinstance(doc, dict) else []
    except ValueError:
        pass
    if res["rc"] == 0:
        return "ok", diags
    errors = [d for d in diags if d.get("severity") == "error"]
    if res["rc"] == 2 and errors:
        unplaced = [d for d in errors if not (d.get("span") or {}).get("line") or not (d.get("span") or {}).get("column")]
        return ("refused-unplaced" if unplaced else "refused"), diags
    return "other", diags


def _key_lines(text: str, limit: int = 6) -> list[str]:
    """The lines of an output that say what went wrong: the named causes (not a rank that only
    lost its peer), and of the first traceback that is not such a rank's, its last frames of
    ppdsl's own code and its exception."""
    lines = [x.rstrip() for x in text.splitlines() if x.strip()]
    named = [x for x in lines if re.search(r"internal error|error\[|FAILED|EXCEEDED|rank \d+\)?:|^OK|timed out|"
                                           r"worker died|could not run|worker\(s\) failed", x) and not _PEER.search(x)]
    tb: list[str] = []
    for chunk in text.split("Traceback (most recent call last)")[1:]:
        body = [x.rstrip() for x in chunk.splitlines() if x.strip()]
        exc = [x for x in body if re.match(r"^\w+(Error|Exception|Interrupt)\b", x)]
        if not exc or _PEER.search(exc[0]):
            continue
        frames = [x for x in body if x.lstrip().startswith("File ") and "site-packages" not in x]
        tb = frames[-2:] + exc[:1]
        break
    pick = named[:3] + tb if tb else named
    return (pick or lines[-limit:])[:limit]


# ---- verify ------------------------------------------------------------------------------------------------


def _ppdsl(args: list[str], cwd: str, env: dict[str, str], timeout: float) -> tuple[int | None, str, float]:
    t0 = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, "-m", "ppdsl", *args], cwd=cwd, env=env, capture_output=True, text=True,
                           timeout=timeout, start_new_session=True, preexec_fn=_limit_memory)
        return p.returncode, p.stdout + p.stderr, time.perf_counter() - t0
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"") + (exc.stderr or b"") if isinstance(exc.stdout, bytes) else \
            (exc.stdout or "") + (exc.stderr or "")
        if isinstance(out, bytes):
            out = out.decode("utf-8", "replace")
        _kill_group(exc)
        return None, out + f"\n(timed out after {timeout:.0f} s)", time.perf_counter() - t0


def _kill_group(_exc: Any) -> None:
    """subprocess.run killed the child; its spawned ranks are in the same new session."""
    # nothing more to do portably: the ranks exit when their store's master (the child) is gone


def classify_verify(rc: int | None, out: str) -> str:
    if rc is None:
        return "timeout"
    if "Traceback (most recent call last)" in out or "ppdsl: internal error" in out:
        return "crash"
    if rc == 2:
        return "refused"
    last = [x for x in out.splitlines() if x.startswith(("OK", "FAILED"))]
    verdict = last[-1] if last else ""
    if rc == 0 and verdict.startswith("OK"):
        return "OK (fp64 drift)" if "rounding: fp64 agrees" in verdict else "OK"
    if verdict.startswith("FAILED"):
        return "FAILED (fp64 confirms)" if "fp64 disagrees too" in verdict else "FAILED"
    return "crash"


def run_verify(m: Mutant, env: dict[str, str], timeout: float) -> dict[str, Any]:
    args = ["verify", m.path, "--world", str(m.world), "--steps", "2"]
    rc, out, seconds = _ppdsl(args, str(Path(m.path).parent), env, timeout)
    outcome = classify_verify(rc, out)
    result: dict[str, Any] = {"command": "ppdsl " + " ".join(args), "rc": rc, "outcome": outcome,
                              "seconds": round(seconds, 1), "key_lines": _key_lines(out, 8)}
    if outcome == "FAILED":
        args64 = args + ["--set", "train.precision=fp64"]
        rc64, out64, s64 = _ppdsl(args64, str(Path(m.path).parent), env, timeout)
        o64 = classify_verify(rc64, out64)
        result["fp64"] = {"command": "ppdsl " + " ".join(args64), "rc": rc64, "outcome": o64,
                          "seconds": round(s64, 1), "key_lines": _key_lines(out64, 8)}
        result["outcome"] = ("FAILED (fp32 only)" if o64.startswith("OK") else
                             "FAILED (fp64 confirms)" if o64.startswith("FAILED") else f"FAILED (fp64 run: {o64})")
    return result


# ---- the fuzz ----------------------------------------------------------------------------------------------


def git_commit() -> str:
    try:
        head = subprocess.run(["git", "log", "-1", "--format=%h %s"], cwd=ROOT, capture_output=True, text=True,
                              timeout=30).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=30).stdout.strip()
        return head[:72] + (f" (+ {len(dirty.splitlines())} uncommitted files)" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _folder_for(root: Path, directory: str) -> Path:
    """A folder of the run for specs whose relative paths are looked up in `directory`: its
    data/ linked in."""
    folder = root / hashlib.sha1(directory.encode()).hexdigest()[:8]
    if not folder.exists():
        folder.mkdir(parents=True)
        data = Path(directory) / "data"
        if data.is_dir():
            (folder / "data").symlink_to(data)
    return folder


def _write_mutant(tmp: Path, base: Base, m: Mutant) -> None:
    path = _folder_for(tmp / "specs", base.directory) / f"{m.id}_{re.sub(r'[^A-Za-z0-9]+', '_', base.name)}.ppspec"
    path.write_text(m.text, encoding="utf-8")
    m.path = str(path)


def fuzz(mutants: int = 520, verifies: int = 32, seed: int = 31, only: str | None = None,
         check_timeout: float = 60, verify_timeout: float = 420, log: Any = print,
         tmp: Path | None = None, runs: int = 8) -> dict[str, Any]:
    started = time.time()
    commit = git_commit()
    tmp = Path(tempfile.mkdtemp(prefix="ppdsl-config-fuzz-")) if tmp is None else tmp
    env = {"OMP_NUM_THREADS": "1", "PPDSL_CACHE_DIR": str(tmp / "cache"), "NO_COLOR": "1"}
    full_env = {**os.environ, **env}
    full_env.pop("PPDSL_DEBUG", None)
    full_env.pop("PPDSL_NO_CACHE", None)
    worker = Worker(tmp, env)
    rng = random.Random(seed)
    bases = collect_bases(only)
    log(f"config fuzz: {len(bases)} base specs, commit {commit}, seed {seed}")

    # the bases: checked with the model, worlds swept; the smallest valid world
    for b in bases:
        path = _folder_for(tmp / "bases", b.directory) / f"{re.sub(r'[^A-Za-z0-9]+', '_', b.name)}.ppspec"
        path.write_text(b.text, encoding="utf-8")
        res = worker.run(["check", str(path), "--format", "json"], str(path.parent), check_timeout * 3)
        verdict, diags = classify_check(res)
        sizes = []
        with contextlib.suppress(ValueError, AttributeError):
            sizes = json.loads(res["stdout"]).get("valid_world_sizes") or []
        if verdict != "ok" or not sizes:
            errors = [d.get("code", "?") for d in diags if d.get("severity") == "error"]
            b.status = (f"not mutated: check with the model says {verdict}" +
                        (f" ({', '.join(errors)})" if errors else ": " + "; ".join(_key_lines(
                            res["stdout"] + res["stderr"], 2))[:200]))
        else:
            b.world, b.status = min(sizes), "ok"
            spec = load(b.text)
            b.config = {k: repr(v) for k, v in spec.model.config.items()} if spec is not None else {}
        log(f"  base {b.name:55s} world {b.world or '-':>2}  {b.status[:90]}")
    live = [b for b in bases if b.status == "ok"]
    if not live:
        raise SystemExit("no base spec passes check")

    # the mutants: round-robin over the bases in a seeded order, one config value each
    seen = {hashlib.sha1(b.text.encode()).hexdigest() for b in bases}
    made: list[Mutant] = []
    order = live[:]
    rng.shuffle(order)
    serial, misses = 0, 0
    while len(made) < mutants and misses < 50 * mutants:
        b = order[serial % len(order)]
        serial += 1
        m = mutate(rng, b, len(made))
        if m is None:
            misses += 1
            continue
        digest = hashlib.sha1(m.text.encode()).hexdigest()
        if digest in seen:
            misses += 1
            continue
        seen.add(digest)
        base_config = effective_config(b.text)
        m.differs = effective_config(m.text) != base_config
        made.append(m)

    counts: Counter[str] = Counter()
    t_checks = time.time()
    for i, m in enumerate(made):
        base = next(b for b in bases if b.name == m.base)
        _write_mutant(tmp, base, m)
        argv = ["check", m.path, "--world", str(m.world), "--format", "json"]
        res = worker.run(argv, str(Path(m.path).parent), check_timeout)
        verdict, diags = classify_check(res)
        m.check = {"command": f"ppdsl check {Path(m.path).name} --world {m.world}", "verdict": verdict,
                   "rc": res["rc"], "seconds": round(res["seconds"], 2),
                   "codes": sorted({d.get("code", "?") for d in diags}),
                   "errors": [d.get("code", "?") for d in diags if d.get("severity") == "error"],
                   "key_lines": _key_lines(res["escaped"] + res["stdout"] + "\n" + res["stderr"]) if
                   verdict not in ("ok", "refused") else
                   [f"{d.get('code')} {d.get('message', '')[:160]}" for d in diags if d.get("severity") == "error"][:3]}
        if verdict == "ok":
            pres = worker.run(["plan", m.path, "--world", str(m.world), "--format", "json"], str(Path(m.path).parent),
                              check_timeout)
            pverdict, _ = classify_check(pres)
            if pverdict == "ok":
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    m.plan_params = sum(r["params"] for r in json.loads(pres["stdout"])["ranks"] if r["dp"] == 0)
            else:
                verdict = "plan-failed"
                m.check.update(verdict=verdict, plan_command=f"ppdsl plan {Path(m.path).name} --world {m.world}",
                               key_lines=_key_lines(pres["escaped"] + pres["stdout"] + "\n" + pres["stderr"]))
        counts[verdict] += 1
        if verdict not in ("ok", "refused") or (i + 1) % 25 == 0:
            log(f"  [{i + 1}/{len(made)}] {m.id} {m.base} {m.new or 'remove ' + m.key}: {verdict} "
                f"({m.check['seconds']} s) {'; '.join(m.check['key_lines'][:2])[:160] if verdict not in ('ok', 'refused') else ''}"
                f" | so far {dict(counts)}")
    check_seconds = time.time() - t_checks
    worker.stop()

    # verify a sample of the accepted mutants
    eligible = [m for m in made if m.check.get("verdict") == "ok" and m.differs and m.world <= VERIFY_MAX_WORLD
                and m.plan_params is not None and m.plan_params <= VERIFY_MAX_PARAMS]
    switched_off = [m for m in eligible if _switched_off(m)]
    sample = spread(rng, [m for m in eligible if not _switched_off(m)], verifies, _verify_interest)
    t_verify = time.time()
    vcounts: Counter[str] = Counter()
    for i, m in enumerate(sample):
        m.verify = run_verify(m, full_env, verify_timeout)
        vcounts[m.verify["outcome"]] += 1
        log(f"  verify [{i + 1}/{len(sample)}] {m.id} {m.base} {m.new or 'remove ' + m.key}: {m.verify['outcome']} "
            f"({m.verify['seconds']} s) | so far {dict(vcounts)}")
    # a changed dropout rate: verify switches dropout off in both runs, so these are trained instead
    runs_sample = spread(rng, switched_off, runs, _run_interest)
    rcounts: Counter[str] = Counter()
    for i, m in enumerate(runs_sample):
        m.run = run_train(m, full_env, tmp / "runs" / m.id, verify_timeout)
        rcounts[m.run["outcome"]] += 1
        log(f"  run [{i + 1}/{len(runs_sample)}] {m.id} {m.base} {m.new or 'remove ' + m.key}: {m.run['outcome']} "
            f"({m.run['seconds']} s) | so far {dict(rcounts)}")
    verify_seconds = time.time() - t_verify

    result = {"commit": commit, "seed": seed, "mutants_asked": mutants, "verifies_asked": verifies,
              "runs_asked": runs, "versions": _versions(), "bases": [asdict(b) | {"text": None} for b in bases],
              "mutants": [asdict(m) for m in made], "check_seconds": round(check_seconds),
              "verify_seconds": round(verify_seconds), "seconds": round(time.time() - started),
              "eligible_for_verify": len(eligible) - len(switched_off), "eligible_for_run": len(switched_off),
              "tmp": str(tmp)}
    return result


_DROPOUT = re.compile(r"dropout|pdrop|layerdrop|jitter")
# value kinds at the edge of what a config means: the likeliest to pass check and fail to run
_EDGE = {"zero", "negative", "bool", "expr", "huge", "tiny", "int", "float", "none", "string", "remove", "one",
         "empty", "shorter", "longer", "wrong_item", "scalar", "unknown", "other"}


def _switched_off(m: Mutant) -> bool:
    """A dropout-like rate changed: verify sets every dropout rate above 0 to 0 in both runs."""
    return bool(_DROPOUT.search(m.key))


def _verify_interest(m: Mutant) -> int:
    if re.search(r"token_id|initializer|use_cache|eps$", m.key):
        return 0
    return 3 if m.kind in _EDGE else 2 if role_of(m.key) != "other" else 1


def _run_interest(m: Mutant) -> int:
    spec = load(m.text)
    value = spec.model.config.get(m.key) if spec is not None else None
    out_of_range = isinstance(value, (int, float)) and not 0 <= value <= 1
    return 2 if out_of_range else 1


def spread(rng: random.Random, pool: list[Mutant], n: int, interest: Any) -> list[Mutant]:
    """n of the pool: the most interesting first, and within the same interest one base after
    another (each base's next mutant only when every other base has had its turn)."""
    by_base: dict[str, list[Mutant]] = defaultdict(list)
    for m in pool:
        by_base[m.base].append(m)
    keyed = []
    for group in by_base.values():
        rng.shuffle(group)
        group.sort(key=lambda m: -interest(m))
        keyed += [((-interest(m), turn, rng.random()), m) for turn, m in enumerate(group)]
    keyed.sort(key=lambda km: km[0])
    return [m for _, m in keyed[:n]]


def run_train(m: Mutant, env: dict[str, str], out: Path, timeout: float) -> dict[str, Any]:
    """`ppdsl run` for one step: what a mutant verify cannot show (a dropout rate) does."""
    args = ["run", m.path, "--nproc", str(m.world), "--out", str(out), *RUN_SETS.split()]
    rc, text, seconds = _ppdsl(args, str(Path(m.path).parent), env, timeout)
    outcome = ("timeout" if rc is None else "crash" if rc != 0 or "Traceback (most recent call last)" in text
               or "internal error" in text else "OK")
    return {"command": f"ppdsl run {Path(m.path).name} --nproc {m.world} --out RUN_DIR {RUN_SETS}",
            "rc": rc, "outcome": outcome, "seconds": round(seconds, 1), "key_lines": _key_lines(text, 8)}


def _versions() -> dict[str, str]:
    out = {"python": sys.version.split()[0]}
    for name in ("torch", "transformers"):
        with contextlib.suppress(ImportError):
            out[name] = __import__(name).__version__
    return out


# ---- failures: confirm, group, save ------------------------------------------------------------------------


def failures_of(result: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for m in result["mutants"]:
        v = m["check"].get("verdict")
        if v in FAILING_CHECK:
            out.append({"phase": "check", "outcome": v, **_failure_fields(m)})
        o = (m.get("verify") or {}).get("outcome", "")
        if o in FAILING_VERIFY or o.startswith("FAILED (fp64 run"):
            out.append({"phase": "verify", "outcome": o, **_failure_fields(m)})
        o = (m.get("run") or {}).get("outcome", "")
        if o in FAILING_RUN:
            out.append({"phase": "run", "outcome": o, **_failure_fields(m)})
    return out


def _failure_fields(m: dict[str, Any]) -> dict[str, Any]:
    return {k: m.get(k) for k in ("id", "base", "key", "kind", "action", "old", "new", "world", "path", "check",
                                  "verify", "run", "plan_params")} | {"text": m["text"]}


def confirm(failures: list[dict[str, Any]], env: dict[str, str], check_timeout: float, verify_timeout: float,
            log: Any = print) -> str:
    """Rerun each failure as a fresh command at the working tree now (PPDSL_DEBUG=1 for check:
    the traceback); record whether it still fails and the lines that say why. `check_timeout`:
    what a rerun check may take (longer than the fuzz's: slow, or hung?). A spec check now
    refuses (exit 2) no longer fails."""
    commit = git_commit()
    debug_env = {**env, "PPDSL_DEBUG": "1"}
    tmp = Path(tempfile.mkdtemp(prefix="ppdsl-config-fuzz-confirm-"))
    for f in failures:
        path = Path(f["path"]) if f.get("path") and Path(f["path"]).exists() else tmp / f"{f['id']}.ppspec"
        if not path.exists():
            path.write_text(f["text"], encoding="utf-8")
        if f["phase"] == "check":
            sub = "plan" if f["outcome"] == "plan-failed" else "check"
            args = [sub, str(path), "--world", str(f["world"])]
            rc, out, seconds = _ppdsl(args, str(path.parent), debug_env, check_timeout)
            still = (rc is None or "Traceback (most recent call last)" in out or "internal error" in out
                     or rc not in (0, 2) or (f["outcome"] == "refused-unplaced" and rc == 2))
            if f["outcome"] == "plan-failed":
                still = rc != 0
        elif f["phase"] == "run":
            args = ["run", str(path), "--nproc", str(f["world"]), "--out", str(tmp / f"run-{f['id']}"), *RUN_SETS.split()]
            rc, out, seconds = _ppdsl(args, str(path.parent), env, verify_timeout)
            still = rc not in (0, 2)
            f["confirm_outcome"] = "timeout" if rc is None else "crash" if rc else "OK"
        else:
            args = ["verify", str(path), "--world", str(f["world"]), "--steps", "2"]
            rc, out, seconds = _ppdsl(args, str(path.parent), env, verify_timeout)
            o = classify_verify(rc, out)
            if o == "FAILED" and f["outcome"].startswith("FAILED"):
                rc64, out64, s64 = _ppdsl(args + ["--set", "train.precision=fp64"], str(path.parent), env,
                                          verify_timeout)
                o64 = classify_verify(rc64, out64)
                out += "\n--- fp64 ---\n" + out64
                o = "FAILED (fp64 confirms)" if o64.startswith("FAILED") else "FAILED (fp32 only)"
                seconds += s64
            still = o == f["outcome"] or (o in FAILING_VERIFY and o != "refused")
            f["confirm_outcome"] = o
        shown = [args[0], "SPEC", *args[2:]]
        if f["phase"] == "run":
            shown[shown.index("--out") + 1] = "RUN_DIR"
        f["confirm"] = {"commit": commit, "command": "ppdsl " + " ".join(shown) +
                        (" (PPDSL_DEBUG=1)" if f["phase"] == "check" else ""),
                        "rc": rc, "still_fails": bool(still), "seconds": round(seconds, 1),
                        "key_lines": _key_lines(out, 8), "signature": signature(f, out)}
        log(f"  confirm {f['id']} {f['base']} {f['new'] or 'remove ' + f['key']}: "
            f"{'still fails' if still else 'no longer fails'} | {' / '.join(f['confirm']['key_lines'][:2])[:200]}")
    shutil.rmtree(tmp, ignore_errors=True)
    return commit


_PEER = re.compile(r"Connection closed by peer|lost contact with a peer|Connection reset|stopped by the launcher")


def _norm(text: str) -> str:
    return re.sub(r"\d+(\.\d+)?(e[-+]?\d+)?", "N", text).strip()


def signature(f: dict[str, Any], out: str) -> str:
    """What makes two failures the same: the phase, the outcome, and the cause: of the first
    traceback that is not a rank losing its peer, the exception with the start of its message
    and the deepest frame of ppdsl's own code; else a rank's named cause; else (a timeout) the
    kind of key changed. Numbers are taken out."""
    parts = [f["phase"], f["outcome"].split(" (")[0] if f["phase"] == "check" else f["outcome"]]
    for chunk in out.split("Traceback (most recent call last)")[1:]:
        excs = re.findall(r"^(\w+(?:Error|Exception|Interrupt)|AssertionError)\b:? ?([^\n]*)", chunk, re.M)
        if not excs or _PEER.search(excs[0][1]):
            continue
        frames = [f"{Path(p).parent.name}/{Path(p).name}:{fn}"
                  for p, fn in re.findall(r'File "([^"]+)", line \d+, in (\w+)', chunk)
                  if "site-packages" not in p and "/lib/python" not in p]
        parts += [f"{excs[0][0]}: {_norm(excs[0][1])[:50]}", frames[-1] if frames else ""]
        return " | ".join(p for p in parts if p)
    named = re.findall(r"(?:ppdsl: internal error|ppdsl(?: run)?:? \(?rank \d+\)?): ([^\n]*)", out)
    named = [x for x in named if not _PEER.search(x)]
    if named:
        return " | ".join(parts + [_norm(named[0])[:60]])
    return " | ".join(parts + [f"{role_of(f['key'])} key"])


def save_cases(failures: list[dict[str, Any]], folder: Path, commit_at_run: str, log: Any = print) -> list[str]:
    """One spec file per distinct signature (the first mutant that shows it), and failures.json."""
    folder.mkdir(parents=True, exist_ok=True)
    kept_notes = {}
    for old in folder.glob("*.ppspec"):  # hand-written diagnoses survive a re-save
        head = old.read_text(encoding="utf-8").split("ppspec 1", 1)[0]
        sig = re.search(r"^# signature: (.*)$", head, re.M)
        notes = [x for x in head.splitlines() if x.startswith(("# diagnosis:", "#   ", "# status:"))]
        if sig:
            kept_notes[sig.group(1).strip()] = notes
    for old in folder.glob("*.ppspec"):
        old.unlink()
    saved, by_sig = [], {}
    for f in failures:
        sig = (f.get("confirm") or {}).get("signature") or f"{f['phase']} | {f['outcome']}"
        f["signature"] = sig
        if sig in by_sig:
            f["case"] = by_sig[sig]
            continue
        name = f"{len(by_sig) + 1:02d}_{re.sub(r'[^A-Za-z0-9]+', '_', f['base'].split('/')[-1])}_{f['key']}.ppspec"
        where = (folder / name).resolve()
        by_sig[sig] = f["case"] = str(where.relative_to(ROOT)) if where.is_relative_to(ROOT) else str(where)
        c = f.get("confirm") or {}
        world = f["world"]
        command = (f"ppdsl verify {f['case']} --world {world} --steps 2" if f["phase"] == "verify" else
                   f"ppdsl run {f['case']} --nproc {world} --out RUN_DIR {RUN_SETS}" if f["phase"] == "run" else
                   f"ppdsl {'plan' if f['outcome'] == 'plan-failed' else 'check'} {f['case']} --world {world}")
        header = [f"# config fuzz case (benchmarks/config_fuzz.py): {f['phase']} -> {f['outcome']}",
                  f"# base: {f['base']}; mutant {f['id']}: {f['action']} {f['old']} -> {f['new'] or '(removed)'}"
                  f" ({f['kind']})",
                  f"# command: {command}",
                  f"# found at: {commit_at_run}; rerun at: {c.get('commit', '?')}: "
                  f"{'still fails' if c.get('still_fails') else 'no longer fails' if c else 'not rerun'}",
                  f"# signature: {sig}"]
        header += [f"# output: {x[:150]}" for x in (c.get("key_lines") or f["check"].get("key_lines") or [])[:6]]
        header += kept_notes.get(sig, ["# status: open"])
        text = f["text"]
        if "data/" in text and f["base"].startswith(("specs/", "golden/")):
            rel = os.path.relpath(ROOT / f["base"].split("/")[0].replace("golden", "tests/golden") / "data", folder)
            text = text.replace('"data/', f'"{rel}/')
        (folder / name).write_text("\n".join(header) + "\n" + text, encoding="utf-8")
        saved.append(name)
        log(f"  saved {f['case']}  ({sig})")
    (folder / "failures.json").write_text(json.dumps(
        [{k: v for k, v in f.items() if k != "path"} for f in failures], indent=1) + "\n", encoding="utf-8")
    return saved


# ---- the report ------------------------------------------------------------------------------------------------


def _md(x: Any) -> str:
    return " ".join(str(x).replace("|", "/").split())


def write_report(result: dict[str, Any], failures: list[dict[str, Any]], out: Path, argv: list[str],
                 confirm_commit: str) -> None:
    ms = result["mutants"]
    verdicts = Counter(m["check"]["verdict"] for m in ms)
    lines = ["# Config fuzz with the model", "",
             "Written by `benchmarks/config_fuzz.py` (its docstring says how it works; issue 31, item 5). It",
             "mutates one value of the `model { config { ... } }` block of every shipped spec, every golden",
             "spec that checks ok and every spec text the tests build (tests/test_families.py,",
             "tests/test_own_forward.py), checks each mutant with the model at its base's world size",
             "(`ppdsl check --world N`, in-process in a worker that a timeout restarts), plans the accepted",
             "ones (`ppdsl plan`), and runs `ppdsl verify --world N --steps 2` on a sample of the accepted",
             "mutants whose config differs from the base's (a FAILED one again with",
             "`--set train.precision=fp64`). Failures are saved under",
             "[tests/config_fuzz_cases/](../tests/config_fuzz_cases/) (one spec per distinct cause, and",
             "`failures.json`), to become goldens once fixed.", "",
             "```", f"OMP_NUM_THREADS=1 .venv/bin/python benchmarks/config_fuzz.py {' '.join(argv)}".rstrip(), "```", "",
             "## Figures", "",
             f"- run from commit {result['commit']}; failures rerun at {confirm_commit}",
             f"- seed {result['seed']}; python {result['versions'].get('python')}, torch "
             f"{result['versions'].get('torch')}, transformers {result['versions'].get('transformers')}; "
             f"{result['seconds']} s in all ({result['check_seconds']} s checking, {result['verify_seconds']} s "
             "verifying) on 2 shared CPU cores",
             f"- base specs: {sum(b['status'] == 'ok' for b in result['bases'])} mutated of "
             f"{len(result['bases'])} collected"]
    not_ok = [b for b in result["bases"] if b["status"] != "ok"]
    for b in not_ok:
        lines.append(f"  - not mutated: `{b['name']}`: {_md(b['status'])[:200]}")
    differs = sum(m["differs"] for m in ms)
    secs = sorted(m["check"]["seconds"] for m in ms)
    lines += [f"- mutants: {len(ms)} ({differs} with an effective config other than the base's); check time per "
              f"mutant: median {secs[len(secs) // 2] if secs else 0:.1f} s, max {secs[-1] if secs else 0:.1f} s",
              f"- verdicts of check: " + ", ".join(f"{v} {n}" for v, n in verdicts.most_common()),
              ""]
    tracebacks = verdicts.get("traceback", 0)
    internal = verdicts.get("internal-error", 0)
    vs = [m for m in ms if m.get("verify")]
    vcount = Counter(m["verify"]["outcome"] for m in vs)
    confirmed = vcount.get("FAILED (fp64 confirms)", 0)
    rs = [m for m in ms if m.get("run")]
    rcount = Counter(m["run"]["outcome"] for m in rs)
    lines += [f"**{len(ms)} mutants: {tracebacks} tracebacks, {internal} internal errors, "
              f"{verdicts.get('timeout', 0)} timeouts, {verdicts.get('crash', 0)} worker crashes, "
              f"{verdicts.get('plan-failed', 0)} accepted by check but failed in plan. "
              f"{len(vs)} verifies of accepted mutants: " + ", ".join(f"{o} {n}" for o, n in vcount.most_common())
              + f"; {confirmed} FAILED that fp64 confirms. {len(rs)} one-step runs of accepted mutants with a "
              "changed dropout rate: " + (", ".join(f"{o} {n}" for o, n in rcount.most_common()) or "none") + ".**", ""]
    lines += ["### Verdicts of check per base origin", "", "| origin | bases | mutants | " +
              " | ".join(sorted(verdicts)) + " |", "| --- | --- | --- | " + " | ".join("---" for _ in verdicts) + " |"]
    by_origin: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for m in ms:
        by_origin[m["base"].split("/")[0]].append(m)
    for origin, group in sorted(by_origin.items()):
        c = Counter(m["check"]["verdict"] for m in group)
        nb = len({m["base"] for m in group})
        lines.append(f"| {origin} | {nb} | {len(group)} | " + " | ".join(str(c.get(v, 0)) for v in sorted(verdicts)) + " |")
    lines += ["", "### Verdicts of check per value kind", "", "| kind | mutants | " + " | ".join(sorted(verdicts)) + " |",
              "| --- | --- | " + " | ".join("---" for _ in verdicts) + " |"]
    by_kind: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for m in ms:
        by_kind[m["kind"]].append(m)
    for kind, group in sorted(by_kind.items(), key=lambda kv: -len(kv[1])):
        c = Counter(m["check"]["verdict"] for m in group)
        lines.append(f"| {kind} | {len(group)} | " + " | ".join(str(c.get(v, 0)) for v in sorted(verdicts)) + " |")
    codes = Counter(code for m in ms if m["check"]["verdict"] == "refused" for code in set(m["check"]["errors"]))
    lines += ["", "Error codes of the refused mutants (a mutant may have several): " +
              ", ".join(f"{c} {n}" for c, n in codes.most_common()) + ".", ""]
    notes = Counter(code for m in ms if m["check"]["verdict"] == "ok" for code in m["check"]["codes"])
    if notes:
        lines += ["Warnings and notes of the accepted mutants: " + ", ".join(f"{c} {n}" for c, n in notes.most_common())
                  + ".", ""]
    lines += ["## Verify of accepted mutants", "",
              f"{len(vs)} of {result['eligible_for_verify']} eligible (accepted, config differs from the base's, world "
              f"<= {VERIFY_MAX_WORLD}, <= {VERIFY_MAX_PARAMS:,} parameters), spread over the bases: " +
              ", ".join(f"{o} {n}" for o, n in vcount.most_common()) + ".", "",
              "| mutant | base | change | world | params | outcome | seconds |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for m in vs:
        v = m["verify"]
        secs = v["seconds"] + (v.get("fp64") or {}).get("seconds", 0)
        lines.append(f"| {m['id']} | {m['base']} | `{_md(m['new'] or 'remove ' + m['key'])}` | {m['world']} | "
                     f"{m['plan_params']:,} | {v['outcome']} | {secs:.0f} |")
    lines += ["", "## One-step runs of accepted mutants with a changed dropout rate", "",
              "verify sets every dropout rate above 0 to 0 in both of its runs, so a mutant that changes one",
              f"is trained instead: `ppdsl run MUTANT --nproc N {RUN_SETS}`; {len(rs)} of "
              f"{result.get('eligible_for_run', 0)} (an out-of-range rate first): " +
              (", ".join(f"{o} {n}" for o, n in rcount.most_common()) or "none") + ".", ""]
    if rs:
        lines += ["| mutant | base | change | world | outcome | seconds |", "| --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {m['id']} | {m['base']} | `{_md(m['new'] or 'remove ' + m['key'])}` | {m['world']} | "
                  f"{m['run']['outcome']} | {m['run']['seconds']:.0f} |" for m in rs]
    lines += ["", "## Failures", ""]
    if not failures:
        lines += ["None.", ""]
    cases: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for f in failures:
        cases[f.get("case", "?")].append(f)
    for case, group in cases.items():
        f = group[0]
        c = f.get("confirm") or {}
        lines += [f"### `{case}`", "",
                  f"- {f['phase']} -> **{f['outcome']}**; {len(group)} mutant(s): " +
                  ", ".join(f"{g['id']} ({g['base']}: `{_md(g['new'] or 'remove ' + g['key'])}`)" for g in group[:8])
                  + (" ..." if len(group) > 8 else ""),
                  f"- this one: base `{f['base']}`, {f['action']} `{_md(f['old'])}` -> `{_md(f['new'] or '(removed)')}`",
                  f"- rerun at {c.get('commit', '?')}: "
                  f"{'**still fails**' if c.get('still_fails') else 'no longer fails' if c else 'not rerun'}"
                  f" (`{c.get('command', '')}`)",
                  f"- signature: `{_md(f.get('signature', ''))}`", "", "```"]
        lines += [x[:200] for x in (c.get("key_lines") or f["check"].get("key_lines") or [])[:8]]
        lines += ["```", ""]
        path = ROOT / case
        if path.is_file():
            notes = [x[2:] for x in path.read_text(encoding="utf-8").split("ppspec 1", 1)[0].splitlines()
                     if x.startswith(("# diagnosis:", "#   ", "# status:"))]
            if notes:
                lines += [" ".join(notes), ""]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mutants", type=int, default=520)
    ap.add_argument("--verify", type=int, default=32, help="accepted mutants to verify")
    ap.add_argument("--runs", type=int, default=8, help="accepted mutants with a changed dropout rate to train a step")
    ap.add_argument("--seed", type=int, default=31)
    ap.add_argument("--only", default=None, help="a regex the base names must match (specs/, golden/, families/, own/, own_tp/)")
    ap.add_argument("--out", default=None, help="the markdown report (docs/config_fuzz.md)")
    ap.add_argument("--cases", default=str(CASES_DIR), help="where the failing mutants and failures.json go ('' : nowhere)")
    ap.add_argument("--result", default=None, help="also write every mutant and verdict here (JSON)")
    ap.add_argument("--check-timeout", type=float, default=60)
    ap.add_argument("--verify-timeout", type=float, default=420)
    ap.add_argument("--confirm-timeout", type=float, default=300,
                    help="seconds a failing check may take when it is rerun at the end (a timeout: slow or hung?)")
    ap.add_argument("--from-result", default=None, metavar="RESULT_JSON",
                    help="no new fuzz: confirm, save and report the mutants of an earlier run's --result")
    ap.add_argument("--report-only", action="store_true",
                    help="with --from-result: write the report again from it and the cases' failures.json (no rerun)")
    ap.add_argument("--confirm", default=None, metavar="FAILURES_JSON",
                    help="only rerun the failures of an earlier run (their specs are in the JSON) and print the outcome")
    args = ap.parse_args(argv)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NO_COLOR": "1"}
    env.pop("PPDSL_DEBUG", None)
    if args.confirm:
        failures = json.loads(Path(args.confirm).read_text(encoding="utf-8"))
        for f in failures:
            f.pop("path", None)
        confirm(failures, env, args.confirm_timeout, args.verify_timeout)
        still = sum(f["confirm"]["still_fails"] for f in failures)
        print(f"{still} of {len(failures)} failures still fail")
        return 1 if still else 0

    def log(msg: str) -> None:
        print(msg, flush=True)

    if args.from_result:
        result = json.loads(Path(args.from_result).read_text(encoding="utf-8"))
        argv = result.get("argv") or ["--mutants", str(result["mutants_asked"]), "--verify",
                                      str(result["verifies_asked"]), "--seed", str(result["seed"]), "--out", args.out or ""]
    else:
        result = fuzz(args.mutants, args.verify, args.seed, args.only, args.check_timeout, args.verify_timeout, log,
                      runs=args.runs)
        result["argv"] = argv
    if args.result:
        Path(args.result).write_text(json.dumps(result, indent=1), encoding="utf-8")
    failures = failures_of(result)
    if args.report_only:
        saved = {(f["id"], f["phase"]): f for f in json.loads((Path(args.cases) / "failures.json").read_text(
            encoding="utf-8"))} if (Path(args.cases) / "failures.json").exists() else {}
        failures = [saved.get((f["id"], f["phase"]), f) for f in failures]
        commits = {(f.get("confirm") or {}).get("commit") for f in failures} - {None}
        write_report(result, failures, Path(args.out), argv, " / ".join(sorted(commits)) or git_commit())
        log(f"wrote {args.out}")
        return 0
    log(f"{len(failures)} failures; rerunning each as a fresh command")
    env["PPDSL_CACHE_DIR"] = str(Path(result["tmp"]) / "cache-confirm")
    confirm_commit = confirm(failures, env, args.confirm_timeout, args.verify_timeout, log) if failures else git_commit()
    if args.cases and failures:
        save_cases(failures, Path(args.cases), result["commit"], log)
    if args.out:
        write_report(result, failures, Path(args.out), argv, confirm_commit)
        log(f"wrote {args.out}")
    verdicts = Counter(m["check"]["verdict"] for m in result["mutants"])
    vcount = Counter(m["verify"]["outcome"] for m in result["mutants"] if m.get("verify"))
    rcount = Counter(m["run"]["outcome"] for m in result["mutants"] if m.get("run"))
    log(f"{len(result['mutants'])} mutants: " + ", ".join(f"{v} {n}" for v, n in verdicts.most_common()))
    log(f"{sum(vcount.values())} verifies: " + ", ".join(f"{v} {n}" for v, n in vcount.most_common()))
    log(f"{sum(rcount.values())} runs: " + ", ".join(f"{v} {n}" for v, n in rcount.most_common()))
    shutil.rmtree(result["tmp"], ignore_errors=True)
    bad = verdicts.get("traceback", 0) + verdicts.get("internal-error", 0) + vcount.get("FAILED (fp64 confirms)", 0)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
