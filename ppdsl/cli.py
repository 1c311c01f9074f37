"""The `ppdsl` command: check, plan, schedule, run, verify.

Exit codes: 0 valid / success, 1 runtime or internal failure, 2 invalid spec or usage.
Heavy imports (the checker, torch in the runtime) happen inside the commands; `check --no-model`
imports neither torch nor sympy.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

from .completion import SHELLS

if TYPE_CHECKING:
    from ppdsl.dsl.rules import Launch

EXIT_OK, EXIT_FAIL, EXIT_INVALID = 0, 1, 2


@contextlib.contextmanager
def _loading() -> Iterator[None]:
    """Around the first import of the checker (lark, attrs and their classes: objects that live
    until exit). The cyclic GC would walk them over and over while they load, and once more at
    exit; pause it while they load, then set them aside with gc.freeze (what it is for). A cold
    `ppdsl check --no-model` executes about 5% fewer instructions; nothing else changes."""
    if "ppdsl.dsl.check" in sys.modules:  # already loaded (ppdsl.cli.main called in-process again)
        yield
        return
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ppdsl", description="Declarative model parallelism for PyTorch.")
    p.add_argument("--version", action=_VersionAction)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def common(sp: argparse.ArgumentParser, many: bool = False) -> None:
        _path(sp.add_argument("spec", nargs="+" if many else None, help=".ppspec file" + ("s" if many else "")), "spec")
        sp.add_argument("--set", dest="overrides", action="append", default=[], metavar="BLOCK.KEY=VALUE",
                        help="override a key of the spec, e.g. --set mesh.tp=4 (repeatable)")

    c = sub.add_parser("check", help="prove a spec consistent before launch")
    common(c, many=True)
    c.add_argument("--world", type=int, help="check for this world size (default: report which sizes work)")
    c.add_argument("--device-memory", metavar="SIZE",
                   help="memory of one accelerator (80GiB, 141GB): prove every rank fits it (= train.device_memory)")
    c.add_argument("--format", choices=("text", "json"), default="text")
    c.add_argument("--no-model", action="store_true",
                   help="skip model-level checks: run no code of the spec, read no file outside its directory")
    c.add_argument("--allow-path", dest="allow_paths", action="append", default=[], metavar="DIR",
                   help="with --no-model: let check read files under DIR too (repeatable)")

    pl = sub.add_parser("plan", help="show the plan: ranks, stages, layers, memory, communication")
    common(pl)
    pl.add_argument("--world", type=int, required=True)
    pl.add_argument("--format", choices=("text", "json"), default="text")
    pl.add_argument("--no-model", action="store_true", help="do not build the model on the meta device")
    pl.add_argument("--allow-path", dest="allow_paths", action="append", default=[], metavar="DIR",
                    help="with --no-model: let check read files under DIR too (repeatable)")

    s = sub.add_parser("schedule", help="draw a pipeline schedule")
    _path(s.add_argument("spec", nargs="?", help=".ppspec file (or give --style/--pp/--microbatches)"), "spec")
    s.add_argument("--set", dest="overrides", action="append", default=[], metavar="BLOCK.KEY=VALUE")
    s.add_argument("--world", type=int)
    s.add_argument("--style")
    s.add_argument("--pp", type=int)
    s.add_argument("--microbatches", type=int)
    s.add_argument("--chunks", type=int)
    s.add_argument("--no-model", action="store_true",
                   help="with a spec: check it without building the model on the meta device")
    s.add_argument("--format", choices=("text", "json", "svg"), default="text")
    _path(s.add_argument("-o", "--output", help="write to this file instead of standard output"), "file")

    s.add_argument("--measured", metavar="RUN_DIR",
                   help="draw a traced run's measured step (RUN_DIR/trace.json) beside its planned schedule")
    s.add_argument("--step", type=int, help="with --measured: the step to draw (default: the last traced one)")

    _add_run_parser(sub, common)

    e = sub.add_parser("export", help="publish a run's trained model as an ordinary HF directory")
    _path(e.add_argument("run_dir", help="the run directory (`ppdsl run --out`, default runs/<spec name>)"), "dir")
    _path(e.add_argument("out_dir", help="where to write the model (created; must not exist or be empty)"), "dir")
    e.add_argument("--force", action="store_true", help="replace OUT_DIR if it holds files")

    v = sub.add_parser("verify", help="prove the parallel run equals one process (CPU, gloo)")
    common(v)
    v.add_argument("--world", type=int, required=True)
    v.add_argument("--steps", type=int, default=2)
    v.add_argument("--keep-dropout", action="store_true",
                   help="compare with the model's dropout on (by default both runs switch it off: their masks differ)")

    tu = sub.add_parser("tune", help="rank the valid layouts for a world on measured costs; write the best")
    common(tu)
    tu.add_argument("--world", type=int, required=True)
    tu.add_argument("--memory", type=float, metavar="GIB", help="drop layouts whose largest rank needs more")
    tu.add_argument("--measure", type=int, default=0, metavar="K", help="run the top K for a few steps each")
    tu.add_argument("--steps", type=int, default=6, help="with --measure: steps timed per layout (after 2 warm-up)")
    tu.add_argument("--rounds", type=int, default=1, help="with --measure: run the K layouts this many times, in turn")
    tu.add_argument("--no-calibrate", action="store_true",
                    help="skip the traced calibration run (without one in the profile: world / cores on CPU)")
    tu.add_argument("--top", type=int, default=10, help="rows of the ranked table")
    _path(tu.add_argument("--profile", help="cost profile JSON: read it if it exists, else measure and write it "
                                            "(default runs/<spec name>/profile.json)"), "file")
    _path(tu.add_argument("-o", "--output", metavar="BEST.ppspec", help="write the best layout as a spec"), "file")

    co = sub.add_parser("completion", help="print a shell completion script: ppdsl completion bash|zsh|fish")
    co.add_argument("shell", choices=SHELLS)
    ls = sub.add_parser("lsp", help="the editor server: diagnostics, hover, completion over LSP on stdin/stdout")
    ls.add_argument("--stdio", action="store_true", help="accepted for editors that pass it; stdio is the only transport")
    return p


class _VersionAction(argparse.Action):
    """`ppdsl --version`: the installed package's version (looked up only when asked)."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help="print the version and exit")

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        from importlib.metadata import PackageNotFoundError, version

        try:
            found = version("ppdsl")
        except PackageNotFoundError:
            found = "unknown (not installed)"
        print(f"ppdsl {found}")
        parser.exit()


def _path(action: argparse.Action, kind: str) -> argparse.Action:
    """Tell shell completion what an argument names: "spec", "file" or "dir"."""
    action.complete_kind = kind  # type: ignore[attr-defined]
    return action


RUN_USAGE = """\
one node:
  ppdsl run SPEC --nproc 4
  torchrun --nproc_per_node 4 -m ppdsl run SPEC                  (the same, started by torchrun)
several nodes (the same command on every node):
  ppdsl run SPEC --nnodes 2 --nproc 4 --rdzv-backend c10d --rdzv-endpoint HOST:29500 --rdzv-id JOB
  torchrun --nnodes 2 --nproc_per_node 4 --rdzv-backend c10d --rdzv-endpoint HOST:29500 --rdzv-id JOB -m ppdsl run SPEC
  elastic: --nnodes MIN:MAX (every world size in the range must fit the spec; checked before launch)

The run directory (--out) must not hold an earlier run's metrics.jsonl or final/: pass --resume
to continue it or --overwrite to replace what ppdsl wrote there (nothing else is touched)."""


def _add_run_parser(sub: argparse._SubParsersAction, common: Callable[[argparse.ArgumentParser], None]) -> None:
    from ppdsl.runtime.run.torchrun_options import LAUNCHER_OPTIONS, NPROC

    # no abbreviations: the launcher's flags are taken out of the workers' command line by name
    r = sub.add_parser("run", help="train a spec (under torchrun, or started through torchrun's launcher)",
                       allow_abbrev=False, epilog=RUN_USAGE, formatter_class=argparse.RawDescriptionHelpFormatter)
    common(r)
    _path(r.add_argument("--out", default=None, help="run directory (metrics.jsonl, final/); default runs/<spec name>"),
          "dir")
    earlier = r.add_mutually_exclusive_group()
    earlier.add_argument("--resume", action="store_true",
                         help="continue from the newest complete checkpoint in train.checkpoint.dir (fresh start if "
                              "none), and the run directory's metrics")
    earlier.add_argument("--overwrite", action="store_true",
                         help="replace an earlier run's metrics.jsonl and final/ in the run directory")
    r.add_argument("--trace", action="store_true",
                   help="record every rank's actions per step into RUN_DIR/trace.json (= --set train.trace=true)")
    r.add_argument("--memory-trace", action="store_true",
                   help="measure each rank's peak of live tensor bytes over the run (CUDA: max_memory_allocated) "
                        "and print it against the plan's prediction; written to RUN_DIR/memory.json")
    r.add_argument("--memory-trace-steps", type=int, default=0, metavar="N",
                   help="with --memory-trace: count the first N steps only (the rest run at full speed; default all)")
    launcher = r.add_argument_group(
        "launcher", "torchrun's options, same spelling (underscore forms too); given without torchrun, ppdsl starts "
                    "the workers through torchrun's own launcher (one node: --standalone)")
    launcher.add_argument(*NPROC.names, dest=NPROC.dest, type=NPROC.type, metavar=NPROC.metavar, help=NPROC.help)
    for o in LAUNCHER_OPTIONS:
        _path(launcher.add_argument(*o.names, dest=o.dest, type=o.type, metavar=o.metavar, help=o.help),
              "dir" if o.flag == "--log-dir" else "")


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return {"check": cmd_check, "plan": cmd_plan, "schedule": cmd_schedule, "run": cmd_run,
                "export": cmd_export, "verify": cmd_verify, "completion": cmd_completion,
                "lsp": cmd_lsp, "tune": cmd_tune}[args.command](args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `ppdsl ... | head`: the reader left; nothing more to say, and nobody to say it to
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return EXIT_FAIL
    except Exception as exc:  # the last line of defence: never a traceback for the user
        if os.environ.get("PPDSL_DEBUG"):
            raise
        print(f"ppdsl: internal error: {type(exc).__name__}: {exc}\n"
              "  (set PPDSL_DEBUG=1 for the traceback, and please report it)", file=sys.stderr)
        return EXIT_FAIL


def _print_diags(results: list) -> None:
    """Render each result's diagnostics (errors, warnings, notes) on stderr."""
    from ppdsl.dsl.render import render_text

    color = sys.stderr.isatty() and not os.environ.get("NO_COLOR")
    for r in results:
        if r.diagnostics:
            print(render_text(r.diagnostics, {r.file: r.text}, color), file=sys.stderr)


def cmd_check(args: argparse.Namespace) -> int:
    with _loading():
        from ppdsl.dsl.render import to_json
        from ppdsl.lowering.fit import check_and_fit  # check_file, then the memory proof

    results = [check_and_fit(path, world=args.world, overrides=args.overrides, model=not args.no_model,
                             allow_paths=args.allow_paths, device_memory=args.device_memory) for path in args.spec]
    if args.format == "json":
        out = [{"file": r.file, "ok": r.ok, "world": r.world, "valid_worlds": r.worlds,
                "valid_world_sizes": None if r.valid_worlds is None else list(r.valid_worlds),
                "diagnostics": [to_json(d) for d in r.diagnostics]} for r in results]
        print(json.dumps(out if len(out) > 1 else out[0], indent=2))
    else:
        _print_diags(results)
        for r in results:
            if not r.ok:
                n = sum(d.is_error for d in r.diagnostics)
                print(f"{r.file}: {n} error{'s' if n != 1 else ''}", file=sys.stderr)
            elif r.world is not None:
                print(f"{r.file}: ok for world = {r.world}")
            else:
                print(f"{r.file}: ok for {r.worlds}")
    return EXIT_OK if all(r.ok for r in results) else EXIT_INVALID


def _checked_plan(path: str, overrides: list[str], world: int, model: bool, launch: Launch | None = None,
                  runnable: bool = False, allow_paths: Sequence[str] = (), fit: bool = True):
    """check + lower. Prints the diagnostics; returns (plan, check result), plan None if invalid
    or (``runnable``: for run, verify, plan) if no model family runs the model's class.
    `launch`: how `ppdsl run` starts the world, for the hints that say the command (E0201).
    `fit`: with check's memory proof (train.device_memory, W0440); `plan` shows the figures instead."""
    with _loading():
        from ppdsl.dsl.check import check_file
        from ppdsl.dsl.plan_needs import plan_needs
        from ppdsl.lowering.fit import check_and_fit
        from ppdsl.lowering.lower import lower

    result = (check_and_fit if fit else check_file)(path, world=world, overrides=overrides, model=model,
                                                    allow_paths=allow_paths, launch=launch)
    if result.ok:  # what the plan needs beyond a valid spec (E0429), said by check as any diagnostic
        needs = plan_needs(result.spec, result.model_info, runnable)
        if needs:
            import attrs

            result = attrs.evolve(result, diagnostics=(*result.diagnostics, *needs))
    _print_diags([result])
    if not result.ok:
        return None, result
    return lower(result.spec, world, result.model_info), result


def cmd_plan(args: argparse.Namespace) -> int:
    from .views.report import plan_report

    plan, result = _checked_plan(args.spec, args.overrides, args.world, not args.no_model, runnable=True,
                                 allow_paths=args.allow_paths, fit=False)
    if plan is None:
        return EXIT_INVALID
    hidden = result.spec.model.dims.get("hidden") if result.spec is not None and result.spec.model else None
    report = plan_report(plan, result.model_info, hidden)
    print(json.dumps(report.to_json(), indent=2) if args.format == "json" else report.render())
    return EXIT_OK


def cmd_schedule(args: argparse.Namespace) -> int:
    from .views.schedule_render import render_svg, render_text, to_json
    from ppdsl.core.schedules import STYLES, generate
    from ppdsl.core.schedules.simulate import simulate

    if args.measured:
        return _measured_schedule(args)
    predicted = None  # with pipeline.profile: what the measured profile predicts
    if args.spec:
        if args.world is None:
            print("ppdsl schedule: with a spec, give --world N", file=sys.stderr)
            return EXIT_INVALID
        plan, _ = _checked_plan(args.spec, args.overrides, args.world, not args.no_model, fit=False)
        if plan is None:
            return EXIT_INVALID
        schedule, predicted = plan.schedule, plan.predicted
    else:
        if args.style is None or args.pp is None or args.microbatches is None:
            print("ppdsl schedule: give a spec, or --style, --pp and --microbatches", file=sys.stderr)
            return EXIT_INVALID
        try:
            default_chunks = 1 if args.style not in STYLES or STYLES[args.style].chunks == "== 1" else 2
            schedule = generate(args.style, args.pp, args.microbatches, args.chunks or default_chunks)
        except ValueError as exc:  # style_problem's words, as a diagnostic of the command line (E0005)
            from ppdsl.dsl.command_line import bad_input
            from ppdsl.dsl.render import render_text

            color = sys.stderr.isatty() and not os.environ.get("NO_COLOR")
            print(render_text([bad_input(str(exc))], {}, color), file=sys.stderr)
            return EXIT_INVALID
    sim = simulate(schedule)
    text = {"text": lambda: render_text(schedule, sim), "svg": lambda: render_svg(schedule, sim),
            "json": lambda: json.dumps(to_json(schedule, sim) | (
                {} if predicted is None else {"predicted": predicted.to_json()}), indent=2)}[args.format]()
    if predicted is not None and args.format == "text":
        text = text.rstrip("\n") + "\n" + "\n".join(predicted.lines()) + "\n"
    _write(text, args.output)
    return EXIT_OK


def _measured_schedule(args: argparse.Namespace) -> int:
    from ppdsl.lowering.plan import Plan
    from .views.trace import default_step, render_measured

    run_dir = args.measured
    try:
        with open(os.path.join(run_dir, "plan.json"), encoding="utf-8") as f:
            schedule = Plan.from_json(json.load(f)).schedule
        with open(os.path.join(run_dir, "trace.json"), encoding="utf-8") as f:
            trace = json.load(f)
        text = render_measured(schedule, trace, default_step(trace) if args.step is None else args.step, args.format)
    except (OSError, ValueError) as exc:  # json.JSONDecodeError is a ValueError
        print(f"ppdsl schedule --measured: {exc}\n  (a run writes trace.json with `ppdsl run --trace`)", file=sys.stderr)
        return EXIT_INVALID
    _write(text, args.output)
    return EXIT_OK


def _write(text: str, output: str | None) -> None:
    if output:
        with open(output, "w", encoding="utf-8") as f:
            f.write(text)
        print(f"wrote {output}")
    else:
        print(text)


def cmd_run(args: argparse.Namespace) -> int:
    if "RANK" in os.environ:  # a worker: it must not outlive its launcher (torchrun's, or ppdsl run's)
        from ppdsl.runtime.run.lifetime import die_with_parent

        die_with_parent()
    out = args.out or os.path.join("runs", os.path.splitext(os.path.basename(args.spec))[0])
    if args.trace and "train.trace=true" not in args.overrides:
        args.overrides.append("train.trace=true")
    options = _launcher_options(args)
    if "RANK" not in os.environ and (args.nproc is not None or options):
        return _launch_run(args, out, options)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    from ppdsl.runtime.run.launch import launched_plan
    from ppdsl.runtime.run.worker import run_worker

    plan = launched_plan(world)  # started by `ppdsl run`: the plan it checked, run as it is
    if plan is None:  # a plain torchrun (or a world the launcher did not check): each rank checks
        plan, _ = _checked_plan(args.spec, args.overrides, world, True, launch=_launch_of(args, (1, 1)), runnable=True)
    if plan is None:
        return EXIT_INVALID

    return run_worker(plan, out, resume=args.resume, overwrite=args.overwrite, memory_trace=args.memory_trace,
                      memory_trace_steps=args.memory_trace_steps)


def _launcher_options(args: argparse.Namespace) -> dict[str, str]:
    """The launcher options given (besides --nproc), by torchrun's spelling."""
    from ppdsl.runtime.run.torchrun_options import LAUNCHER_OPTIONS

    return {o.flag: str(getattr(args, o.dest)) for o in LAUNCHER_OPTIONS if getattr(args, o.dest) is not None}


def _launch_run(args: argparse.Namespace, out: str, options: dict[str, str]) -> int:
    """Check every world size the launch can make, refuse what the workers would refuse, then
    start the workers through torchrun's launcher."""
    from ppdsl.runtime.run.torchrun_options import parse_nnodes

    nproc = 1 if args.nproc is None else args.nproc
    max_restarts = int(options.pop("--max-restarts", "0"))
    try:
        if nproc < 1:
            raise ValueError(f"--nproc must be >= 1, got {nproc}")
        if max_restarts < 0:
            raise ValueError(f"--max-restarts must be >= 0, got {max_restarts}")
        nodes = parse_nnodes(options.get("--nnodes", "1"))
    except ValueError as exc:
        print(f"ppdsl run: {exc}", file=sys.stderr)
        return EXIT_INVALID
    from ppdsl.runtime.run.lock import refuse_if_busy

    try:
        if nodes == (1, 1):
            refuse_if_busy(out)  # a live run there: say so now, not after checking the spec
    except ValueError as exc:
        print(f"ppdsl run: {exc}", file=sys.stderr)
        return EXIT_INVALID
    plan = _plan_for_launch(args, nodes, nproc)
    if plan is None:
        return EXIT_INVALID
    from ppdsl.runtime.checkpoint.store import resume_decision
    from ppdsl.runtime.run.launch import launch
    from ppdsl.runtime.run.worker import preflight
    from ppdsl.runtime.run.lifetime import launcher_env
    from ppdsl.runtime.run.lock import RunLock, held_for_workers, lock_run
    from ppdsl.runtime.run.rundir import claim_run_dir

    lock = RunLock([], [])  # several nodes: global rank 0 takes it (one of the launchers cannot know which)
    try:  # what the workers would refuse is refused before any of them starts
        if nodes == (1, 1):  # the one writer, for the job's whole life
            lock = lock_run(out, None if plan.train.checkpoint is None else plan.train.checkpoint.dir)
            for note in lock.notes:
                print(note, file=sys.stderr)
        preflight(plan, out, "cuda" if _cuda_available() else "cpu")
        if nodes[0] == nodes[1]:  # a node joining an elastic job late finds the job's own files: rank 0 decides
            resume_decision(plan, args.resume)
            claim_run_dir(out, resume=args.resume, overwrite=args.overwrite)
    except ValueError as exc:
        lock.release()
        print(f"ppdsl run: {exc}", file=sys.stderr)
        return EXIT_INVALID
    argv = sys.argv[1:] if sys.argv[1:2] == ["run"] else ["run", args.spec, *_run_flags(args)]
    fixed_world = nodes[0] == nodes[1]  # an elastic range: the workers check the world they get
    with held_for_workers(lock), launcher_env():
        return launch(args.spec, argv, nproc, max_restarts, options, plan=plan if fixed_world else None)


def _plan_for_launch(args: argparse.Namespace, nodes: tuple[int, int], nproc: int):
    """The plan at the smallest world the launch can make, once the spec holds for every world
    of nodes x nproc (an elastic --nnodes MIN:MAX makes several). None (reported) if not."""
    worlds = [n * nproc for n in range(nodes[0], nodes[1] + 1)]
    launch = _launch_of(args, nodes)
    if len(worlds) == 1:
        plan, _ = _checked_plan(args.spec, args.overrides, worlds[0], True, launch=launch, runnable=True)
        return plan
    with _loading():
        from ppdsl.dsl.render import render_text
        from ppdsl.dsl.world_set import WorldSet, check_world_set

    result = check_world_set(args.spec, args.overrides, WorldSet(nodes, nproc))  # E0330, E0331
    if not result.ok:
        color = sys.stderr.isatty() and not os.environ.get("NO_COLOR")
        print(render_text(result.diagnostics, result.sources, color), file=sys.stderr)
        return None
    plan, _ = _checked_plan(args.spec, args.overrides, worlds[0], True, launch=launch, runnable=True)  # the model-level checks too
    return plan


def _launch_of(args: argparse.Namespace, nodes: tuple[int, int]) -> Launch:
    """How this `ppdsl run` starts its world, which the checker's hints then spell out as a command."""
    with _loading():
        from ppdsl.dsl.rules import Launch

    return Launch(args.spec, tuple(args.overrides), nodes)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _run_flags(args: argparse.Namespace) -> list[str]:
    """The worker's flags when `main` was called in-process with its own argv."""
    out = [a for o in args.overrides for a in ("--set", o)]
    if args.out:
        out += ["--out", args.out]
    if args.resume:
        out.append("--resume")
    if args.overwrite:
        out.append("--overwrite")
    if args.memory_trace:
        out.append("--memory-trace")
    if args.memory_trace_steps:
        out += ["--memory-trace-steps", str(args.memory_trace_steps)]
    return out


def cmd_completion(args: argparse.Namespace) -> int:
    from .completion import generate

    print(generate(_parser(), args.shell), end="")
    return EXIT_OK


def cmd_export(args: argparse.Namespace) -> int:
    from ppdsl.runtime.export.publish import cli_export

    return cli_export(args.run_dir, args.out_dir, force=args.force)


def cmd_verify(args: argparse.Namespace) -> int:
    plan, result = _checked_plan(args.spec, args.overrides, args.world, True, runnable=True)
    if plan is None:
        return EXIT_INVALID
    from ppdsl.runtime.run.failure import RankFailures
    from ppdsl.runtime.verify.world import verify
    from ppdsl.runtime.verify.randomness import without_randomness

    plan, notes = without_randomness(plan, _full_config(plan, result.model_info), keep=args.keep_dropout)
    try:
        report = verify(plan, args.steps, notes=notes, fp64_plan=lambda: _fp64_plan(args),
                        progress=lambda line: print(line, file=sys.stderr, flush=True))
    except RankFailures as exc:
        print("\n".join(exc.lines), file=sys.stderr)
        return EXIT_FAIL
    print(report.render())
    return EXIT_OK if report.ok else EXIT_FAIL


def _fp64_plan(args: argparse.Namespace):
    """The plan `ppdsl verify` compares again in float64 when fp32 drifts after step 1: the spec
    as `--set train.precision=fp64` checks and lowers it (an HF model built with the kernels
    float64 needs), dropout as in the fp32 comparison. None if it does not check."""
    from ppdsl.dsl.check import check_file
    from ppdsl.lowering.lower import lower
    from ppdsl.runtime.verify.randomness import without_randomness

    result = check_file(args.spec, world=args.world, overrides=[*args.overrides, "train.precision=fp64"], model=True)
    if not result.ok:
        return None
    plan = lower(result.spec, args.world, result.model_info)
    return without_randomness(plan, _full_config(plan, result.model_info), keep=args.keep_dropout)[0]


def cmd_tune(args: argparse.Namespace) -> int:
    with _loading():
        from ppdsl.dsl.check import check_file
        from .tune import main as tune_main

    result = check_file(args.spec, overrides=args.overrides, model=False)  # the layout is tune's to choose
    _print_diags([result])
    if not result.ok:
        return EXIT_INVALID
    return tune_main(args)


def cmd_lsp(args: argparse.Namespace) -> int:
    try:
        from .lsp.server import serve
    except ImportError as exc:  # pygls is the optional extra `lsp`
        print(f"ppdsl lsp needs pygls ({exc}): pip install 'ppdsl[lsp]'", file=sys.stderr)
        return EXIT_FAIL
    return serve()


def _full_config(plan, info) -> dict:
    """The model's whole config: the HF config as built, or a python factory's keyword defaults."""
    if plan.model.kind == "python":
        from ppdsl.core.build import factory_defaults

        return factory_defaults(plan.model.target)
    return dict(info.config) if info is not None else {}
