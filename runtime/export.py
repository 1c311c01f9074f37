"""Export a trained (pipeline- and tensor-parallel) model as one ordinary model directory.

Two steps, because a run and an export happen at different times:

1. At the end of a run every rank calls `export_model(trainer, RUN_DIR / "final")` (collective):
   each parameter's tensor-parallel shards are gathered to their full shape (fused q|k|v parts
   in order, vocabulary padding removed, so ``vocab_size`` and the embedding rows agree with
   the config), the pipeline stages are gathered on global rank 0, and rank 0 writes
   - for transformers models (``hf`` / ``hf_pretrained`` sources): a normal HF directory, made
     by the model class's own ``save_pretrained`` (``config.json`` of the config the model was
     built from, ``model.safetensors`` with HF key names, tied weights stored once as HF
     stores them), plus the tokenizer files of an ``hf_pretrained`` source directory, so
     ``AutoModel*.from_pretrained(dir)`` / ``AutoTokenizer.from_pretrained(dir)`` load it;
   - for ``python("pkg.mod:factory")`` models: ``model.safetensors`` (state-dict names, tied
     tensors once) and ``ppdsl_model.json`` (factory, config, tied groups); `load_exported`
     rebuilds the module from them.
2. ``ppdsl export RUN_DIR OUT_DIR`` (`export`): validates what the run wrote (config, every
   expected tensor present with the right shape) and publishes it as OUT_DIR.

Writes are atomic: everything goes to a hidden sibling ``.OUT.tmp-XXXX`` that is renamed to
OUT at the end, so a crash never leaves a half-written OUT. An existing OUT that is not empty is
refused unless ``force`` (then it is replaced, again by renames).
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

    from ppdsl.lowering.plan import ModelRef, Plan

    from .groups import ProcessGroups

__all__ = [
    "ExportError",
    "FINAL_DIR",
    "PPDSL_MODEL_FILE",
    "cli_export",
    "export",
    "export_model",
    "export_stages",
    "gather_full_parameters",
    "load_exported",
    "write_model_dir",
]

FINAL_DIR = "final"  # where a run leaves its trained model, inside the run directory
DEFAULT_EXPORT_TIMEOUT_S = 3600.0
PPDSL_MODEL_FILE = "ppdsl_model.json"
# written into every export: `--force` replaces only a directory that holds it (an earlier
# export), never a user's own model directory or other files
EXPORT_MARKER = "ppdsl_export.json"
WEIGHTS_FILE = "model.safetensors"
_FORMAT = "ppdsl-python-model/1"
# copied from an hf_pretrained source directory so the export is usable with its tokenizer
_TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.txt", "vocab.json", "merges.txt", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model",
)


class ExportError(ValueError):
    """An export that cannot be made: a bad run directory, an occupied OUT_DIR, ..."""


# ---------------------------------------------------------------------------------------------
# In a run: gather and write (collective)
# ---------------------------------------------------------------------------------------------


def export_model(trainer: Any, out_dir: str | os.PathLike[str], *, force: bool = False) -> Path | None:
    """Write the trainer's current model to ``out_dir`` (see the module docstring). Collective:
    every rank of the run calls it, and when it returns the directory is complete. Returns the
    directory on global rank 0, None elsewhere. Raises `ExportError` on every rank when
    ``out_dir`` is occupied (and not ``force``) or rank 0 could not write it."""
    return export_stages(trainer.plan, trainer.stages, trainer.groups, out_dir, force=force)


def export_stages(plan: Plan, stages: Sequence[nn.Module], groups: ProcessGroups,
                  out_dir: str | os.PathLike[str], *, force: bool = False) -> Path | None:
    """`export_model` for a rank's built stages (``runtime.stage.build_stages``)."""
    import torch.distributed as dist

    out = Path(out_dir)
    if groups.layout.world == 1:
        tensors = gather_full_parameters(stages, groups, None)
        assert tensors is not None
        return write_model_dir(plan.model, tensors, out, force=force)
    # Rank 0 may write for minutes (a big model, a slow file system): the others wait for it on
    # a CPU group whose timeout is the export's, not the training collectives' PPDSL_TIMEOUT_S.
    # A rank 0 that dies closes its connections, which ends the wait at once.
    waiter = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=export_timeout_s()))
    problem: list[str | None] = [None]
    if groups.rank == 0:
        try:
            _check_destination(out, force)
        except (ExportError, OSError) as exc:
            problem[0] = str(exc)
    dist.broadcast_object_list(problem, src=0, group=waiter)
    if problem[0] is not None:
        raise ExportError(problem[0])
    tensors = gather_full_parameters(stages, groups, waiter)
    written: Path | None = None
    failure: list[str | None] = [None]
    if groups.rank == 0:
        assert tensors is not None
        try:
            written = write_model_dir(plan.model, tensors, out, force=force)
        except Exception as exc:
            failure[0] = f"{type(exc).__name__}: {exc}"
            dist.broadcast_object_list(failure, src=0, group=waiter)
            raise
    dist.broadcast_object_list(failure, src=0, group=waiter)  # when this returns, OUT is complete
    if failure[0] is not None:
        raise ExportError(f"rank 0 could not write {out}: {failure[0]}")
    return written


def export_timeout_s() -> float:
    """How long the other ranks wait for rank 0 to gather and write the model."""
    return float(os.environ.get("PPDSL_EXPORT_TIMEOUT_S", DEFAULT_EXPORT_TIMEOUT_S))


def gather_full_parameters(stages: Sequence[nn.Module], groups: ProcessGroups,
                           cpu_group: Any) -> dict[str, torch.Tensor] | None:
    """Every parameter of the model, full shape (TP shards merged, padding removed), as CPU
    tensors keyed by full-model name, on global rank 0 (None elsewhere). Collective over every
    rank (``cpu_group``: a gloo group of all ranks; None when the world is one process).
    Frozen parameters are included; a tied tensor appears under each name some rank holds.

    Only data-parallel replica 0 takes part beyond the group calls: its tp groups merge their
    shards, and one rank per pipeline stage (tp rank 0) sends its part to rank 0, one part at
    a time, so rank 0 holds the model once (plus one part in flight). Under FSDP2 (``zero = 3``)
    every dp rank first gathers each parameter's dp shards, one parameter at a time."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from .train import is_tp_sharded, owner_modules

    layout = groups.layout
    mine: dict[str, torch.Tensor] = {}
    owners: dict[int, tuple[nn.Module, str]] = {}
    named: list[tuple[str, torch.nn.Parameter]] = []
    for stage in stages:
        owners.update(owner_modules(stage))
        named.extend(stage.named_parameters(remove_duplicate=False))
    fsdp = any(isinstance(p, DTensor) for _, p in named)  # zero = 3: every dp rank gathers
    if groups.dp_rank == 0 or fsdp:  # the tp peers of a rank share its dp rank: the tp collectives line up
        tp = layout.tp
        merged: dict[int, torch.Tensor | None] = {}  # None: seen, kept by tp rank 0 only
        for name, p in named:  # the same order on every tp (and, for DTensors, dp) rank
            if id(p) not in merged:
                t = p.detach()
                if isinstance(t, DTensor):  # an FSDP2 shard: the tp-local tensor from every dp rank
                    t = t.full_tensor()
                if groups.dp_rank != 0:
                    merged[id(p)] = None
                    continue
                owner, local = owners[id(p)]
                if is_tp_sharded(t, owner, local, tp):
                    shards = [torch.empty_like(t) for _ in range(tp)]
                    dist.all_gather(shards, t.contiguous(), group=groups.tp)
                    t = owner.merge_shards(local, shards)
                merged[id(p)] = t.cpu().clone() if groups.tp_rank == 0 else None
            value = merged[id(p)]
            if value is not None:
                mine[name] = value
    if cpu_group is None:
        return mine
    senders = [layout.rank_of(0, pp, 0) for pp in range(1, layout.pp)]
    if groups.rank in senders:
        dist.send_object_list([mine], dst=0, group=cpu_group)
        return None
    if groups.rank != 0:
        return None
    for src in senders:
        box: list[Any] = [None]
        dist.recv_object_list(box, src=src, group=cpu_group)
        mine.update(box[0])
    return mine


def write_model_dir(model: ModelRef, tensors: Mapping[str, torch.Tensor], out_dir: str | os.PathLike[str],
                    *, force: bool = False) -> Path:
    """Write the full model ``model`` with parameter values ``tensors`` (full names) into
    ``out_dir``, atomically. One process; no communication."""
    out = Path(out_dir)
    _check_destination(out, force)
    module, groups = _filled_model(model, tensors)
    with _atomic_dir(out, force) as tmp:
        if model.kind in ("hf", "hf_pretrained"):
            _write_hf(module, model, tmp)
        else:
            _write_python(module, model, groups, tmp)
        marker = {"format": "ppdsl-export/1", "source": model.kind, "target": model.target}
        (tmp / EXPORT_MARKER).write_text(json.dumps(marker) + "\n", encoding="utf-8")
    return out


def _filled_model(model: ModelRef, tensors: Mapping[str, torch.Tensor]) -> tuple[nn.Module, list[tuple[str, ...]]]:
    """The full model (skeleton) with every parameter set to ``tensors``' value; tied
    parameters stay one Parameter (the canonical name's value)."""
    from torch import nn

    from .stage import _tied_groups, build_skeleton

    module = build_skeleton(model)
    groups = _tied_groups(module)
    alias_of = {n: names for names in groups for n in names}
    missing, done = [], set()
    for name, _ in list(module.named_parameters(remove_duplicate=False)):
        if name in done:
            continue
        names = alias_of.get(name, (name,))
        source = next((n for n in names if n in tensors), None)
        if source is None:
            missing.append(name)
            continue
        value = tensors[source]
        param = nn.Parameter(value.detach().clone(), requires_grad=False)
        for n in names:
            owner_path, _, local = n.rpartition(".")
            owner = module.get_submodule(owner_path)
            expected = tuple(owner._parameters[local].shape)
            if tuple(value.shape) != expected:
                raise ExportError(f"{n}: gathered shape {tuple(value.shape)}, the model expects {expected}")
            owner._parameters[local] = param
            done.add(n)
    if missing:
        raise ExportError(f"{len(missing)} parameter(s) were not gathered: {', '.join(missing[:5])}")
    unknown = sorted(set(tensors) - done)
    if unknown:
        raise ExportError(f"gathered parameter(s) unknown to the model: {', '.join(unknown[:5])}")
    return module, groups


def _write_hf(module: nn.Module, model: ModelRef, tmp: Path) -> None:
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # no "Writing model shards" bar in the run's log
    try:
        module.save_pretrained(tmp, safe_serialization=True)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    if model.kind == "hf_pretrained":
        from .weights import resolve_pretrained_dir

        source = resolve_pretrained_dir(model.target)
        for name in _TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copy2(source / name, tmp / name)
    if not (tmp / "config.json").is_file() or not any(tmp.glob("*.safetensors")):
        raise ExportError(f"save_pretrained wrote no config.json / safetensors in {tmp}")


def _write_python(module: nn.Module, model: ModelRef, groups: list[tuple[str, ...]], tmp: Path) -> None:
    from safetensors.torch import save_file

    aliases = {n for names in groups for n in names[1:]}
    state = {k: v.detach().contiguous() for k, v in module.state_dict().items() if k not in aliases}
    save_file(state, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
    meta = {
        "format": _FORMAT,
        "kind": model.kind,
        "factory": model.target,
        "source": f'python("{model.target}")',  # as a spec writes it
        "config": model.config_dict,
        "family": model.family,
        "tied": [list(names) for names in groups],
    }
    (tmp / PPDSL_MODEL_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True, default=list) + "\n", encoding="utf-8")


# ---------------------------------------------------------------------------------------------
# After a run: `ppdsl export RUN_DIR OUT_DIR`
# ---------------------------------------------------------------------------------------------


def export(run_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], *, force: bool = False) -> Path:
    """Publish the model a run left in ``RUN_DIR/final`` (or ``RUN_DIR`` itself, when it is a
    model directory) as ``out_dir``, after checking it: config readable, every tensor the model
    needs present with its shape, nothing unknown. Atomic; refuses an occupied ``out_dir``
    unless ``force``."""
    source = _model_dir_of(Path(run_dir))
    out = Path(out_dir)
    src, dst = source.resolve(), out.resolve()
    if dst == src or dst in src.parents or src in dst.parents:
        raise ExportError(f"OUT_DIR {out} overlaps the run's model directory {source}: choose a directory outside it")
    _check_destination(out, force)
    _validate(source)
    with _atomic_dir(out, force) as tmp:
        for entry in sorted(source.iterdir()):
            if entry.is_file():
                shutil.copy2(entry, tmp / entry.name)
            elif entry.is_dir():
                shutil.copytree(entry, tmp / entry.name)
    return out


def cli_export(run_dir: str, out_dir: str, force: bool = False, stream: Any = None) -> int:
    """``ppdsl export RUN_DIR OUT_DIR [--force]``: 0 exported, 2 unusable input / occupied
    OUT_DIR (a message, no traceback), 1 an unexpected failure."""
    stream = stream or sys.stderr
    try:
        out = export(run_dir, out_dir, force=force)
    except ExportError as exc:
        print(f"ppdsl export: {exc}", file=stream)
        return 2
    except OSError as exc:
        print(f"ppdsl export: {exc}", file=stream)
        return 1
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(f"exported {_model_dir_of(Path(run_dir))} -> {out} ({size / 2**20:.1f} MiB)")
    return 0


def load_exported(directory: str | os.PathLike[str], device: str = "cpu") -> nn.Module:
    """The model in an exported directory: an HF one through its class's ``from_pretrained``
    (class from ``config.json``'s ``architectures``), a python-factory one rebuilt by calling
    the factory and loading the weights (ties restored)."""
    directory = Path(directory)
    if (directory / PPDSL_MODEL_FILE).is_file():
        return _load_python(directory, device)
    import transformers

    config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
    archs = getattr(config, "architectures", None) or []
    cls = getattr(transformers, archs[0], None) if archs else None
    if cls is None:
        cls = transformers.AutoModel
    return cls.from_pretrained(directory, local_files_only=True).to(device)


def _load_python(directory: Path, device: str) -> nn.Module:
    from safetensors.torch import load_file

    from ppdsl.core.build import build_model

    meta = _read_ppdsl_meta(directory)
    module = build_model("python", meta["factory"], meta["config"], device="cpu")
    state = load_file(str(directory / WEIGHTS_FILE))
    for names in meta.get("tied", []):
        for alias in names[1:]:
            state.setdefault(alias, state[names[0]])
    result = module.load_state_dict(state, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise ExportError(f"{directory}: missing {result.missing_keys[:5]}, unexpected {result.unexpected_keys[:5]}")
    return module.to(device)


def _model_dir_of(run_dir: Path) -> Path:
    if not run_dir.is_dir():
        raise ExportError(f"RUN_DIR {run_dir} is not a directory")
    for candidate in (run_dir / FINAL_DIR, run_dir):
        if (candidate / WEIGHTS_FILE).is_file() or (candidate / "model.safetensors.index.json").is_file():
            if (candidate / "config.json").is_file() or (candidate / PPDSL_MODEL_FILE).is_file():
                return candidate
    raise ExportError(
        f"RUN_DIR {run_dir} holds no trained model: a run writes it to {run_dir / FINAL_DIR} "
        "(config.json or ppdsl_model.json, and model.safetensors) when training ends"
    )


def _read_ppdsl_meta(directory: Path) -> dict[str, Any]:
    try:
        meta = json.loads((directory / PPDSL_MODEL_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ExportError(f"cannot read {directory / PPDSL_MODEL_FILE}: {exc}") from None
    if (not isinstance(meta, dict) or meta.get("format") != _FORMAT or not isinstance(meta.get("factory"), str)
            or not isinstance(meta.get("config"), dict) or not isinstance(meta.get("tied", []), list)):
        raise ExportError(f"{directory / PPDSL_MODEL_FILE} is not a ppdsl model description ({_FORMAT})")
    return meta


def _validate(source: Path) -> None:
    """Build the model on the meta device from the directory's description and compare its
    parameters and persistent buffers with the safetensors headers (no tensor is read)."""
    from .weights import safetensors_files

    try:
        keys = safetensors_files(source)
    except Exception as exc:  # a truncated or foreign file
        raise ExportError(f"cannot read the weights in {source}: {exc}") from None
    try:
        shapes = _header_shapes(keys)
    except Exception as exc:  # a missing or truncated shard
        raise ExportError(f"cannot read the weights in {source}: {exc}") from None
    module, groups = _meta_model(source)
    alias_of = {n: names for names in groups for n in names}
    expected = {}
    for name, t in module.state_dict(keep_vars=True).items():
        expected[name] = tuple(t.shape)
    missing = [n for n in expected if n not in shapes and not any(a in shapes for a in alias_of.get(n, ()))]
    unknown = [k for k in shapes if k not in expected]
    wrong = [f"{k} {shapes[k]} (expected {expected[k]})"
             for k in shapes if k in expected and shapes[k] != expected[k]]
    problems = []
    if missing:
        problems.append(f"missing {len(missing)} tensor(s): {', '.join(missing[:5])}")
    if unknown:
        problems.append(f"{len(unknown)} unknown tensor(s): {', '.join(unknown[:5])}")
    if wrong:
        problems.append(f"wrong shapes: {', '.join(wrong[:5])}")
    if problems:
        raise ExportError(f"{source} does not hold a complete model: " + "; ".join(problems))


def _header_shapes(keys: Mapping[str, str]) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    out: dict[str, tuple[int, ...]] = {}
    by_file: dict[str, list[str]] = {}
    for k, f in keys.items():
        by_file.setdefault(f, []).append(k)
    for f, ks in by_file.items():
        with safe_open(f, framework="pt") as fh:
            for k in ks:
                out[k] = tuple(int(d) for d in fh.get_slice(k).get_shape())
    return out


def _meta_model(source: Path) -> tuple[nn.Module, list[tuple[str, ...]]]:
    from ppdsl.core.build import ModelLoadError, build_model

    from .stage import _tied_groups

    try:
        if (source / PPDSL_MODEL_FILE).is_file():
            meta = _read_ppdsl_meta(source)
            module = build_model("python", meta["factory"], meta["config"], device="meta")
        else:
            module = build_model("hf_pretrained", str(source), {}, device="meta")
    except ModelLoadError as exc:
        raise ExportError(f"{source}: {exc}") from None
    return module, _tied_groups(module)


# ---------------------------------------------------------------------------------------------
# The destination, written atomically
# ---------------------------------------------------------------------------------------------


def _check_destination(out: Path, force: bool) -> None:
    """ExportError unless ``out`` can be written: absent, empty, or (with ``force``) an
    earlier export. Nothing is created here."""
    try:
        if out.exists() and not out.is_dir():
            raise ExportError(f"OUT_DIR {out} exists and is not a directory")
        if out.is_dir() and any(out.iterdir()):
            if not force:
                raise ExportError(f"OUT_DIR {out} exists and is not empty (pass --force to replace an earlier export)")
            if not (out / EXPORT_MARKER).is_file():
                raise ExportError(f"OUT_DIR {out} holds files and is not an earlier ppdsl export (no {EXPORT_MARKER}): "
                                  "ppdsl never replaces it")
    except OSError as exc:
        raise ExportError(f"cannot use OUT_DIR {out}: {exc}") from None


def check_final_destination(run_dir: str | os.PathLike[str]) -> None:
    """Before training: ExportError when the run could not write ``RUN_DIR/final`` at its end."""
    final = Path(run_dir) / FINAL_DIR
    try:
        _check_destination(final, True)
    except ExportError as exc:
        raise ExportError(f"the run would end by writing its model to {final}, but: {exc}. Move it away, "
                          "choose another --out, or set train.save_final = false") from None


@contextmanager
def _atomic_dir(out: Path, force: bool) -> Iterator[Path]:
    """A fresh hidden sibling of ``out`` to write into; renamed to ``out`` when the block
    succeeds, removed when it fails."""
    parent = out.resolve().parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ExportError(f"cannot create {parent}: {exc}") from None
    for stale in (*parent.glob(f".{out.name}.tmp-*"), *parent.glob(f".{out.name}.old-*")):
        shutil.rmtree(stale, ignore_errors=True)  # what an export killed midway left behind
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=parent))
    try:
        yield tmp
        umask = _umask()
        for f in tmp.rglob("*"):
            if f.is_file():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
                os.chmod(f, 0o666 & ~umask)  # safetensors writes 0600: make it an ordinary file
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it 0700
        _publish(tmp, out, force)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _umask() -> int:
    current = os.umask(0o022)
    os.umask(current)
    return current


def _publish(tmp: Path, out: Path, force: bool) -> None:
    if out.is_dir():
        if not any(out.iterdir()):
            out.rmdir()
        elif not force:
            raise ExportError(f"OUT_DIR {out} exists and is not empty (pass --force to replace it)")
        else:
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.resolve().parent))
            old.rmdir()
            os.rename(out, old)
            try:
                os.rename(tmp, out)
            except BaseException:
                os.rename(old, out)  # put the previous export back
                raise
            shutil.rmtree(old, ignore_errors=True)
            return
    os.rename(tmp, out)
