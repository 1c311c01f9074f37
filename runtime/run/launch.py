"""Start the workers of a plan.

``launch`` hands ``python -m ppdsl run SPEC ...`` to torchrun's own launcher: local rendezvous
(``--standalone``) unless torchrun's node and rendezvous options are given (``LAUNCHER_OPTIONS``,
passed through as they are); each worker, seeing torchrun's RANK / WORLD_SIZE / LOCAL_RANK,
lowers the spec for that world (or runs the plan the launcher checked, ``launched_plan``) and
calls ``run_worker``. The workers themselves are `runtime.run.worker`.
"""

from __future__ import annotations

import json
import signal
import tempfile
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from ppdsl.lowering.plan import Plan

from ppdsl.runtime.run.failure import EXIT_FAIL, EXIT_INVALID, EXIT_OK
from ppdsl.runtime.run.torchrun_options import LAUNCHER_OPTIONS, NPROC, is_standalone

PLAN_ENV = "PPDSL_PLAN"  # the launcher's checked plan (a JSON file) for its workers


def torchrun_args(spec_path: str, argv: Sequence[str], nproc: int, max_restarts: int = 0,
                  options: Mapping[str, str] | None = None) -> list[str]:
    """torchrun's arguments for `nproc` workers per node running ``python -m ppdsl <argv>``.
    `argv` is the ``ppdsl`` command line (starting with ``run``; the launcher's options are
    dropped from it). `options`: the other launcher options given, by torchrun's spelling."""
    options = dict(options or {})
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    if max_restarts < 0:
        raise ValueError(f"--max-restarts must be >= 0, got {max_restarts}")
    if max_restarts:
        options["--max-restarts"] = str(max_restarts)
    args = _without_launcher_flags(list(argv))
    if not args or args[0] != "run":
        args = ["run", spec_path, *args]
    standalone = ["--standalone"] if is_standalone(options) else []
    passed = [f"{o.flag}={options[o.flag]}" for o in LAUNCHER_OPTIONS if o.flag in options]
    if standalone:
        passed = [a for a in passed if not a.startswith("--nnodes=")]
    return [*standalone, f"--nproc-per-node={nproc}", *passed, "--module", "ppdsl", *args]


_LAUNCHER_FLAGS = tuple(n for o in (NPROC, *LAUNCHER_OPTIONS) for n in o.names)


def _without_launcher_flags(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in _LAUNCHER_FLAGS:
            skip = True
        elif not any(a.startswith(f + "=") for f in _LAUNCHER_FLAGS):
            out.append(a)
    return out



def launch(spec_path: str, argv: Sequence[str], nproc: int, max_restarts: int = 0,
           options: Mapping[str, str] | None = None, plan: Plan | None = None) -> int:
    """Start `nproc` workers through torchrun's launcher and wait for them. Returns 0, the
    first failing worker's exit code (2 when a worker rejected the plan, else 1), or 128 + the
    signal when the launcher itself was stopped (SIGTERM: the workers save a final checkpoint
    first, within torchrun's 30 s shutdown grace).

    `plan`: the plan the launcher checked, for a launch whose world size is fixed. The workers
    get it as JSON (``PPDSL_PLAN``) and run it as it is: they neither check the spec again nor
    lower it. Without it (an elastic range) each worker checks at the world it finds."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    ns = get_args_parser().parse_args(torchrun_args(spec_path, argv, nproc, max_restarts, options))
    with tempfile.TemporaryDirectory(prefix="ppdsl-status-") as status_dir:
        os.environ["PPDSL_STATUS_DIR"] = status_dir  # the workers inherit it
        if plan is not None:
            plan_file = Path(status_dir) / "plan.json"
            plan_file.write_text(json.dumps(plan.to_json()), encoding="utf-8")
            os.environ[PLAN_ENV] = str(plan_file)
        try:
            run(ns)
        except ChildFailedError as exc:
            report = _failure_report(exc, nproc, status_dir)
            if report:
                print(report, file=sys.stderr)
            codes = sorted({f.exitcode for f in exc.failures.values()})
            own = [c for c in codes if c > 0]  # negative: a signal, e.g. torchrun stopping the rest
            return EXIT_INVALID if own == [EXIT_INVALID] else EXIT_FAIL
        except SignalException as exc:
            print(f"ppdsl run: stopped by {signal.Signals(exc.sigval).name}; the workers were asked to save a "
                  "checkpoint and stop", file=sys.stderr)
            return 128 + int(exc.sigval)
        finally:
            os.environ.pop("PPDSL_STATUS_DIR", None)
            os.environ.pop(PLAN_ENV, None)
    return EXIT_OK


def launched_plan(world: int) -> Plan | None:
    """In a worker: the plan the launcher checked (`launch(..., plan=)`), when it is for this
    world size; None under a plain torchrun, or when the world differs (check again then)."""
    path = os.environ.get(PLAN_ENV)
    if not path:
        return None
    try:
        plan = Plan.from_json(json.loads(Path(path).read_text(encoding="utf-8")))
    except OSError:  # a node whose launcher wrote none (another node's environment)
        return None
    return plan if plan.mesh.world == world else None


def _failure_report(exc: object, nproc: int, status_dir: str) -> str:
    """Name the failed ranks and their steps: killed ones (a signal) first, they are the cause.
    When the hang watchdog named a rank (runtime.run.watchdog), that rank is the cause."""
    from ppdsl.runtime.run.failure import AGREED_STOP, read_status
    from ppdsl.runtime.run.watchdog import read_verdict

    hung = read_verdict(status_dir)

    def order(kv: tuple[int, object]) -> tuple[int, int]:
        code = kv[1].exitcode  # type: ignore[attr-defined]
        if hung is not None:
            return (0 if kv[0] == hung.rank else 1, kv[0])
        # the cause first: killed by a signal torchrun does not send, then an error, then
        # the ranks torchrun stopped (SIGTERM) once it saw the failure
        return (0 if code < 0 and code != -signal.SIGTERM else 1 if code > 0 else 2, kv[0])

    failures = sorted(exc.failures.items(), key=order)  # type: ignore[attr-defined]
    if all((read_status(status_dir, r) or (0, ""))[1] == AGREED_STOP for r, _ in failures):
        return ""  # the ranks stopped together (an agreed RunFault): rank 0's line said why
    lines = [f"ppdsl run: {len(failures)} of {nproc} worker(s) failed; the first listed is the cause"]
    if hung is not None:
        how = "its heartbeat stopped" if hung.reason == "heartbeat" else "alive, no progress"
        lines = [f"ppdsl run: {len(failures)} of {nproc} worker(s) failed; the cause: rank {hung.rank} hung ({how} "
                 f"at step {hung.step}, in {hung.doing}); the hang watchdog killed it and ended the others"]
    for rank, f in failures:
        st = read_status(status_dir, rank)
        where = "before its first step" if st is None or st[0] == 0 else (
            f"during step {st[0]}" if st[1] == "step" else f"while saving checkpoint step {st[0]}"
            if st[1] == "save" else f"after step {st[0]}")
        if f.exitcode < 0:
            try:
                sig = signal.Signals(-f.exitcode).name
            except ValueError:
                sig = f"signal {-f.exitcode}"
            by = " (stopped by the launcher)" if f.exitcode == -signal.SIGTERM else (
                " (a memory-mapped file it read, such as a tokens(...) data file, was probably truncated)"
                if f.exitcode == -signal.SIGBUS else "")
            if hung is not None and rank == hung.rank:
                by = " (by the hang watchdog)"
            lines.append(f"  rank {rank} was killed by {sig} {where}{by} (pid {f.pid})")
        else:
            lines.append(f"  rank {rank} exited with code {f.exitcode} {where}")
    return "\n".join(lines)
