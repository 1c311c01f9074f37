"""`check` as a whole: every error of a file, the shipped specs, causes without their cascades, and
the layering rule (the checker imports no torch)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from ppdsl.dsl import check as check_mod
from ppdsl.dsl.check import check_file, check_text

ROOT = Path(__file__).resolve().parent.parent
SPECS = sorted((ROOT / "specs").glob("*.ppspec"))
HAVE_TORCH = importlib.util.find_spec("torch") is not None and importlib.util.find_spec("transformers") is not None

BASE = """ppspec 1
model tiny {
  source = python("ppdsl.models.decoder:build_decoder")
  config { vocab_size = 128, dim = 64, n_layers = 8, n_heads = 4, max_seq_len = 64 }
}
mesh {
  tp = 2
  pp = 2
}
tensor_parallel {
  tok_embeddings : vocab
  layers[*].attention.wq : column
  layers[*].attention.wo : row
}
pipeline {
  style = 1f1b
  microbatches = 4
}
train {
  global_batch = 16
  seq_len = 32
}
"""


def edit(old: str, new: str, text: str = BASE) -> str:
    assert old in text, old
    return text.replace(old, new, 1)


def errors(result) -> list[tuple[str, int | None]]:
    return [(d.code, d.span.line if d.span else None) for d in result.diagnostics if d.is_error]


def test_base_is_valid() -> None:
    r = check_text(BASE)
    assert r.ok and r.diagnostics == ()
    assert r.valid_worlds == (4, 8, 16)


def test_three_independent_rule_errors_give_three_errors() -> None:
    text = edit("vocab_size = 128", "vocab_size = 127")  # E0203 at the vocab rule
    text = edit("  microbatches = 4\n", "  chunks = 2\n  microbatches = 4\n", text)  # E0303
    text = edit("  seq_len = 32\n", "  seq_len = 32\n  zero = 2\n", text)  # E0315
    r = check_text(text)
    assert errors(r) == [("E0203", 11), ("E0303", 17), ("E0315", 23)]


def test_three_independent_front_end_errors_give_three_errors() -> None:
    text = edit("  tp = 2\n", "  tp = 2\n  tq = 1\n")
    text = edit("style = 1f1b", "style = 1f1c", text)
    text = edit("  seq_len = 32\n", "  seq_len = 32\n  optimizer = adamw(lrr = 1)\n", text)
    r = check_text(text)
    assert sorted(errors(r)) == [("E0101", 8), ("E0107", 17), ("E0107", 23)]


def test_errors_across_rules_and_worlds() -> None:
    text = edit("  tp = 2\n", "  tp = 4\n")  # vocab 128 and heads 4 fine, but dim 64 / 4 fine too ...
    text = edit("n_heads = 4", "n_heads = 2", text)  # E0204: heads 2 % 4
    text = edit("  seq_len = 32\n", "  seq_len = 128\n", text)  # E0216: 128 > 64 positions
    r = check_text(text, world=8)
    assert errors(r) == [("E0204", 12), ("E0216", 21)]


@pytest.mark.parametrize("spec", SPECS, ids=[p.stem for p in SPECS])
def test_shipped_spec_passes_without_the_model(spec: Path) -> None:
    r = check_file(spec, model=False)
    assert r.ok, r.diagnostics
    assert r.diagnostics == ()
    assert r.valid_worlds and r.worlds
    for w in r.valid_worlds[:3]:
        assert check_file(spec, world=w, model=False).ok


@pytest.mark.skipif(not HAVE_TORCH, reason="model-level checks need torch and transformers")
@pytest.mark.parametrize("spec", SPECS, ids=[p.stem for p in SPECS])
def test_shipped_spec_passes_with_the_model(spec: Path) -> None:
    r = check_file(spec)
    assert r.ok, r.diagnostics
    assert r.diagnostics == ()
    assert r.model_info is not None


def test_shipped_specs_through_the_cli(capsys: pytest.CaptureFixture[str]) -> None:
    from ppdsl import cli

    assert cli.main(["check", *map(str, SPECS), "--no-model"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert len(out.splitlines()) == len(SPECS) and all(": ok for " in line for line in out.splitlines())


# ---- causes, not cascades ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "old, new, only",
    [
        ("  tp = 2\n", "  tp = 0\n", "E0202"),  # not also E0201 (world split) or a crash on world / 0
        ("  tp = 2\n", "  tp = -2\n", "E0202"),
        ("  pp = 2\n", "  pp = 3 / 2\n", "E0202"),  # not also E0110 for the same `/`
        ("  microbatches = 4\n", "  microbatches = 0\n", "E0302"),
        ("  microbatches = 4\n", "  chunks = 0\n  microbatches = 4\n", "E0202"),  # not also E0303
        ("  microbatches = 4\n", "  microbatches = global_batch / 3\n", "E0110"),  # not also E0302
    ],
)
def test_one_cause_one_error(old: str, new: str, only: str) -> None:
    r = check_text(edit(old, new))
    assert {d.code for d in r.diagnostics if d.is_error} == {only}, r.diagnostics


def test_explicit_split_is_checked_without_the_model() -> None:
    r = check_text(edit("  microbatches = 4\n", "  microbatches = 4\n  split = [0:3, 2:8]\n"))
    assert errors(r) == [("E0309", 18)]
    r = check_text(edit("  microbatches = 4\n", "  microbatches = 4\n  split = [0:4, 4:6]\n"))
    assert [d.message for d in r.diagnostics] == ["the ranges end at block 6 but the model has 8 blocks"]
    assert check_text(edit("  microbatches = 4\n", "  microbatches = 4\n  split = [0:3, 3:8]\n")).ok


def test_without_torch_the_model_checks_are_skipped_with_a_note(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a))
    r = check_text(BASE, model=True)
    assert r.ok
    (d,) = r.diagnostics
    assert (d.code, d.severity.value) == ("N0400", "note")


def test_e0601_notes_follow_their_error() -> None:
    r = check_text(BASE + 'require world % 3 == 0 "three"\n')
    sev = [(d.severity.value, d.code) for d in r.diagnostics]
    assert sev[0] == ("error", "E0601")
    assert all(s == "note" for s, _ in sev[1:]) and len(sev) == 4


def test_diagnostics_are_sorted_and_unique() -> None:
    text = edit("style = 1f1b", "style = gpipe")
    text = edit("  tp = 2\n", "  tp = 3\n", text)
    r = check_text(text, world=6)
    keys = [(d.span.line, d.span.column, d.code) for d in r.diagnostics]
    assert keys == sorted(keys) and len(set(keys)) == len(keys)
    assert {"E0203", "E0207"} <= {d.code for d in r.diagnostics}


def test_bad_world_and_bad_file() -> None:
    r = check_text(BASE, world=0)
    assert [d.code for d in r.diagnostics] == ["E0005"]
    r = check_file(ROOT / "no" / "such.ppspec")
    assert [d.code for d in r.diagnostics] == ["E0000"] and not r.ok


def test_arithmetic_beyond_the_float_range_is_refused_where_it_is_made() -> None:
    r = check_text(BASE + "require 1e308 * 10 > world\n")
    [d] = r.diagnostics
    assert (d.code, d.span.line, d.span.column, d.message) == ("E0103", 23, 9, "number out of range")


def test_bytes_are_decoded() -> None:
    assert check_text(BASE.encode("utf-8")).ok  # type: ignore[arg-type]
    assert check_text(b"\xef\xbb\xbf" + BASE.encode()).ok  # type: ignore[arg-type]
    r = check_text(BASE.encode("utf-16"))  # type: ignore[arg-type]
    assert [d.code for d in r.diagnostics] == ["E0001"]


def test_a_huge_schedule_is_checked_but_not_simulated() -> None:
    text = edit("  microbatches = 4\n", "  microbatches = 10 ** 9\n")
    text = edit("  global_batch = 16\n", "  global_batch = 10 ** 9 * 4\n", text)
    r = check_text(text)  # simulating a billion microbatches would never end
    assert r.ok and r.valid_worlds == (4, 8, 16)


def test_checking_is_deterministic() -> None:
    text = edit("vocab_size = 128", "vocab_size = 127")
    assert check_text(text).diagnostics == check_text(text).diagnostics


@pytest.mark.skipif(not HAVE_TORCH, reason="model-level checks need torch")
def test_model_level_errors_do_not_cascade_into_pairing() -> None:
    text = edit("  layers[*].attention.wq : column\n", "  layers[*].attention.wqq : column\n")
    r = check_text(text, model=True)
    assert [d.code for d in r.diagnostics] == ["E0402"]
    assert r.diagnostics[0].hint == "did you mean 'layers[*].attention.wq'?"


@pytest.mark.skipif(not HAVE_TORCH, reason="model-level checks need torch")
def test_a_rule_against_the_config_and_against_the_model_says_the_same() -> None:
    r = check_text(edit("vocab_size = 128", "vocab_size = 127"), model=True)  # E0203: the config's, the embedding's
    config, model = [d for d in r.diagnostics if d.code == "E0203"]
    assert model.message == f"tok_embeddings: {config.message}" and model.hint == config.hint


@pytest.mark.skipif(not HAVE_TORCH, reason="model-level checks need torch")
def test_model_level_counts_blocks_of_the_real_model() -> None:
    text = edit("n_layers = 8", "n_layers = 2")
    text = edit("  microbatches = 4\n", "  chunks = 2\n  style = interleaved\n  microbatches = 4\n", text.replace("  style = 1f1b\n", ""))
    r = check_text(text, model=True)
    assert "E0308" in {d.code for d in r.diagnostics}


# ---- layering ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("module", ["ppdsl.dsl.check", "ppdsl.dsl.parse", "ppdsl.dsl.resolve", "ppdsl.dsl.introspect",
                                    "ppdsl.dsl.model_check", "ppdsl.dsl.tp_dataflow", "ppdsl.dsl.tp_pairing", "ppdsl.cli"])
def test_importing_the_checker_imports_no_torch(module: str) -> None:
    code = (f"import sys, {module}\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'numpy'))\n"
            "print(bad)\n"
            "raise SystemExit(1 if bad else 0)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_cli_import_is_light() -> None:
    code = "import sys, ppdsl.cli\nprint(sorted(m for m in sys.modules if m.split('.')[0] in ('sympy', 'lark', 'torch')))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "[]", proc.stdout + proc.stderr


def test_check_without_model_does_not_import_the_spec_or_torch() -> None:
    code = ("import sys\nfrom ppdsl.dsl.check import check_file\n"
            f"r = check_file({str(SPECS[0])!r}, model=False)\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers') or m == 'ppdsl.models.decoder')\n"
            "raise SystemExit(0 if r.ok and not bad else 1)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _imported_modules(path: Path, package: str) -> set[str]:
    """Every module a source file imports, at any depth (function-level imports included),
    relative imports made absolute against ``package``."""
    import ast

    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            mod = ".".join(p for p in (base, node.module or "") if p)
            out |= {mod} | {f"{mod}.{a.name}" for a in node.names}
    return out


def test_dsl_imports_nothing_of_lowering() -> None:
    """lowering/ builds on dsl/, never the other way round: check's schedule stage uses the pure
    ppdsl.core.schedules (which imports neither)."""
    dsl_dir = Path(check_mod.__file__).parent
    bad = {f.name: sorted(m for m in _imported_modules(f, "ppdsl.dsl") if m.startswith("ppdsl.lowering"))
           for f in sorted(dsl_dir.glob("*.py"))}
    assert not {k: v for k, v in bad.items() if v}, bad
    schedules_dir = Path(check_mod.__file__).resolve().parent.parent / "core" / "schedules"
    for f in sorted(schedules_dir.glob("*.py")):
        assert not {m for m in _imported_modules(f, "ppdsl.core.schedules")
                    if m.startswith(("ppdsl.dsl", "ppdsl.lowering", "ppdsl.runtime", "torch"))}, f.name


def test_model_check_module_has_no_torch_at_module_level() -> None:
    assert "torch" not in Path(check_mod.__file__).read_text().split("def ")[0]


def test_tp_that_splits_nothing_is_a_warning_once_tp_is_known() -> None:
    rules = "  tok_embeddings : vocab\n  layers[*].attention.wq : column\n  layers[*].attention.wo : row\n"
    idle = edit(rules, "  tok_embeddings : replicate\n")
    r = check_text(idle, "t.ppspec")
    assert r.ok and [(d.code, d.span.line) for d in r.diagnostics] == [("W0217", 7)]  # at `tp = 2`
    assert "tp = 2" in r.diagnostics[0].message
    assert not check_text(BASE, "t.ppspec").diagnostics  # something is split: nothing to say
    assert not check_text(edit("  tp = 2\n", "  tp = 1\n", idle), "t.ppspec").diagnostics
    by_world = edit("  tp = 2\n", "  tp = world / 2\n", idle)
    assert not check_text(by_world, "t.ppspec").diagnostics  # tp unknown without --world
    assert [d.code for d in check_text(by_world, "t.ppspec", world=8).diagnostics] == ["W0217"]
    broken = edit("  global_batch = 16\n", "  global_batch = 15\n", idle)
    assert "W0217" not in [d.code for d in check_text(broken, "t.ppspec").diagnostics]  # errors first


@pytest.mark.skipif(not HAVE_TORCH, reason="model-level checks need torch")
def test_a_dependency_outside_the_tested_range_is_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    from importlib import metadata

    from ppdsl.core import versions

    assert versions.untested("torch") is None and versions.untested("transformers") is None  # the set-up's
    assert not [d for d in check_text(BASE, model=True).diagnostics if d.code == "W0430"]
    real = metadata.version
    fake = {"torch": "2.99.0", "transformers": "5.10.0"}  # between the two transformers releases CI tests
    monkeypatch.setattr(metadata, "version", lambda d: fake.get(d) or real(d))
    installed, declared = versions.untested("transformers")
    assert installed == "5.10.0" and versions.describe_range(declared) == ">=4.57.6,<5.26 except 5.0 to 5.23"
    fake["transformers"] = "4.57.6"
    assert versions.untested("transformers") is None
    found = [d for d in check_text(BASE, model=True).diagnostics if d.code == "W0430"]
    # BASE's model is a python factory: only torch's version matters to it
    assert [d.message for d in found] == ["torch 2.99.0 is installed, but ppdsl is tested with torch>=2.13,<2.14"]
    assert found[0].span is not None and found[0].span.line == 3
