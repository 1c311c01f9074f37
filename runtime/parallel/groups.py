"""Process groups of one run, built once from the plan's mesh layout and passed explicitly.

Unlike Megatron's ``parallel_state`` there is no module-level state: ``build_process_groups``
returns a ``ProcessGroups`` value and every caller receives it as an argument, so two meshes
can coexist in one process (the tests run several layouts in the same world).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ppdsl.lowering.plan import MESH_DIMS, MeshLayout


@dataclass(frozen=True)
class ProcessGroups:
    """This rank's view of the (dp, cp, pp, tp) mesh."""

    layout: MeshLayout
    rank: int  # global rank
    mesh: DeviceMesh
    dp: ProcessGroup
    pp: ProcessGroup
    tp: ProcessGroup
    # sums the gradients of parameters tied across pipeline ranks (GPT-2's wte / lm_head);
    # None when this rank is in no such group
    tie: ProcessGroup | None
    tie_pp_ranks: tuple[int, ...]  # pipeline ranks that hold a tied copy, ascending
    # mesh.ep > 1: the ranks this one exchanges tokens with (MeshLayout.ep_group), and those
    # holding the same experts (MeshLayout.expert_replicas; None when dp = ep); else None
    ep: ProcessGroup | None = None
    expert_replicas: ProcessGroup | None = None
    # mesh.cp > 1: the ranks splitting this rank's sequences (same dp, pp, tp), and the dp * cp
    # ranks whose gradients are averaged (same pp, tp); cp = 1: None, and `replicas` is dp
    cp: ProcessGroup | None = None
    replica_group: ProcessGroup | None = None

    @property
    def replicas(self) -> ProcessGroup:
        """The group gradients and losses are averaged over: dp, or dp * cp with context parallelism."""
        return self.dp if self.replica_group is None else self.replica_group

    @property
    def cp_rank(self) -> int:
        return self.coords["cp"]

    @property
    def ep_rank(self) -> int:
        return self.layout.ep_rank(self.rank)

    @property
    def coords(self) -> dict[str, int]:
        return self.layout.coords(self.rank)

    @property
    def dp_rank(self) -> int:
        return self.coords["dp"]

    @property
    def pp_rank(self) -> int:
        return self.coords["pp"]

    @property
    def tp_rank(self) -> int:
        return self.coords["tp"]

    def pp_peer(self, pp_rank: int) -> int:
        """Global rank of the process at pipeline rank `pp_rank` with this rank's dp and tp."""
        c = self.coords
        return self.layout.rank_of(c["dp"], pp_rank, c["tp"], c["cp"])


def tie_pp_ranks_of(stage_ranks: Sequence[int]) -> tuple[int, ...]:
    """Pipeline ranks holding the first and the last virtual stage (where embeddings are tied)."""
    return tuple(sorted({stage_ranks[0], stage_ranks[-1]}))


def build_process_groups(
    layout: MeshLayout,
    device_type: str,
    tie_pp_ranks: Sequence[int] = (),
) -> ProcessGroups:
    """Create the device mesh and the tie groups. Collective: every rank calls it identically.

    `tie_pp_ranks`: the pipeline ranks among which tied parameters live; when it names two or
    more ranks one group is made per (dp, cp, tp) coordinate, all in the same order on every rank.
    """
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call init_process_group first")
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != layout.world:
        raise ValueError(f"the plan's mesh needs world = {layout.world}, but WORLD_SIZE = {world}")
    mesh = init_device_mesh(device_type, layout.shape, mesh_dim_names=MESH_DIMS)
    c = layout.coords(rank)
    assert list(mesh.get_coordinate() or []) == [c[d] for d in MESH_DIMS], (mesh, c)
    tie_ranks = tuple(sorted(set(tie_pp_ranks)))
    tie = _build_tie_groups(layout, rank, tie_ranks) if len(tie_ranks) > 1 else None
    ep = replicas = None
    if layout.ep > 1:
        ep = _my_group(rank, {layout.ep_group(r) for r in range(world)})
        if layout.dp > layout.ep:
            replicas = _my_group(rank, {layout.expert_replicas(r) for r in range(world)})
    cp = replica_group = None
    if layout.cp > 1:
        cp = mesh.get_group("cp")
        replica_group = _my_group(rank, {layout.replica_group(r) for r in range(world)})
    return ProcessGroups(
        layout=layout,
        rank=rank,
        mesh=mesh,
        dp=mesh.get_group("dp"),
        pp=mesh.get_group("pp"),
        tp=mesh.get_group("tp"),
        tie=tie,
        tie_pp_ranks=tie_ranks,
        ep=ep,
        expert_replicas=replicas,
        cp=cp,
        replica_group=replica_group,
    )


def _my_group(rank: int, member_lists: set[tuple[int, ...]]) -> ProcessGroup:
    """One group per member list, made in the same (sorted) order on every rank; `rank`'s."""
    mine = None
    for members in sorted(member_lists):
        group = dist.new_group(list(members))  # collective over the world: never skip a call
        if rank in members:
            mine = group
    assert mine is not None, (rank, member_lists)
    return mine


def _build_tie_groups(layout: MeshLayout, rank: int, pp_ranks: tuple[int, ...]) -> ProcessGroup | None:
    mine = None
    for dp in range(layout.dp):
        for cp in range(layout.cp):
            for tp in range(layout.tp):
                members = [layout.rank_of(dp, p, tp, cp) for p in pp_ranks]
                group = dist.new_group(members)  # collective over the world: never skip a call
                if rank in members:
                    mine = group
    return mine
