"""Robustness: no input makes the checker raise. Bad input is a diagnostic (exit 2), never a
traceback (exit 1).

At least 10,000 inputs go through the public entry points, in-process and with `--no-model`
semantics (nothing is imported from a spec):

- MUTANTS seeded mutations of the shipped specs and the golden specs (byte flips, insertions,
  deletions, duplications, token swaps and replacements, huge or odd numbers, deep nesting, other
  encodings, very long lines) go through `load_text` (parse + --set + resolve: where the parser
  and the resolver meet arbitrary input). Every FULL_EVERY-th of them also goes through
  `check_text` (every rule, the world-size sweep up to MAX_WORLD, the schedule simulation) and
  through the renderers: a full check of a spec that resolves costs a sweep of 4096 world sizes, so
  the full path runs on a few thousand inputs and the cheap front end on all of them.
- hypothesis-generated raw bytes, text, and spec-shaped documents assembled from the language's
  own blocks, keys and values, through `check_text`.
- a few hundred files through `ppdsl.cli.main(["check", ..., "--no-model"])` in-process, and a
  couple through the real `ppdsl` command in a subprocess (no "Traceback", exit code 2).

Counts actually run (asserted by the last test when the whole file runs): 7,000 mutants (2,334 of
them also fully checked and rendered), 2,200 hypothesis examples (600 random byte strings, 600 random
texts, 400 spec-shaped documents, 600 shipped specs with a token replaced), 800 in-process CLI runs,
and about 50 fixed edge cases: about 10,050 inputs, a little over 5,000 of them through the full
`check_text`. About 40 s on two busy cores; nothing is imported from a spec (`--no-model`).
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ppdsl import cli
from ppdsl.dsl import catalogue, schema
from ppdsl.dsl.check import check_text, load_text
from ppdsl.dsl.diagnostics import Diagnostic, Severity
from ppdsl.dsl.render import render_text, to_json

ROOT = Path(__file__).resolve().parent.parent
SEEDS = sorted((ROOT / "specs").glob("*.ppspec")) + sorted((ROOT / "tests" / "golden").glob("*.ppspec"))
CORPUS = [p.read_text(encoding="utf-8") for p in SEEDS]
SHIPPED = [p.read_text(encoding="utf-8") for p in sorted((ROOT / "specs").glob("*.ppspec"))]

MUTANTS = 7000
FULL_EVERY = 3
CLI_RUNS = 800
SLOW = 5.0  # seconds: one input taking longer than this is a hang in the making

COUNTS: dict[str, int] = {}


def _count(what: str, n: int = 1) -> None:
    COUNTS[what] = COUNTS.get(what, 0) + n


# ---- invariants --------------------------------------------------------------------------------


def _well_formed(diags: tuple[Diagnostic, ...] | list[Diagnostic], text: str, file: str) -> None:
    for d in diags:
        assert catalogue.admits(d.code, d.severity), d  # declared in dsl/catalogue.py, with this severity
        assert d.message
        if d.span is not None:
            assert d.span.line >= 1 and d.span.column >= 1, d
    render_text(diags, {file: text})
    json.dumps([to_json(d) for d in diags])


def _load(data: bytes | str, overrides: tuple[str, ...] = ()) -> None:
    t0 = time.perf_counter()
    spec, diags, text = load_text(data, "fuzz.ppspec", overrides)
    assert time.perf_counter() - t0 < SLOW, f"load_text took {time.perf_counter() - t0:.1f} s on {data[:200]!r}"
    if spec is None:
        assert any(d.severity is Severity.ERROR for d in diags), "no spec but no error either"
    for d in diags:
        assert catalogue.admits(d.code, d.severity), d
    _count("load_text")


def _check(data: bytes | str, world: int | None = None, overrides: tuple[str, ...] = ()) -> None:
    t0 = time.perf_counter()
    result = check_text(data, "fuzz.ppspec", world=world, overrides=overrides)  # type: ignore[arg-type]
    assert time.perf_counter() - t0 < SLOW, f"check_text took {time.perf_counter() - t0:.1f} s on {data[:200]!r}"
    if result.spec is None or not result.ok:
        assert any(d.is_error for d in result.diagnostics) or result.spec is not None
    _well_formed(result.diagnostics, result.text, "fuzz.ppspec")
    _count("check_text")


# ---- a seeded mutator ------------------------------------------------------------------------------

_TOKEN = re.compile(r"""[A-Za-z_][A-Za-z0-9_]*|[0-9][0-9_.eExX+-]*|"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*'|\*\*|//|[=!<>]=|#[^\n]*|\s+|.""")
_ODD = [
    "0", "-1", "1e999", "0x_", "1_000", "99999999999999999999999999999", "1" * 40, "3.", ".5", "1e-400",
    "2 ** 64 ** 64", "(-1) ** 0.5", "0 ** -1", "world / 0", "world % 0", "10 ** 64 ** 2", "1e308 * 1e308",
    "1f1b", "12abc", "\"\\\"", "'", "\"\\u00e9\"", "[0:]", "[:3]", "[*]", "not 1", "true + 1", "none",
    "world", "dp", "tp * pp * dp", "require", "ppspec", "{", "}", "(", ")", "[", "]", ",", ";", "\n", ":",
    "hf(\"GPT2LMHeadModel\")", "python(\"os:system\")", "hf_pretrained(\"/nonexistent\")", "adamw(lr = 1)",
    "column(fused = 0)", "vocab(pad_to = 0)", "[0:2, 2:4]", "[4:0]", "ÿ", "\u202e", "\ufeff", "\x00", "\r", "\t",
]
_NAMES = sorted({*schema.BLOCKS, *(k for b in schema.BLOCKS.values() for k in b), *schema.STYLES, *schema.TP_STYLES,
                 "world", "config", "n_layer", "n_embd", "transformer", "h", "lm_head", "auto"})


def _tokens(text: str) -> list[str]:
    return _TOKEN.findall(text)


def mutate(rng: random.Random, text: str) -> bytes | str:
    """One to three random edits of a spec; sometimes returns bytes in another encoding."""
    for _ in range(rng.randint(1, 3)):
        op = rng.randrange(13)
        if op <= 2:  # token-level: swap, delete, replace, insert
            toks = _tokens(text)
            if len(toks) < 2:
                continue
            i, j = rng.randrange(len(toks)), rng.randrange(len(toks))
            kind = rng.randrange(4)
            if kind == 0:
                toks[i], toks[j] = toks[j], toks[i]
            elif kind == 1:
                del toks[i]
            elif kind == 2:
                toks[i] = rng.choice(_ODD + _NAMES + [toks[j]])
            else:
                toks.insert(i, rng.choice(_ODD + _NAMES))
            text = "".join(toks)
        elif op == 3:  # replace a number
            nums = list(re.finditer(r"\b[0-9]+\b", text))
            if nums:
                m = rng.choice(nums)
                text = text[: m.start()] + rng.choice(_ODD[:20]) + text[m.end():]
        elif op == 4:  # character flip
            if text:
                i = rng.randrange(len(text))
                text = text[:i] + chr(rng.choice([rng.randrange(32, 127), rng.randrange(0, 0x3000)])) + text[i + 1:]
        elif op == 5:  # delete a range
            if text:
                i = rng.randrange(len(text))
                text = text[:i] + text[i + rng.randint(1, 40):]
        elif op == 6:  # duplicate a range (duplicate keys and blocks)
            if text:
                i = rng.randrange(len(text))
                j = min(len(text), i + rng.randint(1, 200))
                text = text[:j] + text[i:j] + text[j:]
        elif op == 7:  # deep nesting
            depth = rng.choice([10, 63, 64, 65, 200, 5000])
            opener = rng.choice(["(", "[", "{"])
            closer = {"(": ")", "[": "]", "{": "}"}[opener]
            inner = opener * depth + "1" + closer * depth * rng.randint(0, 1)
            text = text.replace("= ", "= " + inner + " ", 1) if rng.random() < 0.7 else inner + text
        elif op == 8:  # a very long line
            text += "\n# " + "x" * rng.choice([1000, 100_000]) + "\n" + "mesh { tp = " + "1 + " * rng.choice([99, 101, 150]) + "1 }"
        elif op == 9:  # drop a line
            lines = text.splitlines(True)
            if lines:
                del lines[rng.randrange(len(lines))]
                text = "".join(lines)
        elif op == 10:  # move a line
            lines = text.splitlines(True)
            if len(lines) > 1:
                line = lines.pop(rng.randrange(len(lines)))
                lines.insert(rng.randrange(len(lines)), line)
                text = "".join(lines)
        elif op == 11:  # line endings and invisible characters
            text = text.replace("\n", rng.choice(["\r\n", "\r", "\n\n", ";", ",", " \\\n"]))
        else:  # splice two specs
            other = rng.choice(CORPUS)
            i, j = rng.randrange(len(text) + 1), rng.randrange(len(other) + 1)
            text = text[:i] + other[j:]
    r = rng.random()
    if r < 0.05:
        return text.encode(rng.choice(["utf-16", "utf-16-le", "utf-32", "latin-1", "cp1252"]), errors="replace")
    if r < 0.10:
        data = bytearray(text.encode("utf-8", errors="surrogatepass"))
        for _ in range(rng.randint(1, 4)):
            if data:
                data[rng.randrange(len(data))] = rng.randrange(256)
        return bytes(data)
    return text


def test_mutated_specs_never_raise() -> None:
    rng = random.Random(20240607)
    t0 = time.perf_counter()
    for i in range(MUTANTS):
        data = mutate(rng, rng.choice(CORPUS))
        _load(data)
        if i % FULL_EVERY == 0:
            _check(data)
    _count("mutants", MUTANTS)
    print(f"{MUTANTS} mutants in {time.perf_counter() - t0:.1f} s")


def test_edge_inputs_never_raise() -> None:
    deep = "ppspec 1\nmesh { tp = " + "(" * 10_000 + "1" + ")" * 10_000 + " }\n"
    cases: list[bytes | str] = [
        b"", "", "\n", " ", "ppspec", "ppspec 1", "ppspec 1\n", "\ufeffppspec 1\n", b"\xef\xbb\xbf",
        b"\x00" * 10, bytes(range(256)), b"\xff\xfe" + "ppspec 1\n".encode("utf-16-le"),
        "ppspec 1\n".encode("utf-32"), "ppspec 1\n# é\n".encode("latin-1"), b"\x80abc", b"\xc3",
        "ppspec 99999999999999999999999999999999999\n", "ppspec 1\n" + "x" * 1_000_000,
        deep, "ppspec 1\n" + "a {" * 70, "ppspec 1\n" + "[" * 70, "{" * 10_000, "\"" * 1001, "#" * 100_000,
        "ppspec 1\nmesh { tp = " + "9" * 31 + " }\n", "ppspec 1\nmesh { tp = 1e400 }",
        "ppspec 1\nmesh { tp = 0x" + "f" * 40 + " }", "ppspec 1\nrequire 2 ** 64 ** 64 > 0\n",
        "ppspec 1\nrequire (0 - world) ** 0.5 > 1\n", "ppspec 1\nrequire world ** world > 0\n",
        "ppspec 1\nrequire 10 ** (world * 64) > 0\n",
        "ppspec 1\nmesh { tp = 0 }\n", "ppspec 1\nmesh { tp = -2, pp = 1 / 2 }\n",
        "ppspec 1\nmesh { dp = world / (tp - 1) }\n", "ppspec 1\npipeline { microbatches = 0 }\n",
        "ppspec 1\npipeline { microbatch_size = 0 }\n", "ppspec 1\ntrain { global_batch = 1e308 * 1e308 }\n",
        "ppspec 1\ntrain { optimizer = adamw(lr = " + " * ".join(["999999999999999999999999999999"] * 12) + ") }\n",
        "ppspec 1\nmodel m { config { a = b, b = a } }\n", "ppspec 1\nmodel m { config { a = a } }\n",
        "ppspec 1\nmesh { tp = tp }\n", "\u0000ppspec 1", "ppspec 1\r\nmesh {\r\n tp = 2\r\n}\r\n", "ppspec 1\rmesh {}",
        "ppspec 1\nmodel m { source = python(\"a:b\") }\npipeline { microbatches = 10 ** 12 }\n"
        "train { global_batch = 10 ** 12, seq_len = 1 }\n",  # valid, but far too big to simulate
        "ppspec 1\ntensor_parallel { x[:3] : row, y[3:] : column, z[:] : vocab, h.3.a : replicate }\n",
    ]
    spec = SHIPPED[0]
    cases += [spec.replace("\n", "\r\n"), spec.encode("utf-16"), spec * 50, spec.replace("{", "(")]
    for data in cases:
        _load(data)
        _check(data)
        _check(data, world=8)
    for world in (1, 2, 3, 4096, 4097, 10**9):
        for text in SHIPPED:
            _check(text, world=world)
    _count("edge", len(cases))


BAD_SETS = ["mesh.tp=", "mesh.tp", "=4", "mesh..tp=4", ".tp=4", "mesh.tp=4=4", "mesh.tp=(", "mesh.tp=}", "mesh.tp={",
            "mesh.tp=4 }", "mesh.tp=4, pp=2", "mesh.tp=4\nmesh.pp=2", "model.config.n_layer=1e999", "pipeline.split=[0:",
            "a.b.c.d.e.f=1", "1.2=3", "mesh.tp=\x00", "mesh.tp=" + "(" * 100 + "1" + ")" * 100, "ÿ.x=1", "mesh.tp=4 # c",
            "pipeline.style=1f1b", "pipeline.chunks=0", "train.global_batch=world", "mesh.dp=world/3"]


@pytest.mark.parametrize("override", BAD_SETS)
def test_odd_overrides_never_raise(override: str) -> None:
    for text in SHIPPED[:2]:
        _load(text, (override,))
        _check(text, overrides=(override,))


# ---- hypothesis ------------------------------------------------------------------------------------

def _fast(n: int) -> settings:
    return settings(max_examples=n, deadline=None, suppress_health_check=list(HealthCheck), database=None,
                    derandomize=True)


@_fast(600)
@given(st.binary(max_size=400))
def test_random_bytes(data: bytes) -> None:
    _check(data)
    _count("hypothesis")


@_fast(600)
@given(st.text(max_size=300))
def test_random_text(text: str) -> None:
    _check(text)
    _check("ppspec 1\n" + text)
    _count("hypothesis")


_values = st.one_of(
    st.integers(-3, 10**6).map(str), st.sampled_from(_ODD), st.sampled_from(_NAMES),
    st.floats(allow_nan=False, allow_infinity=False).map(repr),
    st.lists(st.integers(0, 12), max_size=6).map(lambda xs: "[" + ", ".join(f"{a}:{b}" for a, b in zip(xs, xs[1:])) + "]"),
)


_segments = st.one_of(
    st.sampled_from(["layers", "attention", "wq", "transformer", "h", "lm_head", "x"]),
    st.integers(0, 20).map(str),
    st.tuples(st.sampled_from(["layers", "h"]),
              st.sampled_from(["[*]", "[{a}]", "[{a}:{b}]", "[:{b}]", "[{a}:]", "[:]", "[ {a} : ]", "[ : {b} ]"]),
              st.integers(0, 12), st.integers(0, 12)).map(lambda t: t[0] + t[1].format(a=t[2], b=t[3])),
)
_patterns = st.lists(_segments, min_size=1, max_size=5).map(".".join)


@st.composite
def _documents(draw: st.DrawFn) -> str:
    lines = ["ppspec 1"] if draw(st.integers(0, 4)) else []  # mostly with the version line
    for block in draw(st.lists(st.sampled_from([*schema.BLOCKS, "bogus"]), max_size=6)):
        keys = list(schema.BLOCKS.get(block, {"x": None}))
        lines.append(f"{block} {{")
        for key in draw(st.lists(st.sampled_from(keys + ["zz"]), max_size=6)):
            lines.append(f"  {key} = {draw(_values)}")
        if block == "tensor_parallel":
            for _ in range(draw(st.integers(0, 3))):
                lines.append(f"  {draw(_patterns)} : "
                             f"{draw(st.sampled_from([*schema.TP_STYLES, 'column(fused = 3)', 'vocab(pad_to = 64)', 'bad']))}")
        lines.append("}")
    if draw(st.booleans()):
        lines.append(f"require {draw(_values)} {draw(st.sampled_from(['==', '<=', '>', '%']))} {draw(_values)}")
    return "\n".join(lines) + "\n"


@_fast(400)
@given(_documents(), st.sampled_from([None, 1, 4, 8]))
def test_spec_shaped_documents(text: str, world: int | None) -> None:
    _check(text, world=world)
    _count("hypothesis")


@_fast(600)
@given(st.sampled_from(SHIPPED), st.integers(0, 10**9), st.sampled_from(_ODD + _NAMES))
def test_shipped_spec_with_one_token_replaced(text: str, where: int, token: str) -> None:
    toks = _tokens(text)
    toks[where % len(toks)] = token
    _check("".join(toks))
    _count("hypothesis")


# ---- the CLI in-process and in a subprocess -----------------------------------------------------


def test_cli_main_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rng = random.Random(7)
    for i in range(CLI_RUNS):
        path = tmp_path / f"m{i % 10}.ppspec"
        data = mutate(rng, rng.choice(CORPUS))
        path.write_bytes(data if isinstance(data, bytes) else data.encode("utf-8", errors="surrogatepass"))
        argv = ["check", str(path), "--no-model"]
        if i % 4 == 1:
            argv += ["--format", "json"]
        if i % 5 == 2:
            argv += ["--world", str(rng.choice([1, 2, 4, 8, 6]))]
        code = cli.main(argv)
        out, err = capsys.readouterr()
        assert code in (0, 2), f"exit {code} for {data[:300]!r}:\n{err}"
        assert "Traceback" not in err and "internal error" not in err, err
        if "--format" in argv:
            json.loads(out)
    _count("cli", CLI_RUNS)


@pytest.mark.parametrize("content", [b"ppspec 1\nmesh { tp = (((( }\n", b"\xff\xfe\x00garbage\x00",
                                     "ppspec 1\nmesh { tp = 0 }\n".encode()])
def test_cli_subprocess_no_traceback(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "broken.ppspec"
    path.write_bytes(content)
    proc = subprocess.run([sys.executable, "-m", "ppdsl", "check", str(path), "--no-model"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "internal error" not in proc.stderr
    assert "error[" in proc.stderr


def test_at_least_ten_thousand_inputs() -> None:
    """Runs last in this file (pytest keeps definition order): the counts of the tests above."""
    if not {"mutants", "cli"} <= COUNTS.keys():
        pytest.skip("run the whole file to count")
    total = COUNTS.get("mutants", 0) + COUNTS.get("hypothesis", 0) + COUNTS.get("cli", 0) + COUNTS.get("edge", 0)
    print(f"fuzz inputs: {COUNTS}")
    assert total >= 10_000, COUNTS
