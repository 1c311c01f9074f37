"""The `ppdsl` command: exit codes, output formats, several files, schedule and plan."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ppdsl import cli

ROOT = Path(__file__).resolve().parent.parent
SPECS = sorted((ROOT / "specs").glob("*.ppspec"))
GPT2 = str(ROOT / "specs" / "gpt2.ppspec")

BAD = """ppspec 1
model tiny {
  source = python("ppdsl.models.decoder:build_decoder")
  config { vocab_size = 127, dim = 64, n_layers = 4, n_heads = 4, max_seq_len = 64 }
}
mesh { tp = 2, pp = 2 }
tensor_parallel { tok_embeddings : vocab }
pipeline { style = 1f1b, microbatches = 4 }
train { global_batch = 8, seq_len = 32 }
"""


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        code = cli.main(list(argv))
    except SystemExit as exc:  # argparse
        code = exc.code if isinstance(exc.code, int) else 2
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture()
def bad(tmp_path: Path) -> str:
    path = tmp_path / "bad.ppspec"
    path.write_text(BAD, encoding="utf-8")
    return str(path)


# ---- check ------------------------------------------------------------------------------------------


def test_check_valid_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "check", GPT2, "--no-model")
    assert (code, err) == (0, "")
    assert out == f"{GPT2}: ok for multiples of 4 that divide 16: 4, 8, 16\n"


def test_check_with_world(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(capsys, "check", GPT2, "--no-model", "--world", "8") == (0, f"{GPT2}: ok for world = 8\n", "")
    code, out, err = run(capsys, "check", GPT2, "--no-model", "--world", "6")
    assert code == 2 and out == ""
    assert err.startswith("error[E0201]: world = 6 does not split") and err.endswith(f"{GPT2}: 1 error\n")


def test_check_invalid_exits_2_with_compiler_style_text(capsys: pytest.CaptureFixture[str], bad: str) -> None:
    code, out, err = run(capsys, "check", bad, "--no-model")
    assert code == 2 and out == ""
    assert err == (
        "error[E0203]: vocab_size = 127 is not divisible by tp = 2\n"
        f" --> {bad}:7:19\n"
        "  |\n"
        "7 | tensor_parallel { tok_embeddings : vocab }\n"
        "  |                   ^^^^^^^^^^^^^^^^^^^^^^ splits 127 vocabulary rows over 2 ranks\n"
        "  = hint: use vocab(pad_to = 64) (any multiple of tp) or set vocab_size to a multiple of tp\n"
        "\n"
        f"{bad}: 1 error\n"
    )


def test_check_json_schema(capsys: pytest.CaptureFixture[str], bad: str) -> None:
    code, out, err = run(capsys, "check", bad, "--no-model", "--format", "json")
    assert (code, err) == (2, "")
    report = json.loads(out)
    assert set(report) == {"file", "ok", "world", "valid_worlds", "valid_world_sizes", "diagnostics"}
    assert (report["file"], report["ok"], report["world"], report["valid_worlds"]) == (bad, False, None, None)
    (d,) = report["diagnostics"]
    assert set(d) == {"code", "severity", "message", "span", "label", "hint"}
    assert (d["code"], d["severity"]) == ("E0203", "error")
    assert d["span"] == {"file": bad, "line": 7, "column": 19, "end_line": 7, "end_column": 41}
    code, out, _ = run(capsys, "check", GPT2, "--no-model", "--format", "json")
    report = json.loads(out)
    assert code == 0 and report["ok"] is True and report["diagnostics"] == []
    assert report["valid_worlds"] == "multiples of 4 that divide 16: 4, 8, 16"
    assert report["valid_world_sizes"] == [4, 8, 16]
    code, out, _ = run(capsys, "check", GPT2, "--no-model", "--format", "json", "--world", "8")
    assert json.loads(out)["world"] == 8


def test_check_several_files(capsys: pytest.CaptureFixture[str], bad: str) -> None:
    code, out, err = run(capsys, "check", *map(str, SPECS), "--no-model")
    assert code == 0 and err == ""
    assert [line.split(":")[0] for line in out.splitlines()] == [str(p) for p in SPECS]
    code, out, err = run(capsys, "check", GPT2, bad, "--no-model")
    assert code == 2  # one invalid file makes the call invalid
    assert f"{GPT2}: ok for" in out and f"{bad}: 1 error" in err
    code, out, _ = run(capsys, "check", GPT2, bad, "--no-model", "--format", "json")
    reports = json.loads(out)
    assert code == 2 and isinstance(reports, list) and [r["ok"] for r in reports] == [True, False]


def test_check_set_override(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "check", GPT2, "--no-model", "--set", "mesh.tp=5", "--world", "10")
    assert code == 2 and "error[E0204]: attention heads = 12 is not divisible by tp = 5" in err
    code, out, _ = run(capsys, "check", GPT2, "--no-model", "--set", "mesh.tp=4", "--set", "mesh.pp=1")
    assert code == 0 and "multiples of 4" in out
    code, _, err = run(capsys, "check", GPT2, "--no-model", "--set", "mesh.tp")
    assert code == 2 and err.startswith("error[E0005]: cannot read --set 'mesh.tp'")


def test_check_missing_file_and_binary_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = run(capsys, "check", str(tmp_path / "none.ppspec"), "--no-model")
    assert code == 2 and err.startswith("error[E0000]: cannot read")
    blob = tmp_path / "blob.ppspec"
    blob.write_bytes(b"\x00\x01\x02")
    code, _, err = run(capsys, "check", str(blob), "--no-model")
    assert code == 2 and "error[E0001]: this is not a text file" in err


@pytest.mark.parametrize(
    "argv",
    [[], ["check"], ["frobnicate"], ["check", GPT2, "--world", "eight"], ["check", GPT2, "--format", "xml"],
     ["plan", GPT2], ["check", GPT2, "--bogus"], ["schedule", "--format", "png"]],
)
def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert "usage:" in err or "error" in err
    assert "Traceback" not in err


def test_check_world_zero_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "check", GPT2, "--no-model", "--world", "0")
    assert code == 2 and "error[E0005]: --world must be at least 1, got 0" in err


def test_no_color_when_not_a_terminal(capsys: pytest.CaptureFixture[str], bad: str) -> None:
    _, _, err = run(capsys, "check", bad, "--no-model")
    assert "\x1b[" not in err


# ---- schedule ------------------------------------------------------------------------------------


def test_schedule_text(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "schedule", "--style", "1f1b", "--pp", "4", "--microbatches", "8")
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0].startswith("1f1b  pp=4  m=8  v=1")
    ranks = [line for line in lines if line.startswith("rank ")]
    assert len(ranks) == 4
    for r in ranks:  # every rank runs every microbatch forward and backward once
        cells = r.split("|", 1)[1].split()
        assert sorted(c for c in cells if c.startswith("F")) == sorted(f"F{i}" for i in range(8))
        assert sorted(c for c in cells if c.startswith("B")) == sorted(f"B{i}" for i in range(8))
    assert "bubble" in out


def test_schedule_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "schedule", "--style", "1f1b", "--pp", "4", "--microbatches", "8", "--format", "json")
    assert code == 0
    data = json.loads(out)
    assert (data["style"], data["pp"], data["microbatches"], data["chunks"]) == ("1f1b", 4, 8, 1)
    assert [r["rank"] for r in data["ranks"]] == [0, 1, 2, 3]
    for r in data["ranks"]:
        ops = [(a["op"], a["microbatch"]) for a in r["actions"] if a["op"] in ("F", "B")]
        assert sorted(ops) == sorted([("F", i) for i in range(8)] + [("B", i) for i in range(8)])
        assert all(a["stage"] == r["rank"] for a in r["actions"] if a["op"] in ("F", "B"))


def test_schedule_svg_to_a_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, _ = run(capsys, "schedule", "--style", "1f1b", "--pp", "4", "--microbatches", "8", "--format", "svg")
    assert code == 0 and out.lstrip().startswith("<svg") and out.rstrip().endswith("</svg>")
    target = tmp_path / "s.svg"
    code, out, _ = run(capsys, "schedule", "--style", "1f1b", "--pp", "4", "--microbatches", "8", "--format", "svg",
                       "-o", str(target))
    assert code == 0 and out == f"wrote {target}\n"  # a command that writes a file names it
    assert target.read_text(encoding="utf-8").lstrip().startswith("<svg")


@pytest.mark.parametrize("style", ["gpipe", "1f1b", "interleaved", "zbv"])
def test_schedule_styles(capsys: pytest.CaptureFixture[str], style: str) -> None:
    code, out, err = run(capsys, "schedule", "--style", style, "--pp", "2", "--microbatches", "4")
    assert code == 0, err
    assert out.startswith(style)


def test_schedule_from_a_spec(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "schedule", GPT2, "--world", "8")
    assert code == 0, err
    assert out.startswith("interleaved  pp=2  m=8  v=2")
    code, _, err = run(capsys, "schedule", GPT2)
    assert code == 2 and "give --world N" in err


def test_schedule_errors(capsys: pytest.CaptureFixture[str], bad: str) -> None:
    code, _, err = run(capsys, "schedule", "--style", "1f1b", "--pp", "4")
    assert code == 2 and "give a spec, or --style, --pp and --microbatches" in err
    code, _, err = run(capsys, "schedule", "--style", "nope", "--pp", "4", "--microbatches", "8")
    assert code == 2 and err.startswith("error[E0005]: unknown pipeline style 'nope'")  # a coded diagnostic
    code, _, err = run(capsys, "schedule", bad, "--world", "4")
    assert code == 2 and "error[E0203]" in err


# ---- plan ----------------------------------------------------------------------------------------


def test_plan_text(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "plan", GPT2, "--world", "8")  # its own forward: lowered from the model
    assert (code, err) == (0, "")
    assert out.startswith(f"plan for {GPT2}: world 8 = dp 2 x pp 2 x tp 2; interleaved, 8 microbatches of 2")
    rows = [line for line in out.splitlines() if line[:1].isdigit()]
    assert len(rows) == 8


def test_plan_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "plan", GPT2, "--world", "8", "--format", "json")
    assert (code, err) == (0, "")
    data = json.loads(out)
    assert isinstance(data, dict) and data
    text = json.dumps(data)
    assert "interleaved" in text and "transformer.h" in text


def test_plan_of_an_invalid_spec_exits_2(capsys: pytest.CaptureFixture[str], bad: str) -> None:
    code, out, err = run(capsys, "plan", bad, "--world", "4", "--no-model")
    assert code == 2 and out == "" and "error[E0203]" in err
    code, out, err = run(capsys, "plan", GPT2, "--world", "6", "--no-model")
    assert code == 2 and "error[E0201]" in err


# ---- the real command ------------------------------------------------------------------------------


def test_the_installed_command(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "ppdsl", "check", GPT2, "--no-model"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith(f"{GPT2}: ok for")
    path = tmp_path / "bad.ppspec"
    path.write_text(BAD)
    proc = subprocess.run([sys.executable, "-m", "ppdsl", "check", str(path), "--no-model"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "error[E0203]" in proc.stderr and "Traceback" not in proc.stderr


def test_a_closed_pipe_is_not_an_internal_error() -> None:
    proc = subprocess.run(f"'{sys.executable}' -m ppdsl schedule --style 1f1b --pp 8 --microbatches 64 --format json | head -c 10",
                          shell=True, capture_output=True, text=True, timeout=120)
    assert "internal error" not in proc.stderr and "Traceback" not in proc.stderr
