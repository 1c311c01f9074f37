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

What each rank saves, every key prefixed with its mesh coordinate ``dp{d}.pp{p}.tp{t}/`` (so a
checkpoint loads exactly under the same mesh, and is refused under another one):

- each of its pipeline stages' ``state_dict()`` (parameters under their full-model names, TP
  shards as they are, buffers);
- its optimizer's state (ZeroRedundancyOptimizer: this rank's shard, the local optimizer);
- the LR schedule, the fp16 loss scale, the torch / CUDA / Python RNG states.

Data needs no state: a step's batch is a pure function of (seed, step, dp rank), so the data
position is the step number in ``meta.json``.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ppdsl.lowering.plan import Plan

    from .train import Trainer

KEEP = 2  # complete checkpoints kept (the newest ones)
FORMAT = 1
_STEP_RE = re.compile(r"^step-(\d{6,})$")
_TMP_RE = re.compile(r"^\.step-(\d{6,})\.tmp-[0-9a-f]+$")


class CheckpointMismatch(ValueError):
    """The checkpoint was written by a plan this run cannot load exactly (another mesh, ...)."""


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

# must match for a checkpoint to load: they fix which tensors each rank holds and their shapes
# what decides the saved tensors' names, shapes and meaning (sequence parallelism does not: it
# changes how activations travel, not what a rank holds)
_MUST_MATCH = ("mesh", "stages", "tp", "model", "zero", "optimizer", "precision")


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


def check_compatible(meta: dict[str, Any], plan: Plan, path: str | Path) -> list[str]:
    """Raise CheckpointMismatch when `plan` cannot load the checkpoint exactly; return notes
    on settings that differ but do not prevent loading."""
    if meta.get("format") != FORMAT:
        raise CheckpointMismatch(f"checkpoint {path} has format {meta.get('format')!r}; this ppdsl reads format {FORMAT}")
    saved, now = meta["fingerprint"], fingerprint(plan)
    if saved["mesh"] != now["mesh"]:
        raise CheckpointMismatch(
            f"checkpoint {path} was saved with mesh {_mesh_text(saved['mesh'])}, but this run has mesh "
            f"{_mesh_text(now['mesh'])}; loading under a different mesh is not supported. Resume with the "
            f"saved mesh (--set mesh.dp={saved['mesh']['dp']} --set mesh.pp={saved['mesh']['pp']} "
            f"--set mesh.tp={saved['mesh']['tp']}), or use another checkpoint dir to start afresh"
        )
    differ = [k for k in _MUST_MATCH if saved.get(k) != now.get(k)]
    if differ:
        raise CheckpointMismatch(
            f"checkpoint {path} was saved by a different plan ({', '.join(differ)} differ); it cannot be "
            "loaded exactly. Resume with the spec it was saved with, or use another checkpoint dir"
        )
    return [
        f"ppdsl: note: {k} differs from the checkpoint ({saved.get(k)!r} -> {now.get(k)!r}); "
        "the resumed run is not the uninterrupted one"
        for k in sorted(set(now) - set(_MUST_MATCH))
        if k != "steps" and saved.get(k) != now.get(k)
    ]


# ---------------------------------------------------------------------------------------------
# State of one rank
# ---------------------------------------------------------------------------------------------


def _obj(value: Any) -> Any:
    """A picklable object as a uint8 tensor (DCP would otherwise flatten lists and dicts)."""
    import torch

    data = pickle.dumps(value)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()


def _unobj(t: Any) -> Any:
    return pickle.loads(t.numpy().tobytes())


def _prefix(trainer: Trainer) -> str:
    c = trainer.groups.coords
    return f"dp{c['dp']}.pp{c['pp']}.tp{c['tp']}/"


def _local_optimizer(trainer: Trainer) -> Any:
    """The optimizer whose state this rank holds: ZeRO's local shard optimizer, or the optimizer."""
    return getattr(trainer.optimizer, "optim", trainer.optimizer)


def rank_state(trainer: Trainer, step: int) -> dict[str, Any]:
    """This rank's flat state dict (every value a tensor, every key unique to the rank)."""
    import torch

    pre = _prefix(trainer)
    out: dict[str, Any] = {}
    for k, stage in enumerate(trainer.stages):
        for name, t in stage.state_dict().items():
            out[f"{pre}model/{k}/{name}"] = t.detach()
    osd = _local_optimizer(trainer).state_dict()
    for idx, st in osd["state"].items():
        for key, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"{pre}optim/state/{idx}/{key}"] = v
            else:
                out[f"{pre}optim/obj/{idx}/{key}"] = _obj(v)
    out[f"{pre}optim/param_groups"] = _obj(osd["param_groups"])
    out[f"{pre}optim/lrs"] = _obj([g["lr"] for g in trainer.optimizer.param_groups])
    out[f"{pre}sched"] = _obj(trainer.scheduler.state_dict())
    scaler = None if trainer.scaler is None else (trainer.scaler.scale, trainer.scaler._good_steps)
    out[f"{pre}scaler"] = _obj(scaler)
    out[f"{pre}rng/torch"] = torch.get_rng_state()
    if trainer.device.type == "cuda":
        out[f"{pre}rng/cuda"] = torch.cuda.get_rng_state(trainer.device)
    out[f"{pre}rng/python"] = _obj(random.getstate())
    out[f"{pre}step"] = torch.tensor(step, dtype=torch.int64)
    return out


def apply_rank_state(trainer: Trainer, flat: dict[str, Any]) -> int:
    """Load `flat` (this rank's keys, as `rank_state` made them) into the trainer; returns the step."""
    import torch

    pre = _prefix(trainer)
    mine = {k[len(pre):]: v for k, v in flat.items() if k.startswith(pre)}
    for k, stage in enumerate(trainer.stages):
        sd = {n[len(f"model/{k}/"):]: v for n, v in mine.items() if n.startswith(f"model/{k}/")}
        stage.load_state_dict(sd, strict=True)
    state: dict[int, dict[str, Any]] = {}
    for n, v in mine.items():
        for kind in ("optim/state/", "optim/obj/"):
            if n.startswith(kind):
                idx, key = n[len(kind):].split("/", 1)
                state.setdefault(int(idx), {})[key] = v if kind == "optim/state/" else _unobj(v)
    _local_optimizer(trainer).load_state_dict({"state": state, "param_groups": _unobj(mine["optim/param_groups"])})
    trainer.scheduler.load_state_dict(_unobj(mine["sched"]))
    for g, lr in zip(trainer.optimizer.param_groups, _unobj(mine["optim/lrs"])):
        g["lr"] = lr
    scaler = _unobj(mine["scaler"])
    if trainer.scaler is not None and scaler is not None:
        trainer.scaler.scale, trainer.scaler._good_steps = scaler
    torch.set_rng_state(mine["rng/torch"])
    if trainer.device.type == "cuda" and "rng/cuda" in mine:
        torch.cuda.set_rng_state(mine["rng/cuda"], trainer.device)
    random.setstate(_unobj(mine["rng/python"]))
    return int(mine["step"])


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

    def save(self, trainer: Trainer, step: int) -> Path:
        """Write the checkpoint of `step` (steps done) and publish it. Collective."""
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        final = self.root / step_name(step)
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            self._clean_tmp()
            nonce = [secrets.token_hex(4)]
        else:
            nonce = [None]
        dist.broadcast_object_list(nonce, src=0)
        tmp = self.root / f".{step_name(step)}.tmp-{nonce[0]}"
        dcp.save(rank_state(trainer, step), checkpoint_id=str(tmp))  # parallel, ends with a barrier-like gather
        _fault("save", step, self.rank)
        dist.barrier()
        if self.rank == 0:
            meta = {"format": FORMAT, "step": step, "fingerprint": fingerprint(self.plan),
                    "spec_file": self.plan.spec_file, "world": self.plan.mesh.world}
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
        """Load the checkpoint at `path` into `trainer`. Collective. Returns its step."""
        import torch
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        check_compatible(read_meta(path), self.plan, path)
        pre = _prefix(trainer)
        md = FileSystemReader(str(path)).read_metadata()
        template: dict[str, Any] = {}
        for k, m in md.state_dict_metadata.items():
            if k.startswith(pre):
                if not isinstance(m, TensorStorageMetadata):
                    raise CheckpointMismatch(f"checkpoint {path}: unexpected entry {k!r}")
                template[k] = torch.empty(m.size, dtype=m.properties.dtype)
        if not template:
            raise CheckpointMismatch(f"checkpoint {path} holds no state for mesh coordinate {pre[:-1]}")
        dcp.load(template, checkpoint_id=str(path))
        return apply_rank_state(trainer, template)

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
    checkpoint block, a checkpoint of another mesh or plan, or a fresh start into a checkpoint
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
