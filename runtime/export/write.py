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
2. ``ppdsl export RUN_DIR OUT_DIR`` (`runtime.export.publish`): validates what the run wrote
   (config, every expected tensor present with the right shape) and publishes it as OUT_DIR.

Writes are atomic (`runtime.export.atomic_dir`).
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ppdsl.runtime.export.atomic_dir import EXPORT_MARKER, FINAL_DIR, ExportError, atomic_dir, check_destination

if TYPE_CHECKING:
    import torch
    from torch import nn

    from ppdsl.lowering.plan import ModelRef, Plan

    from ppdsl.runtime.parallel.groups import ProcessGroups

__all__ = ["ExportError", "FINAL_DIR", "PPDSL_MODEL_FILE", "export_model", "export_stages", "gather_full_parameters",
           "write_model_dir"]

DEFAULT_EXPORT_TIMEOUT_S = 3600.0
PPDSL_MODEL_FILE = "ppdsl_model.json"
WEIGHTS_FILE = "model.safetensors"
FORMAT = "ppdsl-python-model/1"
# copied from an hf_pretrained source directory so the export is usable with its tokenizer
_TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.txt", "vocab.json", "merges.txt", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model",
)


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
    """`export_model` for a rank's built stages (``runtime.stage.build.build_stages``)."""
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
            check_destination(out, force)
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

    from ppdsl.runtime.parallel.expert import gather_experts
    from ppdsl.runtime.stage.params import is_tp_sharded, owner_modules

    layout = groups.layout
    mine: dict[str, torch.Tensor] = {}
    owners: dict[int, tuple[nn.Module, str]] = {}
    named: list[tuple[str, torch.nn.Parameter]] = []
    for stage in stages:
        owners.update(owner_modules(stage))
        named.extend(stage.named_parameters(remove_duplicate=False))
    fsdp = any(isinstance(p, DTensor) for _, p in named)  # zero = 3: every dp rank gathers
    # ep > 1: dp replica 0's ep group (dp ranks 0 .. ep-1) gathers the experts' rows
    experts = gather_experts(stages, groups.ep, layout.ep) if layout.ep > 1 and groups.dp_rank < layout.ep else {}
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
                if id(p) in experts:
                    t = experts[id(p)]
                elif is_tp_sharded(t, owner, local, tp):
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
    check_destination(out, force)
    module, groups = filled_model(model, tensors)
    with atomic_dir(out, force) as tmp:
        if model.kind in ("hf", "hf_pretrained"):
            _write_hf(module, model, tmp)
        else:
            _write_python(module, model, groups, tmp)
        marker = {"format": "ppdsl-export/1", "source": model.kind, "target": model.target}
        (tmp / EXPORT_MARKER).write_text(json.dumps(marker) + "\n", encoding="utf-8")
    return out


def filled_model(model: ModelRef, tensors: Mapping[str, torch.Tensor]) -> tuple[nn.Module, list[tuple[str, ...]]]:
    """The full model (skeleton) with every parameter set to ``tensors``' value; tied
    parameters stay one Parameter (the canonical name's value)."""
    from torch import nn

    from ppdsl.runtime.stage.skeleton import build_skeleton, tied_groups as _tied_groups

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
        from ppdsl.runtime.stage.weights import resolve_pretrained_dir

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
        "format": FORMAT,
        "kind": model.kind,
        "factory": model.target,
        "source": f'python("{model.target}")',  # as a spec writes it
        "config": model.config_dict,
        "family": model.family,
        "tied": [list(names) for names in groups],
    }
    (tmp / PPDSL_MODEL_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True, default=list) + "\n", encoding="utf-8")
