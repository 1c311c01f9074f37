"""A rank's tensors in global coordinates for torch.distributed.checkpoint (DCP).

Every tensor is saved under its full model name with its full (unpadded) shape; a rank writes
the *boxes* of it it holds: (global offsets, sizes) and the matching view of its local tensor.
Loading asks DCP for the boxes the rank needs under the current mesh, and DCP reads only the
saved chunks that overlap them (any saved mesh, any current mesh).

Why boxes through a planner, not DTensor: a DTensor shard is one box per rank at an even
offset, but a tensor-parallel layer's shard is not always one: a fused q|k|v column split holds
a slice of each part (three boxes), a padded vocabulary shard holds real rows plus zero rows
that are no part of the model (the box stops before the padding). `DefaultSavePlanner` /
`DefaultLoadPlanner` are DCP's documented extension points; the subclasses below add a write
item per box (``WriteItemType.SHARD`` with its ``ChunkStorageMetadata``, what DTensor and
ShardedTensor produce too) and read boxes through ``create_read_items_for_chunk_list`` (DCP's
resharding). The file then holds ordinary chunked tensors: ``dcp_to_torch_save`` assembles
each under its model name at its full shape.

Which boxes a shard holds is found generically, as `runtime.stage.weights` does for safetensors: the
layer's own ``local_shard`` applied to an index tensor gives, per local row of the split dim, the global
row it came from (0 = padding); consecutive runs become boxes. Replicated copies (data-parallel
replicas, tensor-parallel replicated tensors, tied copies) write the same box under the same
name, which DCP's plan dedup writes once.

Under FSDP2 (``zero = 3``) a parameter is a DTensor: a Shard(0) over the data-parallel ranks of
the tensor-parallel-local tensor. Its boxes are that tensor's boxes cut to the rows of the local
piece (`rows_of`): a dim-0 tp split intersects its row runs, a split of another dim (a
row-parallel weight) becomes a 2-D box. Each dp rank writes and reads only its piece; nothing is
gathered.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import attrs
import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list


@attrs.frozen
class Box:
    """The block of the local tensor starting at `local_start` (one index per dim) with sizes
    `length` is the block of the global tensor starting at `global_start`."""

    local_start: tuple[int, ...]
    global_start: tuple[int, ...]
    length: tuple[int, ...]

    @classmethod
    def along(cls, shape: tuple[int, ...], dim: int, local_start: int, global_start: int, length: int) -> Box:
        """Rows [local_start, local_start + length) along `dim` of a local tensor of `shape` are
        rows [global_start, ...) of the global tensor; every other dim whole."""
        return cls(
            tuple(local_start if d == dim else 0 for d in range(len(shape))),
            tuple(global_start if d == dim else 0 for d in range(len(shape))),
            tuple(length if d == dim else s for d, s in enumerate(shape)),
        )


@attrs.frozen(eq=False)
class Boxed:
    """A local tensor and where its pieces lie in the global tensor of shape `global_shape`."""

    local: torch.Tensor
    global_shape: tuple[int, ...]
    boxes: tuple[Box, ...]

    @classmethod
    def whole(cls, t: torch.Tensor) -> Boxed:
        return cls(t, tuple(t.shape), (Box.along(tuple(t.shape), 0, 0, 0, t.size(0)),) if t.dim() else ())

    def offsets(self, box: Box) -> tuple[int, ...]:
        return box.global_start

    def sizes(self, box: Box) -> tuple[int, ...]:
        return box.length

    def view(self, box: Box) -> torch.Tensor:
        v = self.local
        for d, (start, n) in enumerate(zip(box.local_start, box.length)):
            if start != 0 or n != v.size(d):
                v = v.narrow(d, start, n)
        return v

    def with_local(self, t: torch.Tensor) -> Boxed:
        """The same placement for another tensor of the same shape (an Adam moment)."""
        assert t.shape == self.local.shape, (t.shape, self.local.shape)
        return Boxed(t, self.global_shape, self.boxes)


def rows_of(boxed: Boxed, piece: torch.Tensor, start: int) -> Boxed:
    """The placement of `piece`, rows [start, start + len(piece)) along dim 0 of the tensor
    `boxed` places (a data-parallel shard of it, as FSDP2 holds): each box is cut to those rows
    (a dim-0 box: its row run intersected; a box of another dim: made 2-D), boxes outside them
    dropped (an empty shard holds none)."""
    assert piece.dim() == boxed.local.dim() >= 1, (tuple(piece.shape), tuple(boxed.local.shape))
    assert tuple(piece.shape[1:]) == tuple(boxed.local.shape[1:]), (tuple(piece.shape), tuple(boxed.local.shape))
    stop = start + piece.size(0)
    assert 0 <= start and stop <= boxed.local.size(0), (start, stop, tuple(boxed.local.shape))
    boxes = []
    for box in boxed.boxes:
        lo = max(start, box.local_start[0])
        hi = min(stop, box.local_start[0] + box.length[0])
        if hi <= lo:
            continue
        shift = lo - box.local_start[0]
        boxes.append(Box(
            (lo - start, *box.local_start[1:]),
            (box.global_start[0] + shift, *box.global_start[1:]),
            (hi - lo, *box.length[1:]),
        ))
    return Boxed(piece, boxed.global_shape, tuple(boxes))


def dp_shard(t: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """(local piece, its first row) when `t` is a DTensor sharded on dim 0 over a 1-D mesh (an
    FSDP2 parameter or its optimizer state), else None. The rows are torch.chunk's, FSDP2's
    split (`chunk_rows`)."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(t, DTensor):
        return None
    placements = t.placements
    assert len(placements) == 1 and isinstance(placements[0], Shard) and placements[0].dim == 0, (
        f"a DTensor placed {placements}: only a Shard(0) over one mesh dim (FSDP2) is checkpointed"
    )
    mesh = t.device_mesh
    start, stop = chunk_rows(t.size(0), mesh.size(), mesh.get_local_rank())
    piece = t.to_local()
    assert piece.size(0) == stop - start, (tuple(piece.shape), tuple(t.shape), start, stop)
    return piece, start


def chunk_rows(n: int, size: int, rank: int) -> tuple[int, int]:
    """Rows [start, stop) of `n` that torch.chunk into `size` parts gives part `rank` (none
    past the last part: n = 5 in 4 parts is 2, 2, 1 and an empty one)."""
    chunk = -(-n // size)
    start = min(n, rank * chunk)
    return start, min(n, start + chunk)


def dp_sharded(boxed: Boxed, t: torch.Tensor) -> Boxed:
    """`boxed` (the placement of a tensor-parallel-local tensor) for `t`: that tensor itself, or
    a dim-0 DTensor shard of it (FSDP2); then the boxes hold only its rows."""
    shard = dp_shard(t)
    if shard is None:
        return boxed.with_local(t)
    piece, start = shard
    assert tuple(t.shape) == tuple(boxed.local.shape), (tuple(t.shape), tuple(boxed.local.shape))
    return rows_of(boxed, piece, start)


def runs(indices: list[int]) -> list[tuple[int, int, int]]:
    """(local start, global start, length) of each run of consecutive 1-based global indices in
    `indices` (0 = padding, left out)."""
    out: list[tuple[int, int, int]] = []
    i = 0
    while i < len(indices):
        if indices[i] == 0:
            i += 1
            continue
        j = i + 1
        while j < len(indices) and indices[j] == indices[j - 1] + 1:
            j += 1
        out.append((i, indices[i] - 1, j - i))
        i = j
    return out


def sharded(t: torch.Tensor, owner: Any, local: str, tp: int) -> Boxed:
    """The placement of `t`, parameter or buffer `local` of `owner`: whole unless `owner` is a
    tensor-parallel layer whose shard of it differs from the full tensor; when `t` is a dim-0
    DTensor shard of that tensor (an FSDP2 parameter), the boxes of its rows."""
    if dp_shard(t) is not None:
        return dp_sharded(_tp_sharded(torch.empty(t.shape, dtype=t.dtype, device="meta"), owner, local, tp), t)
    return _tp_sharded(t, owner, local, tp)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds of `t`: its local piece when a DTensor, else itself."""
    shard = dp_shard(t)
    return t if shard is None else shard[0]


def _tp_sharded(t: torch.Tensor, owner: Any, local: str, tp: int) -> Boxed:
    if getattr(owner, "split_over", "tp") == "ep":  # runtime.parallel.expert: its rows over ep ranks
        tp = owner.ep_size
    if tp == 1 or t.dim() == 0 or not hasattr(owner, "merge_shards"):
        return Boxed.whole(t)
    try:
        full = tuple(owner.merge_shards(local, [t.detach().to("meta")] * tp).shape)
    except ValueError:  # not one of the layer's split parameters
        return Boxed.whole(t)
    if full == tuple(t.shape):
        return Boxed.whole(t)
    split = [d for d in range(t.dim()) if full[d] != t.shape[d]]
    assert len(split) == 1, (local, full, tuple(t.shape))
    dim = split[0]
    # the layer's own split applied to the 1-based global row numbers (size 1 in the other
    # dims: the layers split one dim and never look at the others)
    view = [1] * t.dim()
    view[dim] = full[dim]
    picked = owner.local_shard(local, torch.arange(1, full[dim] + 1).view(view))
    assert picked.size(dim) == t.size(dim), (local, tuple(picked.shape), tuple(t.shape))
    indices = [int(i) for i in picked.reshape(-1).tolist()]
    boxes = tuple(Box.along(tuple(t.shape), dim, a, g, n) for a, g, n in runs(indices))
    return Boxed(t, full, boxes)


class BoxSavePlanner(DefaultSavePlanner):
    """Saves the plain state dict as DCP does, plus every box of `boxed` (fqn -> Boxed)."""

    def __init__(self, boxed: Mapping[str, Boxed]) -> None:
        super().__init__()
        self.boxed = dict(boxed)
        self._views: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items = list(plan.items)
        for fqn, b in self.boxed.items():
            props = TensorProperties.create_from_tensor(b.local)
            for box in b.boxes:
                offsets = b.offsets(box)
                self._views[(fqn, offsets)] = b.view(box)
                chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(b.sizes(box)))
                items.append(WriteItem(
                    index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(chunk=chunk, properties=props, size=torch.Size(b.global_shape)),
                ))
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> Any:
        key = (write_item.index.fqn, tuple(write_item.index.offset or ()))
        if key in self._views:
            return self._views[key].detach().contiguous()
        return super().resolve_data(write_item)


class BoxLoadPlanner(DefaultLoadPlanner):
    """Loads the plain state dict as DCP does, and into every box of `boxed` the saved data
    overlapping it. Boxed names the checkpoint lacks are collected in `missing`."""

    def __init__(self, boxed: Mapping[str, Boxed]) -> None:
        super().__init__()
        self.boxed = dict(boxed)
        self._views: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}
        self.missing: list[str] = []

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        items = list(plan.items)
        assert self.metadata is not None
        for fqn, b in self.boxed.items():
            md = self.metadata.state_dict_metadata.get(fqn)
            if not isinstance(md, TensorStorageMetadata):
                self.missing.append(fqn)
                continue
            if tuple(md.size) != b.global_shape:
                raise ValueError(f"checkpoint tensor {fqn!r} has shape {tuple(md.size)}, this run's model {b.global_shape}")
            for box in b.boxes:
                offsets = b.offsets(box)
                self._views[(fqn, offsets)] = b.view(box)
                chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(b.sizes(box)))
                items.extend(create_read_items_for_chunk_list(fqn, md, [chunk]))
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        key = (index.fqn, tuple(index.offset or ()))
        if key in self._views:
            return self._views[key]
        return super().lookup_tensor(index)
