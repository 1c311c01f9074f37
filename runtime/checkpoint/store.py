"""Training checkpoints: save, publish atomically, find, check and load.

Layout of ``train.checkpoint.dir``::

    <dir>/step-000010/           a complete checkpoint: torch.distributed.checkpoint files
        .metadata, __0_0.distcp ...  (one data file per rank, written in parallel)
        meta.json                the step, the plan's fingerprint (mesh, stages, model, ...), and
                                 every file with its size and CRC-32 (runtime.checkpoint.find)
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

Resuming (`checkpoint_resume.resume_candidates`, then `Checkpointer.resume`) walks from the newest checkpoint,
skipping unfinished and damaged ones with a line each; the ranks check their shares of the
files and agree before anything is loaded.

What a checkpoint holds is in global coordinates (format 2), so it loads under any mesh:

- ``model/<name>``: every stage tensor under its full-model name at its full (unpadded) shape;
  each rank writes the boxes of it that it holds (``runtime.checkpoint.dcp_boxes``: a plain tp split is one
  box, a fused q|k|v split one per part, vocabulary padding is left out), and replicas of a box
  (dp replicas, tp-replicated tensors, tied copies) are written once; under ZeRO-3 (FSDP2
  DTensors) each dp rank writes the rows it holds, nothing is gathered;
- ``optim/<name>/<key>``: the optimizer state of each parameter (Adam's ``exp_avg`` /
  ``exp_avg_sq`` placed like the parameter, ``step``), written by the rank that steps it (with
  ZeRO-1 its owner, with ZeRO-3 each dp rank its rows); tied copies under each of their names;
- ``train/*``: the step, the LR schedule position and lr, the fp16 loss scale;
- ``rng/dp{d}[.cp{c}].pp{p}.tp{t}/*``: each rank's RNG states, restored only under the same mesh;
- ``meta.json``: the step, the data position in global samples (step * global batch), the
  plan's fingerprint and the identity of the data files the run read (``runtime.data.source``: a
  resume warns when one changed).

Loading asks each rank's boxes under the current mesh (DCP reads only the overlapping saved
chunks); tp, pp (and so the stage split), dp, ZeRO, chunks and schedule style may all differ from
the saved run. The model and optimizer must match, and the global batch: a step's global batch
is a function of (seed, step) alone (runtime.data.source), so the data position is the step.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ppdsl.lowering.plan import Plan

    from ppdsl.runtime.train.trainer import Trainer

from ppdsl.runtime.checkpoint.find import (  # noqa: F401  (the names this module always had)
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
from ppdsl.runtime.checkpoint.resume import (  # noqa: F401  (resume_candidates, resume_decision: the launcher's entry points)
    FORMAT,
    CheckpointMismatch,
    CheckpointUnusable,
    check_compatible,
    fingerprint,
    resume_candidates,
    resume_decision,
    resumed_line,
    skipped_line,
)
from ppdsl.runtime.checkpoint.fs import fsync_dir, recording_fs, with_free_space, write_atomic
from ppdsl.runtime.checkpoint.state import global_state, load_global_state
from ppdsl.runtime.run.failure import CheckpointFault

KEEP = 2  # complete checkpoints kept (the newest ones)
_TMP_RE = TMP_RE


class CheckpointWriteFailed(CheckpointFault):
    """A save failed (disk full, I/O error): nothing of it was published, the previous
    checkpoint is intact; exit 1."""


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
        from ppdsl.runtime.data.identity import data_file_identities

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

        from ppdsl.runtime.checkpoint.dcp_boxes import BoxSavePlanner

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
        writer.fs = fs = recording_fs()
        try:
            # every rank writes and fsyncs its own files (sync_files); DCP gathers the results on
            # rank 0, which writes .metadata: when save returns, every rank's files are durable
            md = dcp.save(plain, storage_writer=writer, planner=BoxSavePlanner(boxed))
            files = {p.name: file_record(p) for p in sorted(tmp.glob(f"__{self.rank}_*.distcp"))}
            fsync_dir(tmp)
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
                failed = with_free_space(failed, self.root)  # measured before the save is removed
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
        write_atomic(tmp / META_FILE, json.dumps(meta, indent=2))
        fsync_dir(tmp)
        if final.exists():  # a checkpoint of the same step (a rerun): replace it only now
            old = self.root / f".{final.name}.old-{tmp.name.rpartition('-')[2]}"
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
        fsync_dir(self.root)
        # published: what follows only points at it and rotates; a failure there loses nothing
        try:
            write_atomic(self.root / "latest", final.name + "\n")
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
        step = load_global_state(trainer, path, same_mesh)
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
                step = load_global_state(trainer, path, same_mesh, md)
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


def _fault(point: str, step: int, rank: int) -> None:
    """Test hook: PPDSL_TEST_FAULT="save:STEP:RANK" kills RANK with SIGKILL after it wrote its
    part of checkpoint STEP, before the checkpoint is published."""
    from ppdsl.runtime.run.failure import test_fault

    test_fault(point, step, rank)
