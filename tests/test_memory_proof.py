"""Will it fit (issue 34, item 2): `train.device_memory` / `ppdsl check --device-memory`, check's
proof that every rank's peak (the estimate `ppdsl plan` prints) fits it (E0440, N0440, N0441),
and W0440 without one where a rank needs more than any accelerator holds.

The sizes and the no-model cases are pure Python; the rest builds small HF models on the meta
device (the session's model-facts cache keeps each after its first build).
"""

from __future__ import annotations

import importlib.util
import re
import shlex

import pytest

from ppdsl import cli
from ppdsl.dsl.check import check_text
from ppdsl.dsl.sizes import SizeError, format_size, parse_size, written_size
from ppdsl.lowering.fit import LARGEST_DEVICE, Estimator, check_text_and_fit

needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None or
                                 importlib.util.find_spec("transformers") is None,
                                 reason="builds the model on the meta device")

SPEC = """ppspec 1
model llama {
  source = hf("LlamaForCausalLM")
  config { num_hidden_layers = 4, hidden_size = 256, intermediate_size = 512, num_attention_heads = 4,
           num_key_value_heads = 4, vocab_size = 1024, max_position_embeddings = 256 }
}
mesh { tp = 1, pp = 2 }
pipeline { style = 1f1b, microbatches = 4 }
train {
  global_batch = 8
  seq_len = 64
  device_memory = DEVICE
}
"""
DEVICE_LINE = 12  # where `device_memory = ...` is in SPEC
MESH_LINE = 7


def _spec(device: str = "none") -> str:
    return SPEC.replace("DEVICE", device)


def _peak(world: int, overrides: tuple[str, ...] = ()) -> tuple[int, int]:
    """(rank, bytes) of the largest rank at `world`, from `ppdsl plan`'s own report."""
    from ppdsl.lowering.lower import lower
    from ppdsl.views.report import plan_report

    r = check_text(_spec(), world=world, overrides=list(overrides), model=True)
    assert r.ok, r.diagnostics
    rows = plan_report(lower(r.spec, world, r.model_info), r.model_info, r.spec.model.dims.get("hidden")).rows
    top = max(rows, key=lambda row: (row.memory_bytes, -row.rank))
    return top.rank, top.memory_bytes


# ---- sizes, pure Python ------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "size"), [
    ("80GiB", 80 * 2**30), ("141GB", 141 * 10**9), ("1.5 TiB", 3 * 2**39), ("85899345920", 85899345920),
    ("512mib", 512 * 2**20), ("2_000MB", 2 * 10**9),
])
def test_sizes_parse(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["80G", "GiB", "", "-1GiB", "0", "80 Gibibytes"])
def test_not_sizes(text: str) -> None:
    with pytest.raises(SizeError):
        parse_size(text)


def test_sizes_show_as_written() -> None:
    assert (written_size(80 * 2**30), written_size(141 * 10**9), written_size(12345)) == ("80GiB", "141GB", "12345")
    assert format_size(3 * 2**29) == "1.5GiB"


@pytest.mark.parametrize(("value", "size"), [
    ("80GiB", 80 * 2**30), ("141GB", 141 * 10**9), ('"1.5 TiB"', 3 * 2**39), ("85899345920", 85899345920),
    ("80 * 2**30", 80 * 2**30), ("none", None),
])
def test_the_key_resolves(value: str, size: int | None) -> None:
    r = check_text(_spec(value), model=False)
    assert not [d for d in r.diagnostics if d.is_error], r.diagnostics
    assert r.spec.train.device_memory == size


@pytest.mark.parametrize(("value", "says"), [("80", "less than 1 MiB"), ("80G", "not a unit"), ("big", "not a size"),
                                             ("-5", "must be a size")])
def test_a_bad_size_is_e0103_at_its_value(value: str, says: str) -> None:
    r = check_text(_spec(value), model=False)
    bad = [d for d in r.diagnostics if d.code == "E0103"]
    assert bad and says in bad[0].message, r.diagnostics
    assert (bad[0].span.line, bad[0].span.column) == (DEVICE_LINE, len("  device_memory = ") + 1)


def test_without_the_model_a_stated_memory_is_a_note() -> None:
    r = check_text_and_fit(_spec("80GiB"), world=2, model=False)
    assert r.ok and [d.code for d in r.diagnostics] == ["N0441"]
    assert r.diagnostics[0].span.line == DEVICE_LINE


def test_the_key_is_in_the_schema() -> None:
    from ppdsl.dsl import schema

    key = schema.BLOCKS["train"]["device_memory"]
    assert key.kind == "size" and key.default is None and "80GiB" in key.doc


# ---- the proof, on a built model ---------------------------------------------------------------


@needs_torch
def test_a_spec_that_fits_passes() -> None:
    _, peak = _peak(2)
    r = check_text_and_fit(_spec(written_size(peak + 2**20)), world=2, model=True)
    assert r.ok and r.diagnostics == (), r.diagnostics
    free = check_text_and_fit(_spec("1TiB"), model=True)
    assert free.ok and free.diagnostics == () and free.valid_worlds == (2, 4)


@needs_torch
def test_a_rank_over_the_device_memory_is_refused_at_its_line() -> None:
    rank, peak = _peak(2)
    device = (peak // 2**20 - 1) * 2**20  # 1 MiB short, at least
    r = check_text_and_fit(_spec(written_size(device)), world=2, model=True)
    assert not r.ok
    (d,) = [d for d in r.diagnostics if d.code == "E0440"]
    assert (d.span.line, d.span.column) == (DEVICE_LINE, 3)
    assert d.message.startswith(f"rank {rank} needs {format_size(peak)} (")
    assert f"more than device_memory = {written_size(device)}" in d.message and "at world 2" in d.message
    # the three largest terms, with their figures (the traced activations, 10.5 MiB, outgrow the gradients)
    for term in ("optimizer state", "activations", "weights"):
        assert re.search(rf"{term} \d+\.\dMiB", d.message), d.message
    assert d.label == f"rank {rank}: {format_size(peak)} of {written_size(device)}"


@needs_torch
def test_the_hint_names_a_change_that_passes() -> None:
    _, peak = _peak(2)
    device = written_size((peak // 2**20 - 1) * 2**20)
    r = check_text_and_fit(_spec(device), world=2, model=True)
    (d,) = [d for d in r.diagnostics if d.code == "E0440"]
    m = re.search(r"\(--set (.+)\)$", d.hint)
    assert m and " fits: rank " in d.hint, d.hint
    sets = [s for s in shlex.split(m.group(1)) if s != "--set"]
    again = check_text_and_fit(_spec(device), world=2, overrides=sets, model=True)
    assert again.ok and not [x for x in again.diagnostics if x.code == "E0440"], again.diagnostics


@needs_torch
def test_world_sizes_where_a_rank_does_not_fit_leave_the_verdict() -> None:
    peaks = {w: _peak(w)[1] for w in (2, 4)}
    assert peaks[2] > peaks[4]  # dp shrinks the microbatches: fewer activations per rank
    device = peaks[4] + (peaks[2] - peaks[4]) // 2
    r = check_text_and_fit(_spec(str(device)), model=True)
    assert r.ok and r.valid_worlds == (4,) and r.worlds == "world = 4"
    (n,) = [d for d in r.diagnostics if d.code == "N0440"]
    assert n.span.line == DEVICE_LINE and "leaves out" in n.message
    nothing = check_text_and_fit(_spec(str(peaks[4] - 2**20)), model=True)
    assert not nothing.ok and nothing.valid_worlds is None
    (e,) = [d for d in nothing.diagnostics if d.code == "E0440"]
    assert "no world size of the verdict" in e.message and "at world 4, the one that needs least" in e.message


@needs_torch
def test_check_and_plan_count_the_same() -> None:
    r = check_text(_spec(), model=True)
    est = Estimator(r.spec, r.model_info)
    for w in (2, 4):
        p = est.at(w)
        assert (p.rank, p.peak) == _peak(w)


PHI3 = """ppspec 1
model phi3 {
  source = hf("Phi3ForCausalLM")
  config {
    num_hidden_layers = 4, hidden_size = 256, num_attention_heads = 8, num_key_value_heads = 8
    intermediate_size = 2147483648
    vocab_size = 32064
  }
}
mesh { tp = 1, pp = 2 }
pipeline { style = 1f1b, microbatches = 4 }
train { global_batch = 8, seq_len = 128 }
"""


@needs_torch
def test_phi3_with_a_huge_intermediate_size_warns_at_that_key() -> None:
    plain = check_text(PHI3, model=True)
    assert plain.ok and not plain.diagnostics  # what check said before: nothing
    r = check_text_and_fit(PHI3, model=True)
    assert r.ok and r.valid_worlds == plain.valid_worlds  # a warning: the verdict stands
    (w,) = [d for d in r.diagnostics if d.code == "W0440"]
    assert (w.span.line, w.span.column) == (6, 5)  # intermediate_size = 2147483648
    assert "more than any accelerator holds (288GiB" in w.message and "GiB" in w.message
    assert w.label.startswith("intermediate_size = 2147483648: most of rank ")
    assert LARGEST_DEVICE == 288 * 2**30
    at = check_text_and_fit(PHI3, world=2, model=True)
    assert [d.code for d in at.diagnostics] == ["W0440"] and "at world 2" in at.diagnostics[0].message
    stated = check_text_and_fit(PHI3, world=2, model=True, device_memory="80GiB")
    assert [d.code for d in stated.diagnostics] == ["E0440"]


# ---- the command line --------------------------------------------------------------------------


def _cli(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> tuple[int, str]:
    monkeypatch.setenv("NO_COLOR", "1")
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, err + out


@pytest.fixture
def spec_file(tmp_path):
    path = tmp_path / "llama.ppspec"
    path.write_text(_spec(), encoding="utf-8")
    return str(path)


@needs_torch
def test_device_memory_on_the_command_line(capsys, monkeypatch, spec_file) -> None:
    rank, peak = _peak(2)
    short, enough = written_size((peak // 2**20 - 1) * 2**20), written_size((peak // 2**20 + 1) * 2**20)
    code, text = _cli(capsys, monkeypatch, ["check", spec_file, "--world", "2", "--device-memory", short])
    assert code == 2 and "error[E0440]" in text and f"{spec_file}:{MESH_LINE}:1" in text, text
    assert f"rank {rank} needs {format_size(peak)}" in text and "Traceback" not in text
    code, text = _cli(capsys, monkeypatch, ["check", spec_file, "--world", "2", "--device-memory", enough])
    assert code == 0 and text.strip() == f"{spec_file}: ok for world = 2", text
    code, text = _cli(capsys, monkeypatch, ["check", spec_file, "--world", "2", "--set", f"train.device_memory={short}"])
    assert code == 2 and "error[E0440]" in text and f"--set train.device_memory={short}:1:" in text, text
    # --device-memory wins over the spec's
    code, text = _cli(capsys, monkeypatch, ["check", spec_file, "--world", "2", "--set", f"train.device_memory={short}",
                                            "--device-memory", enough])
    assert code == 0, text


def test_a_bad_device_memory_option_is_e0005(capsys, monkeypatch, spec_file) -> None:
    code, text = _cli(capsys, monkeypatch, ["check", spec_file, "--no-model", "--device-memory", "80G"])
    assert code == 2 and "error[E0005]: --device-memory: 'G' in '80G' is not a unit of size" in text, text
    code, text = _cli(capsys, monkeypatch, ["check", spec_file, "--no-model", "--world", "2", "--device-memory", "80GiB"])
    assert code == 0 and "note[N0441]" in text and f"{spec_file}:{MESH_LINE}:1" in text, text
