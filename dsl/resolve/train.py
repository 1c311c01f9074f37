"""The train block: sizes, optimizer and LR schedule (options in range), precision, the data
source, and its checkpoint and eval blocks."""

from __future__ import annotations

from typing import Any

import attrs

from .. import ast, schema
from ..diagnostics import warning
from ..exact import Expr
from ..spec import CheckpointSpec, DataSpec, EvalSpec, LrScheduleSpec, OptimizerSpec, TrainSpec
from .coerce import OptionTable, bool_value, call_value, enum_value, float_value
from ..sizes import MIN_DEVICE_MEMORY, UNIT_NAMES, SizeError, parse_size
from .data import resolve_data
from .scope import Scope, Unresolved, plain_int
from .structure import block_entries, missing_key

SEQ_LEN_DOC = "tokens per sample"  # E0102's hint
MIN_HANG_TIMEOUT_S = 5.0  # train.hang_timeout below this: W0320


def resolve_train(scope: Scope) -> TrainSpec:
    entries = scope.entries.get("train", {})
    if "train" not in scope.blocks:
        raise Unresolved()
    global_batch = scope.int_value("train.global_batch")
    seq_len = _seq_len(scope)
    steps = scope.concrete_int("train.steps", 0)
    seed = scope.concrete_int("train.seed", 0)
    zero = scope.concrete_int("train.zero", 0)
    log_every = scope.concrete_int("train.log_every", 1)
    precision = enum_value(scope, "train", "precision", entries)
    opt_name, opt = _train_call(scope, entries, "optimizer", schema.OPTIMIZER_ARGS)
    lrs_name, lrs = _train_call(scope, entries, "lr_schedule", schema.LR_SCHEDULE_ARGS)
    _option_ranges(scope, entries, "optimizer", opt)
    _option_ranges(scope, entries, "lr_schedule", {**lrs, "lr": opt["lr"]})
    data = resolve_data(scope, entries, seed)
    grad_clip = None
    if "grad_clip" in entries:
        gv = entries["grad_clip"].value
        if not isinstance(gv, ast.NoneLit):
            grad_clip = float_value(scope, entries["grad_clip"])
            if grad_clip <= 0:
                scope.bad_value(gv.span, "grad_clip must be positive (or none)")
    checkpoint = None
    if "checkpoint" in entries:
        checkpoint = _checkpoint(scope, entries["checkpoint"])  # type: ignore[arg-type]
    act_ckpt = bool_value(scope, entries["activation_checkpointing"]) if "activation_checkpointing" in entries else False
    compile_blocks = bool_value(scope, entries["compile"]) if "compile" in entries else False
    save_final = bool_value(scope, entries["save_final"]) if "save_final" in entries else True
    evaluation = None
    if "eval" in entries:
        evaluation = _eval(scope, entries["eval"], data)  # type: ignore[arg-type]
    metrics = enum_value(scope, "train", "metrics", entries)
    from .packing import fold_packing, packing_value

    packing = packing_value(scope, entries)
    if packing is not None:
        data = fold_packing(scope, data, packing, "train.data")
        if evaluation is not None:
            evaluation = attrs.evolve(evaluation, data=fold_packing(scope, evaluation.data, packing, "train.eval.data"))
    peak_tflops = None
    if "peak_tflops" in entries and not isinstance(entries["peak_tflops"].value, ast.NoneLit):
        peak_tflops = float_value(scope, entries["peak_tflops"])
        if peak_tflops <= 0:
            scope.bad_value(entries["peak_tflops"].value.span, "peak_tflops must be positive (or none)")
    trace = bool_value(scope, entries["trace"]) if "trace" in entries else False
    reshard = bool_value(scope, entries["reshard_after_forward"]) if "reshard_after_forward" in entries else False
    hang_timeout = _hang_timeout(scope, entries.get("hang_timeout"))
    on_nonfinite = enum_value(scope, "train", "on_nonfinite", entries)
    max_nonfinite = scope.concrete_int("train.max_nonfinite", 1)
    device_memory = _device_memory(scope, entries.get("device_memory"))
    return TrainSpec(
        global_batch=global_batch, seq_len=seq_len, steps=steps, seed=seed,
        optimizer=OptimizerSpec(opt_name, opt["lr"], opt.get("weight_decay", 0.0), tuple(opt.get("betas", (0.9, 0.999))),
                                opt.get("eps", 1e-8), opt.get("momentum", 0.0)),
        lr_schedule=LrScheduleSpec(lrs_name, lrs["warmup"], lrs.get("min_lr", 0.0)),
        precision=precision, grad_clip=grad_clip, zero=zero, data=data,
        checkpoint=checkpoint, activation_checkpointing=act_ckpt, log_every=log_every, save_final=save_final,
        eval=evaluation, metrics=metrics, peak_tflops=peak_tflops,
        trace=trace, reshard_after_forward=reshard, hang_timeout=hang_timeout,
        on_nonfinite=on_nonfinite, max_nonfinite=max_nonfinite, device_memory=device_memory, compile=compile_blocks,
        packing=packing,
    )


def _seq_len(scope: Scope) -> int | None:
    """train.seq_len. Required where the model takes tokens: every family's but the own forward's,
    whose input check learns from the built model (dsl/input_check.py: E0102 there for tokens; an
    image model's activation length is traced)."""
    if "train.seq_len" in scope.spans:
        return scope.concrete_int("train.seq_len", 1)
    family = getattr(scope, "family", None)
    if family is None or not family.layout_from_trace:
        scope.diags.append(missing_key(scope.blocks["train"].kind_span, "train", "seq_len", SEQ_LEN_DOC))
    return None


def _device_memory(scope: Scope, assign: ast.Assign | None) -> int | None:
    """train.device_memory: a size (`80GiB`, `"1.5 TiB"`, a number of bytes: dsl/sizes.py), or
    none. E0103 for anything else, and for less than 1 MiB (a number whose unit was forgotten)."""
    if assign is None or isinstance(assign.value, ast.NoneLit):
        return None
    v = assign.value
    hint = f"write a number with a unit ({UNIT_NAMES}), e.g. device_memory = 80GiB, or a number of bytes"
    if isinstance(v, (ast.Name, ast.Str)) and not (isinstance(v, ast.Name) and len(v.parts) > 1):
        try:
            size = parse_size(v.text if isinstance(v, ast.Name) else v.value)
        except SizeError as exc:
            scope.bad_value(v.span, f"device_memory must be a size: {exc}", hint=hint)
            return None
    else:
        value = scope.expr_value(v)
        if not (isinstance(value, Expr) and not value.free_symbols and value.is_number and 1 <= float(value) < 2**63):
            scope.bad_value(v.span, "device_memory must be a size", hint=hint)
            return None
        size = int(float(value))
    if size < MIN_DEVICE_MEMORY:
        scope.bad_value(v.span, f"device_memory = {size} bytes is less than 1 MiB: is its unit missing?",
                        hint=f"write the unit: device_memory = {size}GiB ({UNIT_NAMES})")
        return None
    return size


def _hang_timeout(scope: Scope, assign: ast.Assign | None) -> float | None:
    """train.hang_timeout: seconds (E0320 unless positive; W0320 when so short that a slow
    step or a loaded machine passes for a hang), or off / none."""
    if assign is None:
        return schema.BLOCKS["train"]["hang_timeout"].default
    v = assign.value
    if isinstance(v, ast.NoneLit) or (isinstance(v, ast.Name) and v.text == "off"):
        return None
    value = None if isinstance(v, (ast.Name, ast.Str, ast.Bool)) else scope.expr_value(v)
    seconds = float(value) if isinstance(value, Expr) and not value.free_symbols and value.is_number else None
    if seconds is None or not seconds > 0 or seconds == float("inf"):
        scope.err("E0320", v.span, "hang_timeout must be a positive number of seconds, or off",
                  hint="e.g. hang_timeout = 60; hang_timeout = off turns the hang watchdog off")
        return None
    if seconds < MIN_HANG_TIMEOUT_S:
        scope.diags.append(warning(
            "W0320", v.span, f"hang_timeout = {seconds:g} s is shorter than {MIN_HANG_TIMEOUT_S:g} s: a slow step "
            "or a loaded machine may be taken for a hung rank",
            hint=f"the watchdog looks twice a second; use at least {MIN_HANG_TIMEOUT_S:g} s (default 60)"))
    return seconds


def _train_call(scope: Scope, entries: dict[str, ast.Assign], key: str,
                table: dict[str, OptionTable]) -> tuple[str, dict[str, Any]]:
    default = schema.BLOCKS["train"][key].default
    if key not in entries:
        return default, {k: d for k, (_, d) in table[default].items()}
    return call_value(scope, entries[key], key, table)


def _option_ranges(scope: Scope, entries: dict[str, ast.Assign], key: str, opts: dict[str, Any]) -> None:
    """E0108: an option torch would refuse (or that means nothing), before anything runs."""
    if key not in entries:
        return
    call = entries[key].value
    spans = {k.name: k.value.span for k in getattr(call, "kwargs", ())}
    names = list((schema.OPTIMIZER_ARGS if key == "optimizer" else schema.LR_SCHEDULE_ARGS).get(getattr(call, "func", ""), ()))
    spans.update({names[i]: a.span for i, a in enumerate(getattr(call, "args", ())[:len(names)])})
    for name, (ok, want) in schema.OPTION_RANGES.items():
        value = opts.get(name)
        if name not in spans or value is None:
            continue
        values = value if isinstance(value, tuple) else (value,)
        bad = next((v for v in values if not ok(v, opts)), None)
        if bad is not None:
            shown = f"{name} = {bad:g}" if len(values) == 1 else f"{name} = [{', '.join(f'{v:g}' for v in values)}]"
            scope.err("E0108", spans[name], f"{shown} is out of range: {name} must be {want}",
                      label=f"{bad:g} is out of range" if len(values) > 1 else "")


def _eval(scope: Scope, block: ast.Block, train_data: DataSpec) -> EvalSpec | None:
    """`eval { data = ..., every = N, batches = K }`. Synthetic eval data without a seed
    takes the training data's seed + 1, so it is not the training stream."""
    entries = block_entries(scope, block, schema.EVAL_KEYS, "train.eval")
    if "data" not in entries:
        return None  # E0102 said so
    data = resolve_data(scope, entries, int(train_data.options.get("seed", 0)) + 1, where="train.eval.data")
    values = {"every": 0, "batches": 1}
    ok = True
    for key, minimum in (("every", 0), ("batches", 1)):
        if key in entries:
            v = entries[key].value
            try:
                values[key] = plain_int(scope.expr_value(v), v.span, f"eval.{key}", minimum, scope.diags)
            except Unresolved:
                ok = False
    if not ok:
        raise Unresolved()
    return EvalSpec(data, values["every"], values["batches"])


def _checkpoint(scope: Scope, block: ast.Block) -> CheckpointSpec | None:
    entries = block_entries(scope, block, schema.CHECKPOINT_KEYS, "train.checkpoint")
    if "dir" not in entries:
        return None
    d = entries["dir"].value
    if not isinstance(d, ast.Str):
        scope.bad_value(d.span, "checkpoint dir must be a string")
        return None
    every = 0
    if "every" in entries:
        every = plain_int(scope.expr_value(entries["every"].value), entries["every"].span, "every", 0, scope.diags)
    return CheckpointSpec(d.value, every)
