"""What each stage boundary carries (`Plan.boundaries`), from check's meta trace of the model's own
forward (dsl/own_layout.py `OwnLayout.block_shapes`; dsl/own_cut_proof.py proved the cut at each).

- a model fed images: the hidden state entering the first block of the receiving stage, as traced
  (ViT's (positions, hidden); ConvNext's (channels, height, width) and Swin's (patches, width),
  which change between blocks), behind the microbatch dimension (check refuses what would split
  them: sequence parallelism under the own forward, E0423; context parallelism of images, E0436);
- a model fed token ids: (microbatch, seq_len / cp [/ tp with sequence parallelism], width), the
  traced width (a trace of a token model is at its own length, not the spec's seq_len);
- after the hidden state, what the receiving block reads of the sending block's output besides it
  (`OwnLayout.carried`: T5's position bias, (microbatch, heads, seq_len, seq_len));
- a family's model: none recorded; the runtime's boundaries are (microbatch, seq, hidden)
  (`runtime.stage.build.activation_shape`).

Pure Python, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ppdsl.core.own_cut import carried_at

from .memory import value_bytes
from .plan import Boundary, BoundaryTensor, MeshLayout, Plan, StageAssignment, TrainPlan

if TYPE_CHECKING:
    from ppdsl.dsl.introspect import ModelInfo

__all__ = ["boundaries", "boundary_bytes", "splits_sequence", "uniform_boundaries"]


def splits_sequence(shape: Sequence[int], positions: int) -> bool:
    """A boundary whose per-sample shape sequence parallelism can split: (positions, hidden)."""
    return len(shape) == 2 and shape[0] == positions


def boundaries(info: ModelInfo | None, stages: Sequence[StageAssignment], mesh: MeshLayout, train: TrainPlan,
               sequence_parallel: bool, hidden: int | None) -> tuple[Boundary, ...]:
    """One `Boundary` per stage but the last; () where the trace does not say (a family's model,
    no model, a token model of unknown width)."""
    layout = getattr(info, "own_layout", None)
    if layout is None or not layout.ok:
        return ()
    sp = mesh.tp if sequence_parallel and mesh.tp > 1 else 1
    out = []
    for s in stages[:-1]:
        if layout.inputs == "pixels":
            traced = tuple(layout.block_shapes[s.block_stop]) if s.block_stop < len(layout.block_shapes) else ()
            if not traced:
                return ()
            if sp > 1:
                assert splits_sequence(traced, train.seq_len), \
                    f"sequence parallelism over a boundary of shape {traced} (E0423: not for the own forward)"
                traced = (traced[0] // sp, *traced[1:])
            shape = (train.microbatch_size, *traced)
        else:
            width = layout.width or hidden
            if not width:
                return ()
            shape = (train.microbatch_size, train.seq_len // mesh.cp // sp, width)
        carried = layout.carried[s.block_stop] if s.block_stop < len(layout.carried) else ()
        assert not carried or (mesh.cp == 1 and sp == 1), "a boundary carrying more than the hidden state (E0420)"
        out.append(Boundary(s.stage, (BoundaryTensor("hidden", shape), *(
            BoundaryTensor("carried", (train.microbatch_size, *carried_at(dims, train.seq_len)), j)
            for j, dims in carried))))
    return tuple(out)


def boundary_bytes(plan: Plan, stage: int, default: int) -> int:
    """Bytes of what stage ``stage`` sends to the next per microbatch (its gradient's are the
    same): the plan's boundary, else ``default`` (a family's (microbatch, seq, hidden))."""
    b = plan.boundary(stage)
    return default if b is None else b.numel * value_bytes(plan.train.precision)


def uniform_boundaries(plan: Plan) -> bool:
    """Every boundary carries one (microbatch, seq_len, hidden) hidden state (a family's, ViT's)."""
    return all(len(b.tensors) == 1 and splits_sequence(b.tensors[0].shape[1:], plan.train.seq_len)
               for b in plan.boundaries)
