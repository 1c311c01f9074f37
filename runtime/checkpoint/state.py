"""What a checkpoint holds, in global coordinates: gathering a trainer's state into the boxes
DCP writes (`global_state`) and loading them back under any mesh (`load_global_state`).
"""

from __future__ import annotations

import pickle
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ppdsl.runtime.checkpoint.resume import CheckpointMismatch

if TYPE_CHECKING:
    from ppdsl.runtime.checkpoint.dcp_boxes import Boxed
    from ppdsl.runtime.train.trainer import Trainer


# ---------------------------------------------------------------------------------------------
# State in global coordinates
# ---------------------------------------------------------------------------------------------


def _obj(value: Any) -> Any:
    """A picklable object as a uint8 tensor (DCP would otherwise flatten lists and dicts)."""
    import torch

    data = pickle.dumps(value)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()


def _unobj(t: Any) -> Any:
    return pickle.loads(t.numpy().tobytes())


_OBJ = ":obj"  # suffix of an optimizer state entry that is a pickled object, not a tensor


def _rng_prefix(trainer: Trainer) -> str:
    c = trainer.groups.coords
    cp = f".cp{c['cp']}" if trainer.groups.layout.cp > 1 else ""
    return f"rng/dp{c['dp']}{cp}.pp{c['pp']}.tp{c['tp']}/"


def _placements(trainer: Trainer) -> tuple[dict[str, Boxed], dict[int, Boxed]]:
    """(state-dict name -> placement of every stage tensor, id(param) -> its placement)."""
    from ppdsl.runtime.checkpoint.dcp_boxes import sharded

    tp = trainer.groups.layout.tp
    by_name: dict[str, Boxed] = {}
    by_param: dict[int, Boxed] = {}
    params = {id(p): p for p in trainer.params}
    for stage in trainer.stages:
        for name, t in stage.state_dict(keep_vars=True).items():
            path, _, local = name.rpartition(".")
            owner = stage.get_submodule(path) if path else stage
            b = sharded(t.detach(), owner, local, tp)
            by_name[name] = b
            if id(t) in params:
                by_param.setdefault(id(t), b)
    return by_name, by_param


def _aliases(trainer: Trainer) -> dict[str, tuple[str, ...]]:
    """name -> every name of the same tied tensor (itself first)."""
    out: dict[str, tuple[str, ...]] = {}
    for names in trainer.tied_names:
        for n in names:
            out[n] = (n, *[m for m in names if m != n])
    return out


def global_state(trainer: Trainer, step: int) -> tuple[dict[str, Any], dict[str, Boxed]]:
    """(plain entries, boxed entries) of this rank's part of the checkpoint, in global
    coordinates: full model names, full shapes (runtime.checkpoint.dcp_boxes)."""
    import torch

    from ppdsl.runtime.checkpoint.dcp_boxes import local_tensor

    plain: dict[str, Any] = {}
    by_name, by_param = _placements(trainer)
    boxed: dict[str, Boxed] = {}
    for name, b in by_name.items():
        if b.local.dim() == 0:
            plain[f"model/{name}"] = b.local
        else:
            boxed[f"model/{name}"] = b
    aliases = _aliases(trainer)
    for name, p in trainer.named_params:
        for key, v in trainer.optimizer_state(p).items():
            for alias in aliases.get(name, (name,)):  # a tied copy elsewhere finds it under its name
                fqn = f"optim/{alias}/{key}"
                if not isinstance(v, torch.Tensor):
                    plain[f"{fqn}{_OBJ}"] = _obj(v)
                elif v.dim() == 0:
                    plain[fqn] = v
                elif v.shape == p.shape:  # an FSDP2 moment is a DTensor placed like its parameter
                    boxed[fqn] = by_param[id(p)].with_local(local_tensor(v))
                else:
                    raise AssertionError(f"optimizer state {key} of {name} has shape {tuple(v.shape)}, not the parameter's")
    sched = trainer.scheduler.state_dict()
    plain["train/sched"] = _obj({"last_epoch": sched["last_epoch"], "_step_count": sched["_step_count"]})
    plain["train/lr"] = _obj(trainer.optimizer.param_groups[0]["lr"])
    scaler = None if trainer.scaler is None else (trainer.scaler.scale, trainer.scaler._good_steps)
    plain["train/scaler"] = _obj(scaler)
    plain["train/step"] = torch.tensor(step, dtype=torch.int64)
    rng = _rng_prefix(trainer)
    plain[f"{rng}torch"] = torch.get_rng_state()
    if trainer.device.type == "cuda":
        plain[f"{rng}cuda"] = torch.cuda.get_rng_state(trainer.device)
    plain[f"{rng}python"] = _obj(random.getstate())
    return plain, boxed


def load_global_state(trainer: Trainer, path: Path, same_mesh: bool, md: Any = None) -> int:
    """Read this rank's part of the checkpoint at `path` under the current mesh. Collective.
    `md`: its DCP metadata, when already read."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from ppdsl.runtime.checkpoint.dcp_boxes import BoxLoadPlanner, local_tensor

    md = (md or FileSystemReader(str(path)).read_metadata()).state_dict_metadata
    by_name, by_param = _placements(trainer)

    def template(key: str) -> Any:
        m = md[key]
        assert isinstance(m, TensorStorageMetadata), key
        return torch.empty(m.size, dtype=m.properties.dtype)

    plain: dict[str, Any] = {}
    boxed: dict[str, Boxed] = {}
    for name, b in by_name.items():
        if b.local.dim() == 0:
            plain[f"model/{name}"] = b.local
        else:
            boxed[f"model/{name}"] = b
    # optimizer state: fresh tensors shaped like the parameter, for the parameters this rank steps
    optim: dict[int, dict[str, Any]] = {}
    for name, p in trainer.named_params:
        if trainer.optimizer_holding(p) is None:
            continue
        prefix = f"optim/{name}/"
        for key in md:
            if not key.startswith(prefix) or "/" in key[len(prefix):]:
                continue
            m = md[key]
            assert isinstance(m, TensorStorageMetadata), key
            if tuple(m.size) == tuple(by_param[id(p)].global_shape) and len(m.size) > 0:
                # an FSDP2 parameter's: a DTensor like it. Floating state takes the parameter's dtype: a
                # run resumed under another precision (fp64 <-> fp32) steps in its own
                dtype = p.dtype if m.properties.dtype.is_floating_point else m.properties.dtype
                t = torch.empty_like(p, dtype=dtype)
                boxed[key] = by_param[id(p)].with_local(local_tensor(t))
            else:
                t = template(key)
                plain[key] = t
            optim.setdefault(id(p), {})[key[len(prefix):]] = t
    for key in ("train/sched", "train/lr", "train/scaler", "train/step"):
        plain[key] = template(key)
    rng = _rng_prefix(trainer)
    restore_rng = same_mesh and f"{rng}torch" in md
    if restore_rng:
        for key in md:
            if key.startswith(rng):
                plain[key] = template(key)
    planner = BoxLoadPlanner(boxed)
    dcp.load(plain, checkpoint_id=str(path), planner=planner)
    missing = [k for k in planner.missing if k.startswith("model/")]
    if missing:
        raise CheckpointMismatch(f"checkpoint {path} lacks {len(missing)} tensors of this model: {', '.join(missing[:4])}")
    # objects stored as bytes come back in place only for tensors: unpickle them now
    for name, p in trainer.named_params:
        holder = trainer.optimizer_holding(p)
        if holder is None or id(p) not in optim:
            continue
        holder.state[p] = {
            key.removesuffix(_OBJ): _unobj(t) if key.endswith(_OBJ) else t  # Adam's step stays on the CPU
            for key, t in optim[id(p)].items()
        }
    sched = trainer.scheduler.state_dict()
    sched.update(_unobj(plain["train/sched"]))
    lr = _unobj(plain["train/lr"])
    sched["_last_lr"] = [lr] * len(trainer.optimizer.param_groups)
    trainer.scheduler.load_state_dict(sched)
    for g in trainer.optimizer.param_groups:
        g["lr"] = lr
    scaler = _unobj(plain["train/scaler"])
    if trainer.scaler is not None and scaler is not None:
        trainer.scaler.scale, trainer.scaler._good_steps = scaler
    if restore_rng:
        torch.set_rng_state(plain[f"{rng}torch"])
        if trainer.device.type == "cuda" and f"{rng}cuda" in plain:
            torch.cuda.set_rng_state(plain[f"{rng}cuda"], trainer.device)
        random.setstate(_unobj(plain[f"{rng}python"]))
    return int(plain["train/step"])


