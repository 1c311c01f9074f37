"""Which checkpoint a run continues from, and whether this plan may continue it.

A checkpoint holds the plan's fingerprint (`fingerprint`); `check_compatible` compares it with
the plan of the run that would resume it: another model, optimizer, global batch or format
refuses, everything else (mesh, stage split, tp layers, ZeRO, schedule) may differ, since the
state is in global coordinates. `resume_candidates` walks the checkpoint dir from the newest
checkpoint, skipping damaged ones with a line each (`checkpoint_find.problem`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from ppdsl.runtime.checkpoint.find import problem, scan
from ppdsl.runtime.run.failure import CheckpointFault

if TYPE_CHECKING:
    from ppdsl.lowering.plan import Plan

FORMAT = 2  # 1: per-rank keys (ppdsl before resharding), refused with a message


class CheckpointMismatch(ValueError):
    """The checkpoint cannot be continued by this plan (another model, optimizer, global batch, format)."""


class CheckpointUnusable(CheckpointFault, ValueError):
    """No checkpoint the run may resume from, though some are there (damaged): refused, exit 2,
    nothing changed."""

    exit_code = 2


# ---------------------------------------------------------------------------------------------
# The plan's fingerprint
# ---------------------------------------------------------------------------------------------

# must match for a checkpoint to load: the tensors it holds (names, full shapes) and what the
# optimizer state means. The mesh, stage split, tp layers, ZeRO, schedule may all differ: the
# checkpoint is in global coordinates and every rank reads the slices it holds now.
_MUST_MATCH = ("model", "optimizer")
# model config keys that choose a kernel, not the weights: a run may resume under another (fp64
# builds HF models with experts_implementation = eager)
_KERNEL_KEYS = frozenset({"attn_implementation", "experts_implementation"})


def _weights_of(key: str, value: Any) -> Any:
    """A fingerprint entry as far as it decides the saved tensors."""
    if key != "model" or not isinstance(value, dict):
        return value
    # the source and its config decide the tensors; the family (which forward runs them: a class
    # whose family was deleted runs its own forward on the same parameter names), the dims derived
    # from the config and document_masks (how masks are built) do not
    return {"kind": value.get("kind"), "target": value.get("target"),
            "config": [kv for kv in value.get("config", []) if kv[0] not in _KERNEL_KEYS]}


def fingerprint(plan: Plan) -> dict[str, Any]:
    j = plan.to_json()
    t = j["train"]
    return {
        # ep, cp only where used: checkpoints of runs without them say the same as before
        "mesh": {"dp": plan.mesh.dp, "pp": plan.mesh.pp, "tp": plan.mesh.tp,
                 **{k: v for k, v in (("ep", plan.mesh.ep), ("cp", plan.mesh.cp)) if v > 1}},
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
        "microbatches": plan.schedule.microbatches,
        "seed": t["seed"],
        "steps": t["steps"],
        "data": t["data"],
        "lr": t["optimizer"]["lr"],
        "lr_schedule": t["lr_schedule"],
    }


def _mesh_text(m: dict[str, int]) -> str:
    return f"dp={m['dp']} pp={m['pp']} tp={m['tp']}" + "".join(
        f" {k}={m[k]}" for k in ("ep", "cp") if m.get(k, 1) > 1)


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
        "world": meta.get("world") or mesh["dp"] * mesh.get("cp", 1) * mesh["pp"] * mesh["tp"],
        **{k: mesh[k] for k in ("dp", "tp", "pp")},
        "global_batch": gb,
        "microbatches": microbatches,
        "microbatch_size": meta.get("microbatch_size") or gb // max(1, mesh["dp"] * microbatches),
    }


def _batching(plan: Plan) -> dict[str, int]:
    m, t = plan.mesh, plan.train
    return {"world": m.world, "dp": m.dp, "tp": m.tp, "pp": m.pp, "global_batch": t.global_batch,
            "microbatches": plan.schedule.microbatches, "microbatch_size": t.microbatch_size}


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
    differ = [k for k in _MUST_MATCH if _weights_of(k, saved.get(k)) != _weights_of(k, now.get(k))]
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
            f"batch {gb} unchanged ({gb // plan.mesh.dp} samples per replica in {plan.schedule.microbatches} "
            f"microbatches of {t.microbatch_size})"
        )
    from ppdsl.runtime.data.identity import changed_data_files

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


def skipped_line(path: str | Path, why: str) -> str:
    return f"ppdsl: note: skipped checkpoint {path}: {why}"


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
