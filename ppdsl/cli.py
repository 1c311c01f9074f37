"""The `ppdsl` command: check, plan, schedule, run, verify.

Exit codes: 0 valid / success, 1 runtime or internal failure, 2 invalid spec or usage.
Heavy imports (sympy via the checker, torch in the runtime) happen inside the commands.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
from typing import Iterator, Sequence

EXIT_OK, EXIT_FAIL, EXIT_INVALID = 0, 1, 2


@contextlib.contextmanager
def _loading() -> Iterator[None]:
    """Around the first import of the checker: sympy alone is ~600 modules and a few hundred
    thousand objects that live until exit. The cyclic GC would walk them over and over while they
    load, and once more at exit; pause it while they load, then set them aside with gc.freeze (what
    it is for). A cold `ppdsl check` spends about a third less CPU; nothing else changes."""
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
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def common(sp: argparse.ArgumentParser, many: bool = False) -> None:
        sp.add_argument("spec", nargs="+" if many else None, help=".ppspec file" + ("s" if many else ""))
        sp.add_argument("--set", dest="overrides", action="append", default=[], metavar="BLOCK.KEY=VALUE",
                        help="override a key of the spec, e.g. --set mesh.tp=4 (repeatable)")

    c = sub.add_parser("check", help="prove a spec consistent before launch")
    common(c, many=True)
    c.add_argument("--world", type=int, help="check for this world size (default: report which sizes work)")
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
    s.add_argument("spec", nargs="?", help=".ppspec file (or give --style/--pp/--microbatches)")
    s.add_argument("--set", dest="overrides", action="append", default=[], metavar="BLOCK.KEY=VALUE")
    s.add_argument("--world", type=int)
    s.add_argument("--style")
    s.add_argument("--pp", type=int)
    s.add_argument("--microbatches", type=int)
    s.add_argument("--chunks", type=int)
    s.add_argument("--format", choices=("text", "json", "svg"), default="text")
    s.add_argument("-o", "--output", help="write to this file instead of standard output")

    r = sub.add_parser("run", help="train a spec (under torchrun, or with --nproc)")
    common(r)
    r.add_argument("--nproc", type=int, help="start this many local processes through torchrun's launcher")
    r.add_argument("--out", default=None, help="run directory (metrics.jsonl); default runs/<spec name>")
    r.add_argument("--resume", action="store_true",
                   help="continue from the newest complete checkpoint in train.checkpoint.dir (fresh start if none)")
    r.add_argument("--max-restarts", type=int, default=0, metavar="N",
                   help="with --nproc: restart the workers up to N times after a failure; a restarted job "
                        "resumes from the newest complete checkpoint")

    e = sub.add_parser("export", help="publish a run's trained model as an ordinary HF directory")
    e.add_argument("run_dir", help="the run directory (`ppdsl run --out`, default runs/<spec name>)")
    e.add_argument("out_dir", help="where to write the model (created; must not exist or be empty)")
    e.add_argument("--force", action="store_true", help="replace OUT_DIR if it holds files")

    v = sub.add_parser("verify", help="prove the parallel run equals one process (CPU, gloo)")
    common(v)
    v.add_argument("--world", type=int, required=True)
    v.add_argument("--steps", type=int, default=2)
    v.add_argument("--keep-dropout", action="store_true",
                   help="compare with the model's dropout on (by default both runs switch it off: their masks differ)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return {"check": cmd_check, "plan": cmd_plan, "schedule": cmd_schedule, "run": cmd_run,
                "export": cmd_export, "verify": cmd_verify}[args.command](args)
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
        from ppdsl.dsl.check import check_file
        from ppdsl.dsl.render import to_json

    results = [check_file(path, world=args.world, overrides=args.overrides, model=not args.no_model,
                          allow_paths=args.allow_paths) for path in args.spec]
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


def _checked_plan(path: str, overrides: list[str], world: int, model: bool, allow_paths: Sequence[str] = ()):
    """check + lower. Prints the diagnostics; returns (plan, check result), plan None if invalid."""
    with _loading():
        from ppdsl.dsl.check import check_file
        from ppdsl.lowering.lower import lower

    result = check_file(path, world=world, overrides=overrides, model=model, allow_paths=allow_paths)
    _print_diags([result])
    if not result.ok:
        return None, result
    try:
        return lower(result.spec, world, result.model_info), result
    except ValueError as exc:  # what the plan needs beyond a valid spec (a block count, without the model)
        print(f"ppdsl: {exc}", file=sys.stderr)
        return None, result


def cmd_plan(args: argparse.Namespace) -> int:
    from ppdsl.lowering.report import plan_report

    plan, result = _checked_plan(args.spec, args.overrides, args.world, not args.no_model, args.allow_paths)
    if plan is None:
        return EXIT_INVALID
    hidden = result.spec.model.dims.get("hidden") if result.spec is not None and result.spec.model else None
    report = plan_report(plan, result.model_info, hidden)
    print(json.dumps(report.to_json(), indent=2) if args.format == "json" else report.render())
    return EXIT_OK


def cmd_schedule(args: argparse.Namespace) -> int:
    from ppdsl.lowering.schedule_render import render_svg, render_text, to_json
    from ppdsl.lowering.schedules import STYLES, generate
    from ppdsl.lowering.simulate import simulate

    if args.spec:
        if args.world is None:
            print("ppdsl schedule: with a spec, give --world N", file=sys.stderr)
            return EXIT_INVALID
        plan, _ = _checked_plan(args.spec, args.overrides, args.world, False)
        if plan is None:
            return EXIT_INVALID
        schedule = plan.schedule
    else:
        if args.style is None or args.pp is None or args.microbatches is None:
            print("ppdsl schedule: give a spec, or --style, --pp and --microbatches", file=sys.stderr)
            return EXIT_INVALID
        try:
            default_chunks = 1 if args.style not in STYLES or STYLES[args.style].chunks == "== 1" else 2
            schedule = generate(args.style, args.pp, args.microbatches, args.chunks or default_chunks)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_INVALID
    sim = simulate(schedule)
    text = {"text": lambda: render_text(schedule, sim), "svg": lambda: render_svg(schedule, sim),
            "json": lambda: json.dumps(to_json(schedule, sim), indent=2)}[args.format]()
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text)
    else:
        print(text)
    return EXIT_OK


def cmd_run(args: argparse.Namespace) -> int:
    if args.max_restarts < 0:
        print(f"ppdsl run: --max-restarts must be >= 0, got {args.max_restarts}", file=sys.stderr)
        return EXIT_INVALID
    out = args.out or os.path.join("runs", os.path.splitext(os.path.basename(args.spec))[0])
    if "RANK" not in os.environ and args.nproc:
        plan, _ = _checked_plan(args.spec, args.overrides, args.nproc, True)  # refuse before launching
        if plan is None:
            return EXIT_INVALID
        from ppdsl.runtime.checkpoint import resume_decision
        from ppdsl.runtime.launch import launch, preflight

        try:  # what the workers would refuse is refused before any of them starts
            preflight(plan, out, "cuda" if _cuda_available() else "cpu")
            resume_decision(plan, args.resume)
        except ValueError as exc:
            print(f"ppdsl run: {exc}", file=sys.stderr)
            return EXIT_INVALID
        argv = sys.argv[1:] if sys.argv[1:2] == ["run"] else ["run", args.spec, *_run_flags(args)]
        return launch(args.spec, argv, args.nproc, args.max_restarts)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    plan, _ = _checked_plan(args.spec, args.overrides, world, True)
    if plan is None:
        return EXIT_INVALID
    from ppdsl.runtime.launch import run_worker

    return run_worker(plan, out, resume=args.resume)


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
    return out


def cmd_export(args: argparse.Namespace) -> int:
    from ppdsl.runtime.export import cli_export

    return cli_export(args.run_dir, args.out_dir, force=args.force)


def cmd_verify(args: argparse.Namespace) -> int:
    plan, result = _checked_plan(args.spec, args.overrides, args.world, True)
    if plan is None:
        return EXIT_INVALID
    from ppdsl.runtime.failure import RankFailures
    from ppdsl.runtime.verify import verify, without_randomness

    plan, notes = without_randomness(plan, _full_config(plan, result.model_info), keep=args.keep_dropout)
    try:
        report = verify(plan, args.steps, notes=notes)
    except RankFailures as exc:
        print("\n".join(exc.lines), file=sys.stderr)
        return EXIT_FAIL
    print(report.render())
    return EXIT_OK if report.ok else EXIT_FAIL


def _full_config(plan, info) -> dict:
    """The model's whole config: the HF config as built, or a python factory's keyword defaults."""
    if plan.model.kind == "python":
        from ppdsl.dsl.introspect import factory_defaults

        return factory_defaults(plan.model.target)
    return dict(info.config) if info is not None else {}
