"""Pretrained weights: reading a rank's part of a local HF checkpoint directory.

Where the directory is (a path or ``package:NAME``) is `ppdsl.core.locate`'s job (torch-free, so
``ppdsl check`` uses it too); its names are re-exported here.

Reading (`load_pretrained`): each parameter of a module (a rank's stages, or a whole model) is
filled from the checkpoint tensor of the same name; names are tried as they are, without the
model's ``base_model_prefix`` (a ``BertModel`` checkpoint for ``BertForSequenceClassification``:
``bert.encoder...`` is ``encoder...`` there) and with it. Parameters the checkpoint lacks (a new
classification head) keep their values. Only the tensors the module holds are read, and a
tensor-parallel shard (a layer with ``local_shard``: column, row, vocab) is read *sliced*
through safetensors' ``get_slice``: only the rows / columns this rank keeps, zero-filled where
the shard falls in the vocabulary padding. Which slice is found generically, by applying the
layer's own ``local_shard`` to index tensors, so fused parts (GPT-2's q|k|v) and Conv1D's
transposed layout need no special case.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import attrs

from ppdsl.core.locate import MINILM_PACKAGE, PACKAGE_SCHEME, PretrainedDirError, minilm_dir, resolve_pretrained_dir

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = [
    "MINILM_PACKAGE",
    "PACKAGE_SCHEME",
    "LoadReport",
    "PretrainedDirError",
    "ReadRecord",
    "checkpoint_key",
    "load_pretrained",
    "minilm_dir",
    "resolve_pretrained_dir",
    "safetensors_files",
]

# ---------------------------------------------------------------------------------------------
# Checkpoint index and key names
# ---------------------------------------------------------------------------------------------


def safetensors_files(directory: str | os.PathLike[str]) -> dict[str, str]:
    """Checkpoint key -> file, for a single or an indexed (sharded) safetensors checkpoint.
    Reads headers only."""
    directory = os.fspath(directory)
    index = os.path.join(directory, "model.safetensors.index.json")
    single = os.path.join(directory, "model.safetensors")
    try:
        if os.path.isfile(index):
            with open(index, encoding="utf-8") as fh:
                weight_map = json.load(fh)["weight_map"]
            return {str(key): os.path.join(directory, str(f)) for key, f in weight_map.items()}
        if os.path.isfile(single):
            from safetensors import safe_open

            with safe_open(single, framework="pt") as fh:
                return {key: single for key in fh.keys()}
    except Exception as exc:  # not JSON, no weight_map, a truncated or foreign file
        raise ValueError(f"hf_pretrained: cannot read the checkpoint index of '{directory}': "
                         f"{type(exc).__name__}: {exc}") from None
    raise ValueError(f"hf_pretrained: '{directory}' holds no model.safetensors (or its index)")


def checkpoint_key(name: str, keys: Mapping[str, Any], base_prefix: str) -> str | None:
    """The checkpoint key holding parameter ``name``: the name itself, the name without the
    model's base prefix (a base-model checkpoint), or with it (a head model's checkpoint
    loaded into its base model), each also with LayerNorm's old ``gamma`` / ``beta`` names;
    None when the checkpoint has none of them."""
    forms = [name]
    for new, legacy in ((".weight", ".gamma"), (".bias", ".beta")):  # LayerNorm keys of old BERT checkpoints
        if name.endswith(new):
            forms.append(name[: -len(new)] + legacy)
    candidates = []
    for form in forms:
        candidates.append(form)
        if base_prefix and form.startswith(base_prefix + "."):
            candidates.append(form[len(base_prefix) + 1:])
        elif base_prefix:
            candidates.append(f"{base_prefix}.{form}")
    return next((c for c in candidates if c in keys), None)


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


@attrs.frozen
class ReadRecord:
    """One checkpoint tensor read for one parameter."""

    name: str  # the parameter
    key: str  # the checkpoint key
    file: str
    full_shape: tuple[int, ...]  # the tensor's shape in the checkpoint
    shape: tuple[int, ...]  # the parameter's (local) shape
    numel_read: int  # elements actually read from the file (less than full when sliced)
    sliced: bool  # read through get_slice: only this rank's part


@attrs.define
class LoadReport:
    reads: list[ReadRecord] = attrs.field(factory=list)
    kept: list[str] = attrs.field(factory=list)  # parameters not in the checkpoint (init kept)

    @property
    def keys(self) -> set[str]:
        return {r.key for r in self.reads}

    @property
    def numel_read(self) -> int:
        return sum(r.numel_read for r in self.reads)


def load_pretrained(
    module: nn.Module,
    directory: str | os.PathLike[str],
    skeleton: nn.Module | None = None,
    tied: Mapping[str, Any] | None = None,
    *,
    base_prefix: str | None = None,
) -> LoadReport:
    """Overwrite the parameters of ``module`` that the checkpoint in ``directory`` (any
    `resolve_pretrained_dir` target) holds, reading only those, and tensor-parallel shards
    sliced. ``tied``: non-canonical tied name -> canonical name (or ``(name, owner)`` as
    ``runtime.stage.build`` keeps it), tried when a name is not in the checkpoint (GPT-2's
    ``lm_head.weight`` is stored as ``transformer.wte.weight``). ``base_prefix`` defaults to
    the ``base_model_prefix`` of ``skeleton`` (else of the stage's full model, else of ``module``).

    Call it before or after the tensor-parallel replacement: a sharded layer is recognised by
    its ``local_shard`` method. Raises ValueError on a shape mismatch, or when ``module`` has
    parameters and the checkpoint holds none of them (a wrong directory)."""
    import torch
    from safetensors import safe_open

    path = resolve_pretrained_dir(directory, require_config=False)
    keys = safetensors_files(path)
    if base_prefix is None:  # a StageModule keeps the full model's root object as ``shell``
        root = skeleton if skeleton is not None else module.__dict__.get("shell", module)
        base_prefix = getattr(root, "base_model_prefix", "") or ""
    legacy = _legacy_names(skeleton if skeleton is not None else module.__dict__.get("shell", module))
    # every name of a tied tensor, so whichever one the checkpoint stores is found from any other
    canonical = {k: (v[0] if isinstance(v, tuple) else v) for k, v in (tied or {}).items()}
    tie_groups: dict[str, list[str]] = {}
    for alias, canon in canonical.items():
        tie_groups.setdefault(canon, [canon]).append(alias)
    aliases = {n: group for group in tie_groups.values() for n in group}
    owners = {id(p): (m, n) for m in module.modules() for n, p in m.named_parameters(recurse=False)}

    report = LoadReport()
    plan: dict[str, list[tuple[str, str, torch.nn.Parameter]]] = {}
    done: set[int] = set()
    names_of: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(name)
        if id(param) in done:
            continue
        key = checkpoint_key(name, keys, base_prefix)
        for other in aliases.get(name, ()):
            key = key or checkpoint_key(other, keys, base_prefix)
        for other in (name, *aliases.get(name, ())):
            for form in legacy(other) if key is None else ():
                key = key or checkpoint_key(form, keys, base_prefix)
        if key is not None:
            done.add(id(param))
            plan.setdefault(keys[key], []).append((name, key, param))
    for pid, names in names_of.items():
        if pid not in done:
            report.kept.append(names[0])
    if names_of and not done:
        sample = ", ".join(sorted(keys)[:3])
        raise ValueError(
            f"hf_pretrained: none of the {len(names_of)} parameters here (e.g. {next(iter(names_of.values()))[0]}) "
            f"is in the checkpoint in '{path}' (keys like {sample})"
        )
    with torch.no_grad():
        for file, entries in plan.items():
            try:
                fh_context = safe_open(file, framework="pt")
            except Exception as exc:  # a shard the index names but that is missing or truncated
                raise ValueError(f"hf_pretrained: cannot open '{file}': {type(exc).__name__}: {exc}") from None
            with fh_context as fh:
                for name, key, param in entries:
                    owner, local = owners[id(param)]
                    tensor, record = _read(fh, file, name, key, owner, local, tuple(param.shape))
                    param.copy_(tensor)
                    report.reads.append(record)
    return report


def _legacy_names(model: Any) -> Callable[[str], tuple[str, ...]]:
    """The names a parameter may have in the checkpoints of the model's class: transformers 5
    renames modules (Swin's ``attention.q_proj`` is ``attention.self.query`` in its files, which
    ``save_pretrained`` still writes; LLaVA's ``model.language_model`` is ``language_model.model``)
    and maps the names back as it loads. Its own renamings, reversed: all of them in turn, then
    each alone (LLaVA's ``lm_head`` is ``language_model.lm_head``); none where there are none
    (transformers 4.x, a python factory's module)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key

        renamings = [t.reverse_transform() for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]
    except Exception:  # noqa: BLE001 - no mapping to apply: the names as they are
        return lambda name: ()

    def legacy(name: str) -> tuple[str, ...]:
        out: list[str] = []
        for group in (renamings, *([r] for r in renamings)):
            try:
                renamed = rename_source_key(name, group, [], reverse=True)[0]
            except Exception:  # noqa: BLE001
                continue
            if renamed != name and renamed not in out:
                out.append(renamed)
        return tuple(out)

    return legacy


def _read(fh: Any, file: str, name: str, key: str, owner: Any, local: str,
          shape: tuple[int, ...]) -> tuple[torch.Tensor, ReadRecord]:
    sl = fh.get_slice(key)
    full_shape = tuple(int(d) for d in sl.get_shape())
    shard = getattr(owner, "local_shard", None)
    selection = None
    if shard is not None and full_shape:
        try:
            selection = _selection(shard, local, full_shape)
        except (AssertionError, RuntimeError, ValueError, IndexError):  # the layer refuses this shape
            raise ValueError(
                f"hf_pretrained: '{key}' has shape {full_shape} in the checkpoint, which the tensor-parallel "
                f"layer holding {name} {shape} cannot split"
            ) from None
    split = [] if selection is None else [
        d for d, sel in enumerate(selection) if sel != list(range(1, full_shape[d] + 1))
    ]
    if not split:  # a whole tensor: not tensor-parallel, or replicated (a row-parallel bias)
        if full_shape != shape:
            raise ValueError(
                f"hf_pretrained: '{key}' has shape {full_shape} in the checkpoint, the model expects {shape} ({name})"
            )
        tensor = sl[:] if full_shape else fh.get_tensor(key)
        return tensor, ReadRecord(name, key, file, full_shape, shape, _numel(full_shape), False)
    assert selection is not None and shard is not None
    sizes = tuple(len(s) for s in selection)
    if sizes != shape:
        raise ValueError(
            f"hf_pretrained: '{key}' has shape {full_shape} in the checkpoint; its tensor-parallel shard "
            f"would be {sizes}, the model holds {shape} ({name})"
        )
    if len(split) > 1:  # not a 1-D split: read it whole and let the layer cut it
        tensor = shard(local, fh.get_tensor(key))
        return tensor, ReadRecord(name, key, file, full_shape, shape, _numel(full_shape), False)
    tensor, read = _read_runs(sl, selection[split[0]], split[0], full_shape)
    return tensor, ReadRecord(name, key, file, full_shape, shape, read, True)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _index_grid(full_shape: tuple[int, ...], dim: int) -> torch.Tensor:
    """A zero-memory tensor of ``full_shape`` whose value is (index along ``dim``) + 1."""
    import torch

    view = [1] * len(full_shape)
    view[dim] = full_shape[dim]
    return torch.arange(1, full_shape[dim] + 1).view(view).expand(full_shape)


def _selection(shard: Any, local: str, full_shape: tuple[int, ...]) -> list[list[int]]:
    """Per dim: the 1-based checkpoint indices the shard holds, in order (0 = padding)."""
    out = []
    for dim in range(len(full_shape)):
        picked = shard(local, _index_grid(full_shape, dim))
        for other in reversed(range(picked.dim())):
            if other != dim:
                picked = picked.select(other, 0) if picked.size(other) else picked
        out.append([int(v) for v in picked.reshape(-1).tolist()])
    return out


def _read_runs(sl: Any, indices: list[int], dim: int, full_shape: tuple[int, ...]) -> tuple[torch.Tensor, int]:
    """Read the rows ``indices`` (1-based, 0 = zero padding) of ``dim`` as contiguous runs."""
    import torch

    pieces: list[torch.Tensor] = []
    read = 0
    i = 0
    while i < len(indices):
        j = i + 1
        if indices[i] == 0:
            while j < len(indices) and indices[j] == 0:
                j += 1
            shape = list(full_shape)
            shape[dim] = j - i
            pieces.append(torch.zeros(shape, dtype=_torch_dtype(sl.get_dtype())))
        else:
            while j < len(indices) and indices[j] == indices[j - 1] + 1:
                j += 1
            index = (slice(None),) * dim + (slice(indices[i] - 1, indices[j - 1]),)
            part = sl[index]
            read += part.numel()
            pieces.append(part)
        i = j
    return (pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)), read


def _torch_dtype(name: str) -> torch.dtype:
    import torch

    table = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
             "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
             "BOOL": torch.bool}
    return table.get(name, torch.float32)
