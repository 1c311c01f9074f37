"""`ppdsl run` as a launcher (torchrun's options, every world of an elastic range checked before
launch, E0201 saying the command), the run-directory rule, `--version` and shell completion."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ppdsl import cli
from ppdsl.runtime.export.atomic_dir import EXPORT_MARKER
from ppdsl.runtime.run.launch import torchrun_args
from ppdsl.runtime.run.rundir import claim_run_dir, clear_earlier_run, earlier_run
from ppdsl.runtime.run.torchrun_options import LAUNCHER_OPTIONS, is_standalone, parse_nnodes

from _run_helpers import ROOT, TINY_CPU, env, free_port, losses, run_cmd, tiny_cpu_spec

PP2 = ("--set", "mesh.tp=1")  # tiny_cpu as a 2-stage pipeline: world 2


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        code = cli.main(list(argv))
    except SystemExit as exc:  # argparse
        code = exc.code if isinstance(exc.code, int) else 2
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture()
def launched(monkeypatch: pytest.MonkeyPatch) -> _Calls:
    """Replaces torchrun's launcher: records what `ppdsl run` would start."""
    calls = _Calls()
    handed = calls.handed  # the plan handed to the workers, per launch

    def fake(spec: str, argv: list[str], nproc: int, max_restarts: int = 0, options: dict | None = None,
             plan: object = None) -> int:
        calls.append((nproc, max_restarts, dict(options or {}), torchrun_args(spec, argv, nproc, max_restarts, options)))
        handed.append(plan)
        return 0

    monkeypatch.setattr("ppdsl.runtime.run.launch.launch", fake)
    monkeypatch.setattr(sys, "argv", ["ppdsl"])  # the worker command line comes from the parsed flags
    return calls


class _Calls(list):
    """The launches recorded (nproc, restarts, options, torchrun's arguments), and in `handed`
    the plan each one gave its workers."""

    def __init__(self) -> None:
        super().__init__()
        self.handed: list[object] = []


# ---- torchrun's options --------------------------------------------------------------------------


def test_torchrun_args_one_node_is_standalone() -> None:
    args = torchrun_args("s.ppspec", ["run", "s.ppspec", "--nproc_per_node", "4", "--log-dir=/tmp/l", "--out", "o"], 4,
                         options={"--log-dir": "/tmp/l", "--nnodes": "1"})
    assert args == ["--standalone", "--nproc-per-node=4", "--log-dir=/tmp/l", "--module", "ppdsl",
                    "run", "s.ppspec", "--out", "o"]


def test_torchrun_args_several_nodes_pass_the_rendezvous_through() -> None:
    argv = ["run", "s.ppspec", "--nnodes", "2:4", "--nproc", "2", "--rdzv_backend", "c10d", "--rdzv-endpoint=h:29500",
            "--rdzv-id", "job", "--max-restarts", "3", "--overwrite"]
    options = {"--nnodes": "2:4", "--rdzv-backend": "c10d", "--rdzv-endpoint": "h:29500", "--rdzv-id": "job"}
    assert torchrun_args("s.ppspec", argv, 2, 3, options) == [
        "--nproc-per-node=2", "--nnodes=2:4", "--rdzv-backend=c10d", "--rdzv-endpoint=h:29500", "--rdzv-id=job",
        "--max-restarts=3", "--module", "ppdsl", "run", "s.ppspec", "--overwrite"]
    static = {"--nnodes": "2", "--node-rank": "1", "--master-addr": "10.0.0.1", "--master-port": "29400"}
    assert torchrun_args("s.ppspec", ["run", "s.ppspec"], 4, 0, static)[:5] == [
        "--nproc-per-node=4", "--nnodes=2", "--node-rank=1", "--master-addr=10.0.0.1", "--master-port=29400"]
    # torchrun's own parser takes every option as given
    from torch.distributed.run import get_args_parser

    ns = get_args_parser().parse_args(torchrun_args("s.ppspec", argv, 2, 3, options))
    assert (ns.nnodes, ns.nproc_per_node, ns.rdzv_backend, ns.rdzv_endpoint, ns.max_restarts) == (
        "2:4", "2", "c10d", "h:29500", 3)


def test_every_launcher_option_is_torchruns() -> None:
    from torch.distributed.run import get_args_parser

    torchrun = {s for a in get_args_parser()._actions for s in a.option_strings}
    for o in LAUNCHER_OPTIONS:
        assert set(o.names) <= torchrun, o.names


def test_nnodes_and_standalone() -> None:
    assert parse_nnodes("2") == (2, 2) and parse_nnodes("1:3") == (1, 3)
    for bad in ("0", "3:2", "a", "1:2:3", ""):
        with pytest.raises(ValueError, match="--nnodes must be N or MIN:MAX"):
            parse_nnodes(bad)
    assert is_standalone({}) and is_standalone({"--nnodes": "1", "--log-dir": "l"})
    assert not is_standalone({"--nnodes": "2"}) and not is_standalone({"--master-port": "29500"})


def test_run_accepts_torchruns_spelling(capsys: pytest.CaptureFixture[str], launched: list, tmp_path: Path) -> None:
    code, _, err = run(capsys, "run", str(TINY_CPU), "--nproc_per_node", "2", *PP2, "--out", str(tmp_path / "o"),
                       "--nnodes", "1", "--master_port", "29777", "--local-ranks-filter", "0", "--max_restarts", "1")
    assert code == 0, err
    ((nproc, restarts, options, args),) = launched
    assert (nproc, restarts) == (2, 1)
    assert options == {"--nnodes": "1", "--master-port": "29777", "--local-ranks-filter": "0"}
    assert args[:4] == ["--nproc-per-node=2", "--nnodes=1", "--master-port=29777", "--max-restarts=1"]
    assert args[-7:] == ["ppdsl", "run", str(TINY_CPU), "--set", "mesh.tp=1", "--out", str(tmp_path / "o")]


def test_run_help_shows_the_torchrun_form(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "run", "--help")
    assert code == 0
    for flag in ("--nproc N, --nproc-per-node N, --nproc_per_node N", "--nnodes N|MIN:MAX", "--rdzv-endpoint HOST[:PORT]",
                 "--master_port PORT", "--local-ranks-filter RANKS", "--overwrite"):
        assert flag in out, flag
    assert "torchrun --nnodes 2 --nproc_per_node 4 --rdzv-backend c10d --rdzv-endpoint HOST:29500" in out


def test_abbreviated_run_flags_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    # the launcher's flags are taken out of the workers' command line by their full names
    code, _, err = run(capsys, "run", str(TINY_CPU), "--nnode", "2")
    assert code == 2 and "unrecognized arguments: --nnode" in err


# ---- checked before launch ----------------------------------------------------------------------


def test_e0201_at_launch_says_the_command(capsys: pytest.CaptureFixture[str], launched: list) -> None:
    code, _, err = run(capsys, "run", str(TINY_CPU))  # a world of one
    assert code == 2 and "error[E0201]: world = 1 does not split" in err
    assert (f"hint: start 4 process(es) per node: `ppdsl run {TINY_CPU} --nproc 4` or "
            f"`torchrun --nproc_per_node 4 -m ppdsl run {TINY_CPU}` (valid world sizes: multiples of 4 that divide 8: 4, 8)"
            ) in err
    code, _, err = run(capsys, "run", str(TINY_CPU), *PP2, "--nproc", "3")
    assert code == 2 and "error[E0201]: world = 3" in err
    assert f"`ppdsl run {TINY_CPU} --set mesh.tp=1 --nproc 2`" in err  # the --set flags stay in the command
    code, _, err = run(capsys, "run", str(TINY_CPU), "--nnodes", "2", "--nproc", "1")
    assert code == 2 and "error[E0201]: world = 2" in err
    assert f"`ppdsl run {TINY_CPU} --nnodes 2 --nproc 2 --rdzv-backend c10d --rdzv-endpoint HOST:PORT`" in err
    assert "`torchrun --nnodes 2 --nproc_per_node 2 --rdzv-backend c10d --rdzv-endpoint HOST:PORT -m ppdsl run" in err
    assert launched == []


def test_an_elastic_range_is_checked_for_every_world(capsys: pytest.CaptureFixture[str], launched: list,
                                                     tmp_path: Path) -> None:
    code, _, err = run(capsys, "run", str(TINY_CPU), "--nnodes", "1:3", "--nproc", "4", "--out", str(tmp_path / "o"))
    assert code == 2 and launched == []
    assert err.splitlines()[:6] == [  # E0330, through the renderer of diagnostics, a note per world refused
        "error[E0330]: --nnodes 1:3 x --nproc 4 can make world sizes 4, 8, 12; the spec does not hold for 1 of them",
        "   = hint: no --nproc makes every world of 1:3 node(s) valid (valid world sizes: multiples of 4 that divide "
        "8: 4, 8)",
        "",
        "note[E0302]: at 3 node(s) x 4 = world 12: global_batch = 8 does not split into dp = 3 replicas x 4 "
        "microbatches of 0.666667 samples",
        f"  --> {TINY_CPU}:35:3",
        "   |",
    ]
    code, _, err = run(capsys, "run", str(TINY_CPU), *PP2, "--nnodes", "1:2", "--nproc", "1", "--out", str(tmp_path / "o"))
    assert code == 2 and "note[E0201]: at 1 node(s) x 1 = world 1: world = 1 does not split" in err
    assert "hint: start 2 process(es) per node: `ppdsl run" in err and "--nnodes 1:2 --nproc 2" in err
    code, _, err = run(capsys, "run", str(TINY_CPU), "--nnodes", "1:2", "--nproc", "4", "--out", str(tmp_path / "o"),
                       "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1")
    assert code == 0, err
    assert launched[0][3][:3] == ["--nproc-per-node=4", "--nnodes=1:2", "--rdzv-backend=c10d"]


# ---- the run directory ------------------------------------------------------------------------------


def _earlier_run(out: Path) -> None:
    (out / "final").mkdir(parents=True)
    (out / "final" / EXPORT_MARKER).write_text("{}")
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    (out / "notes.txt").write_text("mine")


def test_the_run_directory_rule(tmp_path: Path) -> None:
    out = tmp_path / "out"
    claim_run_dir(out, resume=False, overwrite=False)  # absent: fine
    (out / "notes.txt").parent.mkdir()
    (out / "notes.txt").write_text("mine")
    claim_run_dir(out, resume=False, overwrite=False)  # a user's files are no earlier run
    shutil.rmtree(out)
    _earlier_run(out)
    assert earlier_run(out) == ["metrics.jsonl", "final/"]
    with pytest.raises(ValueError, match=r"already holds an earlier run \(metrics.jsonl, final/\); pass --resume"):
        claim_run_dir(out, resume=False, overwrite=False)
    claim_run_dir(out, resume=True, overwrite=False)
    claim_run_dir(out, resume=False, overwrite=True)
    assert clear_earlier_run(out) == ["metrics.jsonl", "final/"]
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]  # only what ppdsl wrote went
    (out / "final").mkdir()
    (out / "final" / "weights.bin").write_text("not ppdsl's")
    assert clear_earlier_run(out) == [] and (out / "final" / "weights.bin").is_file()


def test_run_refuses_an_earlier_run_before_launch(capsys: pytest.CaptureFixture[str], launched: list,
                                                  tmp_path: Path) -> None:
    out = tmp_path / "out"
    _earlier_run(out)
    before = sorted(str(p) for p in out.rglob("*"))
    code, _, err = run(capsys, "run", str(TINY_CPU), "--nproc", "4", "--out", str(out))
    assert code == 2 and launched == []
    assert err == (f"ppdsl run: run directory {out} already holds an earlier run (metrics.jsonl, final/); pass --resume "
                   "to continue it, --overwrite to replace what ppdsl wrote there, or choose another --out (nothing "
                   "was changed)\n")
    assert sorted(str(p) for p in out.rglob("*")) == before
    code, _, err = run(capsys, "run", str(TINY_CPU), "--nproc", "4", "--out", str(out), "--overwrite")
    assert code == 0, err
    assert launched[0][3][-3:] == ["--out", str(out), "--overwrite"]  # the workers' rank 0 replaces it
    code, _, err = run(capsys, "run", str(TINY_CPU), "--nproc", "4", "--out", str(out), "--overwrite", "--resume")
    assert code == 2 and "not allowed with argument" in err
    # an elastic job: a node that joins late would find the job's own files; rank 0 decides
    code, _, err = run(capsys, "run", str(TINY_CPU), "--nnodes", "1:2", "--nproc", "4", "--rdzv-backend", "c10d",
                       "--rdzv-endpoint", "h:1", "--out", str(out))
    assert code == 0 and len(launched) == 2, err


@pytest.mark.distributed
def test_under_plain_torchrun_every_rank_exits_2_on_an_earlier_run_and_overwrite_keeps_other_files(tmp_path: Path) -> None:
    spec = tiny_cpu_spec(tmp_path, "plain", steps=1, every=None)
    out = tmp_path / "out"
    _earlier_run(out)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                "-m", "ppdsl", "run", str(spec), *PP2, "--out", str(out)]
    proc = subprocess.run(torchrun, capture_output=True, text=True, timeout=240, env=env(), cwd=ROOT)
    assert proc.returncode != 0
    assert "ppdsl run (rank 0): run directory" in proc.stderr and "ppdsl run (rank 1): run directory" in proc.stderr
    assert "already holds an earlier run (metrics.jsonl, final/)" in proc.stderr
    assert "exitcode  : 2" in proc.stderr  # torchrun's summary of the first failed rank
    assert (out / "metrics.jsonl").read_text() == '{"step": 1}\n'
    # --overwrite: rank 0 replaces what the earlier run wrote, and nothing else
    proc = subprocess.run([*torchrun, "--overwrite"], capture_output=True, text=True, timeout=240, env=env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"--overwrite: removed the earlier run's metrics.jsonl, final/ from {out}" in proc.stdout
    assert f"run directory: {out}" in proc.stdout
    assert (out / "notes.txt").read_text() == "mine" and [s for s, _ in losses(out)] == [1]
    assert (out / "final" / EXPORT_MARKER).is_file() and (out / "final" / EXPORT_MARKER).read_text() != "{}"


# ---- two launchers on localhost == one node ----------------------------------------------------------


@pytest.mark.distributed
def test_two_launchers_on_localhost_give_the_single_node_losses(tmp_path: Path) -> None:
    spec = tiny_cpu_spec(tmp_path, "nodes", steps=2, every=None)
    one_node = tmp_path / "one"
    proc, _ = run_cmd(["run", str(spec), *PP2, "--nproc", "2", "--out", str(one_node)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    two_nodes = tmp_path / "two"
    rdzv = ["--nnodes", "2", "--nproc", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
            "--rdzv-id", "ppdsl-test"]
    cmd = [sys.executable, "-m", "ppdsl", "run", str(spec), *PP2, *rdzv, "--out", str(two_nodes)]
    nodes = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(), cwd=ROOT)
             for _ in range(2)]
    try:
        results = [p.communicate(timeout=240) for p in nodes]
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert [p.returncode for p in nodes] == [0, 0], [r[1][-2000:] for r in results]
    assert losses(two_nodes) == losses(one_node)  # bitwise: the floats compare exactly
    assert sum("on 2 cpu process(es)" in out for out, _ in results) == 1  # one global rank 0


# ---- small habits --------------------------------------------------------------------------------------


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    assert run(capsys, "--version") == (0, f"ppdsl {version('ppdsl')}\n", "")


def test_bash_completion_completes(tmp_path: Path) -> None:
    script = tmp_path / "ppdsl.bash"
    proc = subprocess.run([sys.executable, "-m", "ppdsl", "completion", "bash"], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert proc.returncode == 0 and proc.stderr == ""
    script.write_text(proc.stdout)
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash")
    probe = f"""source {script}
comp() {{ COMP_WORDS=("$@"); COMP_CWORD=$((${{#COMP_WORDS[@]}}-1)); _ppdsl; echo "${{COMPREPLY[*]}}"; }}
comp ppdsl ''
comp ppdsl ru
comp ppdsl run --nn
comp ppdsl run specs/tiny_c
comp ppdsl run x --nproc ''
comp ppdsl completion ''
comp ppdsl schedule --format ''
"""
    out = subprocess.run([bash, "-c", probe], capture_output=True, text=True, timeout=60, cwd=ROOT).stdout.splitlines()
    assert out == ["check plan schedule run export verify tune completion lsp -h --help --version", "run", "--nnodes",
                   "specs/tiny_cpu.ppspec", "", "bash zsh fish", "text json svg"]


@pytest.mark.parametrize("shell", ["zsh", "fish"])
def test_zsh_and_fish_completion(capsys: pytest.CaptureFixture[str], shell: str) -> None:
    code, out, err = run(capsys, "completion", shell)
    assert code == 0 and err == ""
    if shell == "zsh":
        assert out.startswith("#compdef ppdsl\n") and "bashcompinit" in out and "complete -F _ppdsl ppdsl" in out
    else:
        assert "complete -c ppdsl -n __fish_use_subcommand -a run" in out
        assert "complete -c ppdsl -n '__fish_seen_subcommand_from run' -l nnodes -x" in out
        assert "complete -c ppdsl -n '__fish_seen_subcommand_from completion' -a 'bash zsh fish'" in out
    exe = shutil.which(shell)
    if exe is not None:  # the script parses
        assert subprocess.run([exe, "-n", "-c", out] if shell == "zsh" else [exe, "--no-execute", "-c", out],
                              timeout=60).returncode == 0


def test_overwrite_removes_traces_plans_and_event_files_but_not_a_users_tensorboard_dir(tmp_path: Path) -> None:
    out = tmp_path / "out"
    _earlier_run(out)
    (out / "plan.json").write_text("{}")
    (out / "trace.json").write_text("{}")
    (out / "tensorboard").mkdir()
    (out / "tensorboard" / "events.out.tfevents.1.host").write_bytes(b"x")
    assert earlier_run(out) == ["metrics.jsonl", "plan.json", "trace.json", "tensorboard/", "final/"]
    assert clear_earlier_run(out) == ["metrics.jsonl", "plan.json", "trace.json", "tensorboard/", "final/"]
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    (out / "tensorboard").mkdir()
    (out / "tensorboard" / "my_notes.md").write_text("mine")
    assert clear_earlier_run(out) == [] and (out / "tensorboard" / "my_notes.md").is_file()


# ---- the plan is handed to the workers -----------------------------------------------------------


def test_the_launcher_hands_its_checked_plan_to_the_workers(capsys: pytest.CaptureFixture[str], launched: list,
                                                            tmp_path: Path) -> None:
    code, _, err = run(capsys, "run", str(TINY_CPU), "--nproc", "2", *PP2, "--out", str(tmp_path / "o"))
    assert code == 0, err
    (plan,) = launched.handed
    assert plan is not None and plan.mesh.world == 2 and (plan.mesh.pp, plan.mesh.tp) == (2, 1)
    launched.handed.clear()
    code, _, err = run(capsys, "run", str(TINY_CPU), "--nproc", "2", *PP2, "--out", str(tmp_path / "e"),
                       "--nnodes", "1:2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:29790")
    assert code == 0, err
    assert launched.handed == [None]  # an elastic range: each worker checks the world it gets


def test_a_worker_runs_the_launchers_plan_for_its_world_only(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import json

    from ppdsl.dsl.check import check_file
    from ppdsl.lowering.lower import lower
    from ppdsl.runtime.run.launch import PLAN_ENV, launched_plan

    result = check_file(str(TINY_CPU), world=2, overrides=["mesh.tp=1"], model=False)
    plan = lower(result.spec, 2, None) if result.ok else None
    assert plan is not None
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan.to_json()))
    monkeypatch.delenv(PLAN_ENV, raising=False)
    assert launched_plan(2) is None  # plain torchrun: no launcher, each rank checks
    monkeypatch.setenv(PLAN_ENV, str(path))
    assert launched_plan(2) == plan
    assert launched_plan(4) is None  # another world than the launcher checked: check again
    monkeypatch.setenv(PLAN_ENV, str(tmp_path / "absent.json"))
    assert launched_plan(2) is None
