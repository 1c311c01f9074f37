"""A stranger's spec is safe to check, and a user's mistake is a diagnostic, never an internal error.

- `check --no-model` runs nothing of the spec and reads no file outside its directory (E0419);
- `python(...)` refuses a target that is not a model factory before calling it (E0401);
- diagnostics quote a file's content only as short identifier-like tokens;
- data checks read a bounded head (an 8 GiB line without a newline: a diagnostic, fast);
- a model beyond the build bound is refused (E0408), not built;
- both launch forms (`ppdsl`, `python -m ppdsl`) find the same model modules;
- `verify` switches dropout off in both runs and says so; the shipped GPT-2 and BERT specs pass.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ppdsl import cli
from ppdsl.dsl.check import check_file, check_text

ROOT = Path(__file__).resolve().parent.parent
SPECS = ROOT / "specs"
PPDSL = Path(sys.executable).parent / "ppdsl"
TIMEOUT_S = 300

TINY = (SPECS / "tiny_cpu.ppspec").read_text()


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out + err


def first_line(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(200).split(b"\n")[0].split(b"\0")[0].decode("utf-8", "replace")
    except OSError:
        return ""


@pytest.mark.parametrize("data", ['csv("/etc/passwd", tokenizer = ".")', 'text("/proc/self/environ", tokenizer = ".")',
                                  'tokens("../x.bin")', 'jsonl("sub/../../x.jsonl", tokenizer = ".")'])
def test_no_model_reads_nothing_outside_the_spec_directory(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                           data: str) -> None:
    (tmp_path / "spec").mkdir()
    spec = tmp_path / "spec" / "s.ppspec"
    spec.write_text(TINY)
    (tmp_path / "x.bin").write_bytes(b"secret-content\n")
    code, text = run(capsys, "check", str(spec), "--no-model", "--set", f"train.data={data}")
    assert code == 2 and "error[E0419]" in text, text
    for path in ("/etc/passwd", "/proc/self/environ", str(tmp_path / "x.bin")):
        line = first_line(path)
        assert not line or line[:12] not in text, f"content of {path} in the output"


def test_a_symlink_out_of_the_spec_directory_is_outside(tmp_path: Path) -> None:
    (tmp_path / "s.ppspec").write_text(TINY.replace("data = synthetic(seed = 0)", 'data = tokens("t.bin")'))
    (tmp_path / "t.bin").symlink_to("/etc/passwd")
    r = check_file(tmp_path / "s.ppspec", model=False)
    assert [d.code for d in r.diagnostics] == ["E0419"]


def test_allow_path_reads_but_never_echoes_content(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    spec = tmp_path / "s.ppspec"
    spec.write_text(TINY)
    secret = tmp_path.parent / f"{tmp_path.name}-outside"
    secret.mkdir()
    (secret / "rows.csv").write_text("root:x:0:0:root:/root:/bin/bash,PATH=/usr/bin:/secret\nx,y\n")
    (secret / "rows.jsonl").write_text('{"text": "hi", "label": "s3cr3t value with spaces: AKIA0123456789"}\n')
    for data in (f'csv("{secret}/rows.csv", tokenizer = ".")', f'jsonl("{secret}/rows.jsonl", tokenizer = ".")'):
        code, text = run(capsys, "check", str(spec), "--no-model", "--allow-path", str(secret), "--set",
                         f"train.data={data}")
        assert code == 2 and "E0419" not in text
        assert "root:x" not in text and "PATH=" not in text and "AKIA" not in text and "s3cr3t" not in text, text


def test_a_line_without_end_is_a_diagnostic_in_bounded_time(tmp_path: Path) -> None:
    spec = tmp_path / "s.ppspec"
    spec.write_text(TINY)
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text('{"model": {"vocab": {"a": 0}}}')
    for name in ("huge.jsonl", "huge.csv"):
        with open(tmp_path / name, "wb") as f:
            f.truncate(8 << 30)  # sparse: 8 GiB of zero bytes, no newline
        kind = name.split(".")[1]
        t0 = time.perf_counter()
        r = check_file(spec, model=False, overrides=[f'train.data={kind}("{name}", tokenizer = "tok")'])
        took = time.perf_counter() - t0
        assert any(d.code == "E0416" and "longer than" in d.message for d in r.diagnostics), r.diagnostics
        assert took < 2.0, f"{name}: {took:.2f} s"


def test_stdlib_and_builtin_targets_are_refused_without_being_called(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    marker = tmp_path / "called"  # os.system("touch MARKER") or NotAModel() would create it
    (tmp_path / "ppdsl_sf_targets.py").write_text(
        "import os\n"
        f"MARKER = {str(marker)!r}\n"
        "class NotAModel:\n"
        "    def __init__(self, **kw):\n"
        "        open(MARKER, 'w').close()\n"
        "system = os.system\n"
        "from shutil import rmtree\n"
    )
    for target, why in (("os:system", "standard library"), ("subprocess:run", "standard library"),
                        ("builtins:eval", "standard library"), ("ppdsl_sf_targets:system", "not a model factory"),
                        ("ppdsl_sf_targets:rmtree", "standard library"),
                        ("ppdsl_sf_targets:NotAModel", "not a torch.nn.Module")):
        spec = tmp_path / "s.ppspec"
        spec.write_text(f'ppspec 1\nmodel m {{\n  source = python("{target}")\n  config {{ command = "touch {marker}" }}\n}}\n'
                        "train { global_batch = 2, seq_len = 4 }\n")
        r = check_file(spec, model=True)
        [d] = [d for d in r.diagnostics if d.code == "E0401"]
        assert why in d.message, (target, d.message)
    assert not marker.exists()
    assert "ppdsl_sf_targets" in sys.modules  # the user's module was imported (trusted without --no-model) ...
    del sys.modules["ppdsl_sf_targets"]  # ... but nothing in it was called


def test_no_model_imports_nothing_of_the_spec(tmp_path: Path) -> None:
    (tmp_path / "ppdsl_sf_sideeffect.py").write_text(f"open({str(tmp_path / 'imported')!r}, 'w').close()\n"
                                                      "def build(**kw): pass\n")
    (tmp_path / "s.ppspec").write_text(TINY.replace("ppdsl.models.decoder:build_decoder", "ppdsl_sf_sideeffect:build"))
    r = check_file(tmp_path / "s.ppspec", model=False)
    assert r.ok and not (tmp_path / "imported").exists()


def test_a_model_beyond_the_bound_is_refused_not_built() -> None:
    pytest.importorskip("torch")
    t0 = time.perf_counter()
    r = check_text(TINY.replace("n_layers = 4", "n_layers = 1000000"), "s.ppspec", model=True)
    assert [d.code for d in r.diagnostics] == ["E0408"] and time.perf_counter() - t0 < 10


def test_both_launch_forms_find_the_same_model_modules(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    here, there = tmp_path / "cwd", tmp_path / "specdir"
    here.mkdir()
    there.mkdir()
    module = "import torch\ndef build(n_layers: int = 2, dim: int = 4):\n    return torch.nn.ModuleDict({'layers': torch.nn.ModuleList(" \
             "[torch.nn.Linear(dim, dim) for _ in range(n_layers)])})\n"
    (here / "ppdsl_sf_local.py").write_text(module)
    # dim: the width the blocks pass on (E0481 without it: no embedding runs before them)
    spec_text = 'ppspec 1\nmodel m {\n  source = python("ppdsl_sf_local:build")\n  config { dim = 4 }\n}\n' \
                'pipeline { first = [], last = [] }\n' \
                "train { global_batch = 2, seq_len = 4 }\n"
    (there / "s.ppspec").write_text(spec_text)
    (here / "s.ppspec").write_text(spec_text)
    outcomes = {}
    for label, form in (("ppdsl", [str(PPDSL)]), ("-m", [sys.executable, "-m", "ppdsl"])):
        for spec in ("../specdir/s.ppspec", "s.ppspec")[:2 if label == "-m" else 1]:
            proc = subprocess.run([*form, "check", spec], cwd=here, capture_output=True, text=True, timeout=TIMEOUT_S,
                                  env={**os.environ, "OMP_NUM_THREADS": "1"})
            outcomes[(label, spec)] = (proc.returncode, "E0401" in proc.stderr)
    # the module in the working directory is not found for a spec elsewhere, in either form;
    # next to the spec it is, in either form
    assert outcomes[("ppdsl", "../specdir/s.ppspec")] == outcomes[("-m", "../specdir/s.ppspec")] == (2, True), outcomes
    assert outcomes[("-m", "s.ppspec")] == (0, False), outcomes


# ---- verify: dropout -------------------------------------------------------------------------


def _gpt2_plan():
    from ppdsl.lowering.lower import lower

    r = check_file(SPECS / "gpt2.ppspec", world=4)  # GPT-2 runs its own forward: lowered from check's trace
    return lower(r.spec, 4, r.model_info)


def test_verify_switches_dropout_off_and_says_so() -> None:
    pytest.importorskip("torch")
    from ppdsl.runtime.verify.randomness import without_randomness

    plan = _gpt2_plan()
    config = {"resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1, "summary_first_dropout": 0.1,
              "classifier_dropout": None, "n_layer": 12, "layer_norm_epsilon": 1e-5}
    off, notes = without_randomness(plan, config)
    assert notes == ("dropout off for the comparison: attn_pdrop, embd_pdrop, resid_pdrop, summary_first_dropout",)
    assert {k: v for k, v in off.model.config_dict.items() if "drop" in k} == {
        "attn_pdrop": 0.0, "embd_pdrop": 0.0, "resid_pdrop": 0.0, "summary_first_dropout": 0.0}
    kept, notes = without_randomness(plan, config, keep=True)
    assert kept == plan and notes[0].startswith("dropout kept (attn_pdrop, ") and "masks" in notes[0]
    assert without_randomness(plan, {"resid_pdrop": 0.0}) == (plan, ())


def test_a_rank_error_names_the_rank_and_the_cause() -> None:
    from ppdsl.runtime.run.failure import describe_user_error

    assert describe_user_error(3, ValueError("stage 0: 'layers.0' overlaps the block list 'layers'")) == \
        "ppdsl: rank 3: stage 0: 'layers.0' overlaps the block list 'layers'"


SHRUNK = {
    "gpt2": ["--set", "model.config.n_layer=4", "--set", "model.config.n_embd=128", "--set", "model.config.n_head=2",
             "--set", "model.config.vocab_size=256", "--set", "train.seq_len=16"],
    "bert": ["--set", "model.config.num_hidden_layers=2", "--set", "model.config.hidden_size=64", "--set",
             "model.config.num_attention_heads=2", "--set", "model.config.intermediate_size=128", "--set",
             "model.config.vocab_size=256", "--set", "train.seq_len=16"],
}


@pytest.mark.distributed
@pytest.mark.parametrize("name", [pytest.param("bert", marks=pytest.mark.slow), "gpt2"])  # bert: about 18 s
def test_shipped_hf_specs_verify_with_dropout_off(name: str) -> None:
    pytest.importorskip("transformers")
    proc = subprocess.run([str(PPDSL), "verify", str(SPECS / f"{name}.ppspec"), "--world", "4", "--steps", "1",
                           *SHRUNK[name]], capture_output=True, text=True, timeout=TIMEOUT_S,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "dropout off for the comparison: " in proc.stdout and proc.stdout.rstrip().endswith("OK")


@pytest.mark.parametrize("content", ["5", "[1, 2]", '"root:x:0:0"'])
def test_a_config_json_that_is_no_object_is_a_warning(tmp_path: Path, content: str) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(content)
    (tmp_path / "s.ppspec").write_text('ppspec 1\nmodel m { source = hf_pretrained("m") }\n'
                                       "train { global_batch = 2, seq_len = 4 }\n")
    r = check_file(tmp_path / "s.ppspec", model=False)
    assert [d.code for d in r.diagnostics] == ["W0401"] and "root:x" not in r.diagnostics[0].message


def test_verify_leaves_out_elements_decided_by_rounding_but_not_a_wrong_gradient() -> None:
    """Adam turns an element whose gradient is a near-zero sum (the runs disagree on its sign) into a
    step of about lr either way: its value is not compared. A tensor whose gradient is wrong still
    fails, and is not called noise."""
    torch = pytest.importorskip("torch")
    from _tiny_models import tiny_plan  # imports torch, which this module does not need elsewhere

    from ppdsl.runtime.verify.reference import ReferenceRun
    from ppdsl.runtime.verify.report import Tolerances
    from ppdsl.runtime.verify.compare import compare

    plan = tiny_plan("generic", "1f1b", pp=2, tp=1)
    g_ref = torch.ones(64)
    g_ref[:2] = 1e-5  # near zero: the parallel run gets the other sign
    g_par = g_ref.clone()
    g_par[:2] = -1e-5
    p_ref = torch.full((64,), 1e-3)
    p_par = p_ref.clone()
    p_par[:2] = -1e-3  # Adam stepped the other way
    ref = ReferenceRun(losses=[1.0], grad_norms=[8.0], grads=[{"b": g_ref}], params={"b": p_ref}, aliases={})
    ok = compare(plan, 1, [1.0], [8.0], [{"b": g_par}], {"b": p_par}, ref, Tolerances(drift_rel=1e-4))
    assert ok.ok and ok.noise == () and ok.max_param_diff == 0.0, ok.render()
    wrong = compare(plan, 1, [1.0], [8.0], [{"b": g_ref * 1.01}], {"b": p_par}, ref, Tolerances(drift_rel=1e-4))
    assert not wrong.ok and wrong.noise == () and wrong.max_param_diff > 0.1
