"""Training checkpoints: save, publish atomically, find, check and load.

Layout of ``train.checkpoint.dir``::

    <dir>/step-000010/           a complete checkpoint: torch.distributed.checkpoint files
        .metadata, __0_0.distcp ...  (one data file per rank, written in parallel)
        meta.json                the step and the plan's fingerprint (mesh, stages, model, ...)
    <dir>/latest                 "step-000010": the newest complete checkpoint
    <dir>/.step-000012.tmp-ab12  a save in progress (or one a killed run left behind)

A save writes everything into a hidden ``.step-N.tmp-<nonce>`` directory; after a barrier
(every rank's files are written), rank 0 writes ``meta.json`` last, renames the directory to
``step-N`` (atomic on one file system) and replaces ``latest`` (write aside + ``os.replace``).
A run killed at any point therefore leaves either the previous complete checkpoint or the new
one, never a half-written ``step-N``; leftover ``.tmp`` directories are ignored by ``find`` and
removed by the next save. The newest ``KEEP`` complete checkpoints are kept.

What a checkpoint holds is in global coordinates (format 2), so it loads under any mesh:

- ``model/<name>``: every stage tensor under its full-model name at its full (unpadded) shape;
  each rank writes the boxes of it that it holds (``runtime.dcp_boxes``: a plain tp split is one
  box, a fused q|k|v split one per part, vocabulary padding is left out), and replicas of a box
  (dp replicas, tp-replicated tensors, tied copies) are written once; under ZeRO-3 (FSDP2
  DTensors) each dp rank writes the rows it holds, nothing is gathered;
- ``optim/<name>/<key>``: the optimizer state of each parameter (Adam's ``exp_avg`` /
  ``exp_avg_sq`` placed like the parameter, ``step``), written by the rank that steps it (with
  ZeRO-1 its owner, with ZeRO-3 each dp rank its rows); tied copies under each of their names;
- ``train/*``: the step, the LR schedule position and lr, the fp16 loss scale;
- ``rng/dp{d}.pp{p}.tp{t}/*``: each rank's RNG states, restored only under the same mesh;
- ``meta.json``: the step, the data position in global samples (step * global batch), the
  plan's fingerprint and the identity of the data files the run read (``runtime.data``: a
  resume warns when one changed).

Loading asks each rank's boxes under the current mesh (DCP reads only the overlapping saved
chunks); tp, pp (and so the stage split), dp, ZeRO, chunks and schedule style may all differ from
the saved run. The model and optimizer must match, and the global batch: a step's global batch
is a function of (seed, step) alone (runtime.data), so the data position is the step.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import secrets
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ppdsl.lowering.plan import Plan

    from .dcp_boxes import Boxed
    from .train import Trainer

KEEP = 2  # complete checkpoints kept (the newest ones)
FORMAT = 2  # 1: per-rank keys (ppdsl before resharding), refused with a message
_STEP_RE = re.compile(r"^step-(\d{6,})$")
_TMP_RE = re.compile(r"^\.step-(\d{6,})\.tmp-[0-9a-f]+$")


class CheckpointMismatch(ValueError):
    """The checkpoint cannot be continued by this plan (another model, optimizer, global batch, format)."""


def step_name(step: int) -> str:
    return f"step-{step:06d}"


# ---------------------------------------------------------------------------------------------
# Finding checkpoints (no torch, no process group: the launcher uses these too)
# ---------------------------------------------------------------------------------------------


def complete_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint under `root`, oldest first. A checkpoint is
    complete when its directory has the published name and holds ``meta.json``."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = _STEP_RE.match(p.name)
        if m and p.is_dir() and (p / "meta.json").is_file():
            out.append((int(m.group(1)), p))
    return sorted(out)


def latest_checkpoint(root: str | Path) -> tuple[int, Path] | None:
    """The newest complete checkpoint: the one ``latest`` names if it is complete, else the
    newest complete directory (``latest`` may lag by one save if a run died between the rename
    and the pointer update)."""
    found = complete_checkpoints(root)
    if not found:
        return None
    pointer = Path(root) / "latest"
    try:
        name = pointer.read_text(encoding="utf-8").strip()
    except OSError:
        name = ""
    by_name = {p.name: (s, p) for s, p in found}
    newest = found[-1]
    if name in by_name and by_name[name][0] >= newest[0]:
        return by_name[name]
    return newest


def read_meta(path: str | Path) -> dict[str, Any]:
    return json.loads((Path(path) / "meta.json").read_text(encoding="utf-8"))


# ---------------------------------------------------------------------------------------------
# The plan's fingerprint
# ---------------------------------------------------------------------------------------------

# must match for a checkpoint to load: the tensors it holds (names, full shapes) and what the
# optimizer state means. The mesh, stage split, tp layers, ZeRO, schedule may all differ: the
# checkpoint is in global coordinates and every rank reads the slices it holds now.
_MUST_MATCH = ("model", "optimizer")


def fingerprint(plan: Plan) -> dict[str, Any]:
    j = plan.to_json()
    t = j["train"]
    return {
        "mesh": {"dp": plan.mesh.dp, "pp": plan.mesh.pp, "tp": plan.mesh.tp},
        "stages": [[s["stage"], s["rank"], s["chunk"], s["block_start"], s["block_stop"]] for s in j["stages"]],
        "tp": j["tp"],
        "sequence_parallel": j["sequence_parallel"],
        "model": j["model"],
        "zero": t["zero"],
        "optimizer": t["optimizer"]["name"],
        "precision": t["precision"],
        # may differ (a note says so); resuming then is no longer the uninterrupted run
        "style": plan.schedule.style,
        "chunks": max((s.chunk for s in plan.stages), default=0) + 1,
        "microbatches": t["microbatches"],
        "seed": t["seed"],
        "steps": t["steps"],
        "data": t["data"],
        "lr": t["optimizer"]["lr"],
        "lr_schedule": t["lr_schedule"],
    }


def _mesh_text(m: dict[str, int]) -> str:
    return f"dp={m['dp']} pp={m['pp']} tp={m['tp']}"


def saved_batching(meta: dict[str, Any]) -> dict[str, int]:
    """The world, mesh and microbatching the checkpoint was saved with: world, dp, tp, pp,
    global_batch, microbatches, microbatch_size (``meta.json`` records world, global_batch and
    microbatch_size besides the fingerprint; checkpoints of format 2 written before it did get
    them derived from the fingerprint and the data position)."""
    f = meta["fingerprint"]
    mesh = f["mesh"]
    gb = meta.get("global_batch") or meta.get("samples", 0) // max(1, meta["step"])
    microbatches = f["microbatches"]
    return {
        "world": meta.get("world") or mesh["dp"] * mesh["pp"] * mesh["tp"],
        **{k: mesh[k] for k in ("dp", "tp", "pp")},
        "global_batch": gb,
        "microbatches": microbatches,
        "microbatch_size": meta.get("microbatch_size") or gb // max(1, mesh["dp"] * microbatches),
    }


def _batching(plan: Plan) -> dict[str, int]:
    m, t = plan.mesh, plan.train
    return {"world": m.world, "dp": m.dp, "tp": m.tp, "pp": m.pp, "global_batch": t.global_batch,
            "microbatches": t.microbatches, "microbatch_size": t.microbatch_size}


def resumed_line(meta: dict[str, Any], plan: Plan, path: str | Path) -> str:
    """The one line a resumed run logs. At another world size (an elastic restart after a node
    was lost or joined, or ``--resume`` with another ``--nproc``) it says what changed and how
    the global batch was kept, e.g. ``ppdsl: resumed step 6 from ck/step-000006 on world 2 (was
    4): dp 2 -> 1, microbatch size 2 -> 4, global batch 16 kept; continuing at step 7``."""
    step = meta["step"]
    was, now = saved_batching(meta), _batching(plan)
    if was["world"] == now["world"]:
        return f"ppdsl: resumed from {path} (step {step}); continuing at step {step + 1}"
    changed = [f"{k.replace('_', ' ')} {was[k]} -> {now[k]}"
               for k in ("dp", "tp", "pp", "microbatches", "microbatch_size") if was[k] != now[k]]
    return (f"ppdsl: resumed step {step} from {path} on world {now['world']} (was {was['world']}): "
            f"{', '.join(changed)}, global batch {now['global_batch']} kept; continuing at step {step + 1}")


def check_compatible(meta: dict[str, Any], plan: Plan, path: str | Path) -> list[str]:
    """Raise CheckpointMismatch when `plan` cannot continue the checkpoint's run; return notes:
    on resharding (another mesh, stage split, ZeRO) and on settings that differ."""
    if meta.get("format") == 1:
        raise CheckpointMismatch(
            f"checkpoint {path} is a per-rank checkpoint (format 1, written before ppdsl saved in global "
            "coordinates); this ppdsl cannot read it. Finish that run with the ppdsl that wrote it, or start "
            "afresh with another train.checkpoint.dir"
        )
    if meta.get("format") != FORMAT:
        raise CheckpointMismatch(f"checkpoint {path} has format {meta.get('format')!r}; this ppdsl reads format {FORMAT}")
    saved, now = meta["fingerprint"], fingerprint(plan)
    differ = [k for k in _MUST_MATCH if saved.get(k) != now.get(k)]
    if differ:
        raise CheckpointMismatch(
            f"checkpoint {path} was saved by a different plan ({', '.join(differ)} differ); it cannot be "
            "loaded. Resume with the spec it was saved with, or use another checkpoint dir"
        )
    gb = plan.train.global_batch
    samples = meta.get("samples", meta["step"] * gb)
    if samples != meta["step"] * gb:
        saved_gb = samples // max(1, meta["step"])
        was = saved_batching(meta)["world"]
        world = "" if was == plan.mesh.world else (
            f" (saved at world {was}, this run has world {plan.mesh.world}: the spec's global batch depends on the world)")
        raise CheckpointMismatch(
            f"checkpoint {path} was saved with global batch {saved_gb} ({samples} samples after step {meta['step']}), "
            f"this run has global batch {gb}{world}; a resumed run keeps the global batch (the data position and the "
            f"LR schedule count steps of it). Resume with --set train.global_batch={saved_gb}"
        )
    notes: list[str] = []
    layout = ("mesh", "stages", "tp", "zero", "style", "chunks", "sequence_parallel")
    # only dp differs (a restart at another world, tp and pp kept): `resumed_line` says it all
    same_but_dp = {**saved, "mesh": {**saved["mesh"], "dp": plan.mesh.dp}}
    if any(same_but_dp.get(k) != now.get(k) for k in layout):
        t = plan.train

        def where(f: dict[str, Any]) -> str:
            return f"mesh {_mesh_text(f['mesh'])}, {f['style']} x {f['chunks']} chunk(s), zero {f['zero']}"

        notes.append(
            f"ppdsl: note: resharding checkpoint {Path(path).name} from {where(saved)} to {where(now)}; global "
            f"batch {gb} unchanged ({gb // plan.mesh.dp} samples per replica in {t.microbatches} microbatches of "
            f"{t.microbatch_size})"
        )
    from .data import changed_data_files

    notes += changed_data_files(meta.get("data_files", {}), path)
    if saved["mesh"] != now["mesh"]:
        notes.append("ppdsl: note: RNG states are per rank and stay behind under another mesh: with dropout, "
                     "the masks after the resume differ from the saved run's")
    reshaped = {*layout, "microbatches"}
    notes += [
        f"ppdsl: note: {k} differs from the checkpoint ({saved.get(k)!r} -> {now.get(k)!r}); "
        "the resumed run is not the uninterrupted one"
        for k in sorted(set(now) - set(_MUST_MATCH) - reshaped)
        if k != "steps" and saved.get(k) != now.get(k)
    ]
    return notes


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
    return f"rng/dp{c['dp']}.pp{c['pp']}.tp{c['tp']}/"


def _placements(trainer: Trainer) -> tuple[dict[str, Boxed], dict[int, Boxed]]:
    """(state-dict name -> placement of every stage tensor, id(param) -> its placement)."""
    from .dcp_boxes import sharded

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
    for names in trainer.api.tied_parameter_groups(trainer.plan):
        for n in names:
            out[n] = (n, *[m for m in names if m != n])
    return out


def global_state(trainer: Trainer, step: int) -> tuple[dict[str, Any], dict[str, Boxed]]:
    """(plain entries, boxed entries) of this rank's part of the checkpoint, in global
    coordinates: full model names, full shapes (runtime.dcp_boxes)."""
    import torch

    from .dcp_boxes import local_tensor

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


def _load_global_state(trainer: Trainer, path: Path, same_mesh: bool) -> int:
    """Read this rank's part of the checkpoint at `path` under the current mesh. Collective."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from .dcp_boxes import BoxLoadPlanner, local_tensor

    md = FileSystemReader(str(path)).read_metadata().state_dict_metadata
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
                t = torch.empty_like(p, dtype=m.properties.dtype)  # an FSDP2 parameter's: a DTensor like it
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


# ---------------------------------------------------------------------------------------------
# Save and load (collective: every rank calls them together)
# ---------------------------------------------------------------------------------------------


@dataclass
class Checkpointer:
    """Saves and loads the checkpoints of one run. `root` is the checkpoint dir."""

    root: Path
    plan: Plan
    rank: int
    keep: int = KEEP
    # rank 0: the identity of the data files the run reads, taken when it starts (meta.json)
    data_files: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from .data import data_file_identities

        if self.rank == 0 and not self.data_files:
            self.data_files = data_file_identities(self.plan)

    def save(self, trainer: Trainer, step: int) -> Path:
        """Write the checkpoint of `step` (steps done) and publish it. Collective."""
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        from .dcp_boxes import BoxSavePlanner

        final = self.root / step_name(step)
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            self._clean_tmp()
            nonce = [secrets.token_hex(4)]
        else:
            nonce = [None]
        dist.broadcast_object_list(nonce, src=0)
        tmp = self.root / f".{step_name(step)}.tmp-{nonce[0]}"
        plain, boxed = global_state(trainer, step)
        dcp.save(plain, checkpoint_id=str(tmp), planner=BoxSavePlanner(boxed))  # parallel, ends with a barrier-like gather
        _fault("save", step, self.rank)
        dist.barrier()
        if self.rank == 0:
            t = self.plan.train
            meta = {"format": FORMAT, "step": step, "samples": step * t.global_batch,
                    "fingerprint": fingerprint(self.plan), "spec_file": self.plan.spec_file,
                    "world": self.plan.mesh.world, "global_batch": t.global_batch,
                    "microbatch_size": t.microbatch_size, "data_files": self.data_files}
            _write_atomic(tmp / "meta.json", json.dumps(meta, indent=2))
            if final.exists():  # a checkpoint of the same step (a rerun): replace it only now
                old = self.root / f".{step_name(step)}.old-{nonce[0]}"
                os.rename(final, old)
                os.rename(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.rename(tmp, final)
            _fsync_dir(self.root)
            _write_atomic(self.root / "latest", final.name + "\n")
            self._prune(keep_step=step)
        dist.barrier()
        return final

    def load(self, trainer: Trainer, path: Path) -> int:
        """Load the checkpoint at `path` into `trainer`, under this run's mesh (each rank reads
        only the slices it holds). Collective. Returns its step."""
        meta = read_meta(path)
        check_compatible(meta, self.plan, path)
        same_mesh = meta["fingerprint"]["mesh"] == fingerprint(self.plan)["mesh"]
        step = _load_global_state(trainer, path, same_mesh)
        assert step == meta["step"], (step, meta["step"])
        return step

    def _clean_tmp(self) -> None:
        for p in self.root.iterdir():
            if (_TMP_RE.match(p.name) or re.match(r"^\.step-\d{6,}\.old-[0-9a-f]+$", p.name)) and p.is_dir():
                shutil.rmtree(p, ignore_errors=True)

    def _prune(self, keep_step: int) -> None:
        found = complete_checkpoints(self.root)
        for s, p in found[: max(0, len(found) - self.keep)]:
            if s != keep_step:
                shutil.rmtree(p, ignore_errors=True)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{secrets.token_hex(4)}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fault(point: str, step: int, rank: int) -> None:
    """Test hook: PPDSL_TEST_FAULT="save:STEP:RANK" kills RANK with SIGKILL after it wrote its
    part of checkpoint STEP, before the checkpoint is published."""
    from .failure import test_fault

    test_fault(point, step, rank)


def resume_decision(plan: Plan, resume: bool, restarted: bool = False) -> tuple[str | None, list[str]]:
    """Where a run starts: (path of the checkpoint to load, or None for a fresh start; notes).
    Raises ValueError (CheckpointMismatch) when it must not start: ``--resume`` without a
    checkpoint block, a checkpoint of another model, optimizer or global batch, or a fresh start into a checkpoint
    dir that already holds checkpoints (it would overwrite and prune them)."""
    ckpt = plan.train.checkpoint
    if ckpt is None:
        if resume:
            raise ValueError("--resume needs a checkpoint block in the spec: train { checkpoint { dir = \"...\", every = N } }")
        return None, []
    found = latest_checkpoint(ckpt.dir)
    if not (resume or restarted):
        if found is not None:
            raise ValueError(
                f"checkpoint dir {ckpt.dir} already holds checkpoints (newest: {found[1].name}); "
                "pass --resume to continue that run, or set another train.checkpoint.dir to start afresh "
                "(nothing was changed)"
            )
        return None, []
    if found is None:
        why = "restarted" if restarted and not resume else "--resume"
        return None, [f"ppdsl: note: {why}: no complete checkpoint in {ckpt.dir}; starting from step 1"]
    step, path = found
    notes = check_compatible(read_meta(path), plan, path)
    if step >= plan.train.steps:
        notes.append(f"ppdsl: note: checkpoint {path.name} is at step {step}, train.steps = {plan.train.steps}: nothing to train")
    return str(path), notes
