"""Training checkpoints: save, publish atomically, find, check and load.

Layout of ``train.checkpoint.dir``::

    <dir>/step-000010/           a complete checkpoint: torch.distributed.checkpoint files
        .metadata, __0_0.distcp ...  (one data file per rank, written in parallel)
        meta.json                the step, the plan's fingerprint (mesh, stages, model, ...), and
                                 every file with its size and CRC-32 (runtime.checkpoint_find)
    <dir>/latest                 "step-000010": the newest complete checkpoint (a hint)
    <dir>/.step-000012.tmp-ab12  a save in progress (or one a killed run left behind)

A save writes everything into a hidden ``.step-N.tmp-<nonce>`` directory; every rank fsyncs
its files before DCP gathers the results on rank 0 (so on several nodes too), sums them, and
the ranks agree on the outcome; then rank 0 writes ``meta.json`` last, renames the directory to
``step-N`` (atomic on one file system) and replaces ``latest`` (write aside + ``os.replace``).
A run killed at any point therefore leaves either the previous complete checkpoint or the new
one, never a half-written ``step-N``; leftover ``.tmp`` directories are skipped by resume and
removed by the next save. A save that fails (disk full) is removed and ends the run on every
rank together (CheckpointWriteFailed). The newest ``KEEP`` intact checkpoints are kept.

Resuming (`resume_candidates`, then `Checkpointer.resume`) walks from the newest checkpoint,
skipping unfinished and damaged ones with a line each; the ranks check their shares of the
files and agree before anything is loaded.

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

import errno
import json
import os
import pickle
import random
import secrets
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ppdsl.lowering.plan import Plan

    from .dcp_boxes import Boxed
    from .train import Trainer

from .checkpoint_find import (  # noqa: F401  (the names this module always had)
    DCP_METADATA,
    META_FILE,
    OLD_RE,
    TMP_RE,
    complete_checkpoints,
    file_record,
    latest_checkpoint,
    problem,
    read_meta,
    scan,
    share_problem,
    step_name,
)
from .failure import RunFault

KEEP = 2  # complete checkpoints kept (the newest ones)
FORMAT = 2  # 1: per-rank keys (ppdsl before resharding), refused with a message
_TMP_RE = TMP_RE


class CheckpointMismatch(ValueError):
    """The checkpoint cannot be continued by this plan (another model, optimizer, global batch, format)."""


class CheckpointFault(RunFault):
    """A checkpoint fault every rank agreed on (they all raise it at the same point): the run
    ends with one message from rank 0, the ranks leaving the process group together."""

    def __init__(self, message: str) -> None:
        super().__init__(message, agreed=True)


class CheckpointUnusable(CheckpointFault, ValueError):
    """No checkpoint the run may resume from, though some are there (damaged): refused, exit 2,
    nothing changed."""

    exit_code = 2


class CheckpointWriteFailed(CheckpointFault):
    """A save failed (disk full, I/O error): nothing of it was published, the previous
    checkpoint is intact; exit 1."""


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


def _load_global_state(trainer: Trainer, path: Path, same_mesh: bool, md: Any = None) -> int:
    """Read this rank's part of the checkpoint at `path` under the current mesh. Collective.
    `md`: its DCP metadata, when already read."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from .dcp_boxes import BoxLoadPlanner, local_tensor

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


@dataclass(frozen=True)
class Resumed:
    """What `Checkpointer.resume` loaded: its step and path, and the lines rank 0 logs (the
    checkpoints skipped, the resumed line)."""

    step: int
    path: Path
    lines: tuple[str, ...]


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
        """Write the checkpoint of `step` (steps done) and publish it. Collective: the ranks
        agree on the outcome, so a failed write (disk full) raises CheckpointWriteFailed on
        every rank, after rank 0 removed the unpublished save."""
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemWriter
        from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

        from .dcp_boxes import BoxSavePlanner

        final = self.root / step_name(step)
        box: list[Any] = [None]
        if self.rank == 0:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                self._clean_tmp()
                box = [("ok", secrets.token_hex(4))]
            except OSError as exc:
                box = [("error", _reason(exc, 0))]
        dist.broadcast_object_list(box, src=0)
        kind, nonce = box[0]
        if kind == "error":
            raise CheckpointWriteFailed(self._failed(step, nonce))
        tmp = self.root / f".{step_name(step)}.tmp-{nonce}"
        plain, boxed = global_state(trainer, step)
        error, files, md = None, {}, None
        writer = FileSystemWriter(str(tmp), sync_files=True)
        writer.fs = fs = _recording_fs()
        try:
            # every rank writes and fsyncs its own files (sync_files); DCP gathers the results on
            # rank 0, which writes .metadata: when save returns, every rank's files are durable
            md = dcp.save(plain, storage_writer=writer, planner=BoxSavePlanner(boxed))
            files = {p.name: file_record(p) for p in sorted(tmp.glob(f"__{self.rank}_*.distcp"))}
            _fsync_dir(tmp)
        except (Exception, CheckpointException) as exc:  # DCP raises on every rank when any rank's write failed
            own = fs.error  # this rank's OSError, which torch's zip writer reports as "unexpected pos"
            error = (own is not None, _reason(exc if own is None else own, self.rank))
        _fault("save", step, self.rank)
        reports = _all_gather((error, files))
        verdict: list[Any] = [None]
        if self.rank == 0:
            errors = sorted((e for e, _ in reports if e), key=lambda e: not e[0])  # an OSError first
            failed = errors[0][1] if errors else None
            if failed is None:
                written = {name: rec for _, f in reports for name, rec in f.items()}
                try:
                    self._publish(tmp, final, step, written, md)
                except OSError as exc:
                    failed = _reason(exc, 0)
            if failed is not None:
                failed = _with_free_space(failed, self.root)  # measured before the save is removed
                shutil.rmtree(tmp, ignore_errors=True)
                verdict = [self._failed(step, failed)]
        dist.broadcast_object_list(verdict, src=0)
        if verdict[0] is not None:
            raise CheckpointWriteFailed(verdict[0])
        return final

    def _publish(self, tmp: Path, final: Path, step: int, files: dict[str, dict[str, int]], md: Any) -> None:
        """Rank 0, once every rank's files are written: meta.json last, then the rename."""
        for si in getattr(md, "storage_data", {}).values():  # a file no rank reported (none expected)
            if si.relative_path not in files:
                files[si.relative_path] = file_record(tmp / si.relative_path)
        files[DCP_METADATA] = file_record(tmp / DCP_METADATA)
        t = self.plan.train
        meta = {"format": FORMAT, "step": step, "samples": step * t.global_batch,
                "fingerprint": fingerprint(self.plan), "spec_file": self.plan.spec_file,
                "world": self.plan.mesh.world, "global_batch": t.global_batch,
                "microbatch_size": t.microbatch_size, "data_files": self.data_files,
                "files": dict(sorted(files.items()))}
        _write_atomic(tmp / META_FILE, json.dumps(meta, indent=2))
        _fsync_dir(tmp)
        if final.exists():  # a checkpoint of the same step (a rerun): replace it only now
            old = self.root / f".{final.name}.old-{tmp.name.rpartition('-')[2]}"
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
        _fsync_dir(self.root)
        # published: what follows only points at it and rotates; a failure there loses nothing
        try:
            _write_atomic(self.root / "latest", final.name + "\n")
            self._prune(keep_step=step)
        except OSError as exc:
            print(f"ppdsl: warning: checkpoint {final} is complete, but updating {self.root / 'latest'} or "
                  f"removing older checkpoints failed: {_reason(exc, 0)}", file=sys.stderr, flush=True)

    def _failed(self, step: int, why: str) -> str:
        previous = next((p for s, p in reversed(complete_checkpoints(self.root))
                         if s != step and problem(p)[0] is None), None)
        kept = ("there is no earlier checkpoint" if previous is None
                else f"the previous checkpoint {previous.name} is intact")
        return f"checkpoint {step_name(step)} could not be written to {self.root}: {why}; {kept}"

    def load(self, trainer: Trainer, path: Path) -> int:
        """Load the checkpoint at `path` into `trainer`, under this run's mesh (each rank reads
        only the slices it holds). Collective. Returns its step."""
        meta = read_meta(path)
        check_compatible(meta, self.plan, path)
        same_mesh = meta["fingerprint"]["mesh"] == fingerprint(self.plan)["mesh"]
        step = _load_global_state(trainer, path, same_mesh)
        assert step == meta["step"], (step, meta["step"])
        return step

    def resume(self, trainer: Trainer, candidates: list[str] | list[Path]) -> Resumed:
        """Load the first of `candidates` (`resume_candidates`, newest first) that every rank
        finds intact: the ranks check their shares of its files (`share_problem`) and agree
        before anything is read into `trainer`, so a damaged or vanished checkpoint is skipped
        with a line and the next one tried. Raises CheckpointUnusable (on every rank) when none
        is left, or when the load itself fails (nothing of the run was written yet)."""
        import torch.distributed as dist
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

        world = dist.get_world_size()
        lines: list[str] = []
        skipped: list[str] = []
        for path in map(Path, candidates):
            md = None
            try:
                why, meta = share_problem(path, self.rank, world)
                if why is None:
                    md = FileSystemReader(str(path)).read_metadata()
            except (Exception, CheckpointException) as exc:
                why, meta = f"{DCP_METADATA} is unreadable ({_reason(exc, self.rank)})", None
            why = _first(_all_gather(why))
            if why is not None:
                lines.append(skipped_line(path, why))
                skipped.append(f"{path.name}: {why}")
                continue
            assert meta is not None
            err = None
            try:
                same_mesh = meta["fingerprint"]["mesh"] == fingerprint(self.plan)["mesh"]
                step = _load_global_state(trainer, path, same_mesh, md)
                if step != meta["step"]:
                    err = f"{META_FILE} records step {meta['step']}, its tensors step {step}"
            except CheckpointMismatch as exc:
                err = str(exc)
            except (Exception, CheckpointException) as exc:  # DCP raises on every rank when any rank's read failed
                err = _reason(exc, self.rank)
            err = _first(_all_gather(err))
            if err is not None:
                raise CheckpointUnusable(f"checkpoint {path} could not be loaded: {err}; nothing was changed")
            lines.append(resumed_line(meta, self.plan, path))
            if step >= self.plan.train.steps:
                lines.append(f"ppdsl: note: checkpoint {path.name} is at step {step}, train.steps = "
                             f"{self.plan.train.steps}: nothing to train")
            return Resumed(step, path, tuple(lines))
        raise CheckpointUnusable(
            f"no intact checkpoint in {self.root} ({'; '.join(skipped)}); nothing was changed. Move the dir "
            "aside (or set another train.checkpoint.dir) to start afresh")

    def _clean_tmp(self) -> None:
        for p in self.root.iterdir():
            if (TMP_RE.match(p.name) or OLD_RE.match(p.name)) and p.is_dir():
                shutil.rmtree(p, ignore_errors=True)

    def _prune(self, keep_step: int) -> None:
        """Keep the newest `keep` intact checkpoints, `keep_step` and the one ``latest`` names;
        remove the checkpoints older than all of them (intact or not). Damaged ones newer than
        a kept one stay: a later save of their step replaces them."""
        found = complete_checkpoints(self.root)
        intact = [s for s, p in found if problem(p)[0] is None]
        pointed = latest_checkpoint(self.root)
        kept = {*intact[-self.keep:], keep_step, *([] if pointed is None else [pointed[0]])}
        for s, p in found:
            if s < min(kept):
                shutil.rmtree(p, ignore_errors=True)


def skipped_line(path: str | Path, why: str) -> str:
    return f"ppdsl: note: skipped checkpoint {path}: {why}"


def _all_gather(obj: Any) -> list[Any]:
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _first(values: list[Any]) -> Any:
    return next((v for v in values if v is not None), None)


def _reason(exc: BaseException, rank: int) -> str:
    """One line for an error of a checkpoint write or read: an OSError's own words (``No space
    left on device``) and file. DCP's CheckpointException holds every failed rank's error: an
    OSError among them (or in their chains) is the cause, whichever rank it was (torch's
    writer turns the one it sees into ``RuntimeError: ... unexpected pos``)."""
    from torch.distributed.checkpoint.api import CheckpointException

    errors = [(rank, exc)]
    if isinstance(exc, CheckpointException) and exc.failures:
        errors = [(r, f[0] if isinstance(f, tuple) else f) for r, f in sorted(exc.failures.items())]
    for r, e in errors:
        seen: BaseException | None = e
        while seen is not None:
            if isinstance(seen, OSError) and seen.strerror:
                name = f"{Path(str(seen.filename)).name}, " if seen.filename else ""
                return f"{seen.strerror} ({name}rank {r})"
            seen = seen.__cause__ or seen.__context__
    r, e = errors[0]
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200] if text else ''} (rank {r})"


def _recording_fs() -> Any:
    """DCP's file system, remembering the first OSError a write raised (``error``)."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    class Recording(FileSystem):
        error: OSError | None = None

        @contextmanager
        def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
            try:
                with super().create_stream(path, mode) as stream:
                    yield _Guarded(stream, self) if "w" in mode else stream
            except OSError as exc:
                self.error = self.error or exc
                raise

    return Recording()


class _Guarded:
    """A stream whose failing write is remembered by `fs` before it propagates."""

    def __init__(self, stream: Any, fs: Any) -> None:
        self._stream, self._fs = stream, fs

    def write(self, data: Any) -> int:
        try:
            return self._stream.write(data)
        except OSError as exc:
            self._fs.error = self._fs.error or exc
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _with_free_space(why: str, root: Path) -> str:
    """`why`, said as a full disk when the error did not say so but the file system is full."""
    try:
        free = shutil.disk_usage(root).free
    except OSError:
        return why
    if free < (1 << 20) and os.strerror(errno.ENOSPC) not in why:
        return f"{os.strerror(errno.ENOSPC)} ({free} bytes free; {why})"
    return why


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{secrets.token_hex(4)}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


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


def resume_candidates(plan: Plan, resume: bool, restarted: bool = False) -> tuple[list[str], list[str]]:
    """Where a run starts: (the checkpoints it may load, newest first - empty for a fresh start;
    notes). Walking from the newest, a checkpoint that is damaged (`problem`: meta.json or
    .metadata unreadable, a file missing or truncated) or a save that did not finish is
    skipped with a note; the first intact one decides whether this plan may continue the run
    (`check_compatible`: another model, optimizer, global batch or format refuses - the dir
    holds another run). The older intact ones of this plan follow it, for `Checkpointer.resume`
    to fall back on. Raises ValueError when the run must not start: ``--resume`` without a
    checkpoint block, a mismatch, a fresh start into a dir that already holds checkpoints (it
    would overwrite and prune them), or checkpoints none of which is intact (CheckpointUnusable)."""
    ckpt = plan.train.checkpoint
    if ckpt is None:
        if resume:
            raise ValueError("--resume needs a checkpoint block in the spec: train { checkpoint { dir = \"...\", every = N } }")
        return [], []
    entries = scan(ckpt.dir)
    published = [e for e in entries if not e.tmp]
    if not (resume or restarted):
        if published:
            raise ValueError(
                f"checkpoint dir {ckpt.dir} already holds checkpoints (newest: {published[0].path.name}); "
                "pass --resume to continue that run, or set another train.checkpoint.dir to start afresh "
                "(nothing was changed)"
            )
        return [], []
    usable: list[str] = []
    notes: list[str] = []
    skipped: list[str] = []
    for e in entries:
        if e.tmp:
            if not usable:
                notes.append(skipped_line(e.path, "incomplete (a save that did not finish)"))
            continue
        why, meta = problem(e.path)
        if why is not None:
            if not usable:
                notes.append(skipped_line(e.path, why))
                skipped.append(f"{e.path.name}: {why}")
            continue
        assert meta is not None
        try:
            compat = check_compatible(meta, plan, e.path)
        except CheckpointMismatch:
            if not usable:
                raise
            continue  # an older checkpoint of another plan is no fallback
        if not usable:
            notes += compat
        usable.append(str(e.path))
    if not usable and published:
        raise CheckpointUnusable(
            f"no intact checkpoint in {ckpt.dir} ({'; '.join(skipped)}); nothing was changed. Move the dir "
            "aside (or set another train.checkpoint.dir) to start afresh"
        )
    if not usable:
        why = "restarted" if restarted and not resume else "--resume"
        notes.append(f"ppdsl: note: {why}: no complete checkpoint in {ckpt.dir}; starting from step 1")
    return usable, notes


def resume_decision(plan: Plan, resume: bool, restarted: bool = False) -> tuple[str | None, list[str]]:
    """`resume_candidates`' first checkpoint (None for a fresh start) and its notes."""
    usable, notes = resume_candidates(plan, resume, restarted)
    return (usable[0] if usable else None), notes
