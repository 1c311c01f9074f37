"""Parameters that are one tensor on several stages: their copies on a rank, and their gradients'
sum over the pipeline ranks that hold them.

A tied group (`runtime.stage.build.tied_parameter_groups`: names of one tensor in the full model) lives on
the pipeline ranks `tied_parameter_ranks` names: this rank alone (a tie inside one stage, or
across the rank's stages), the first and last stage's ranks (an embedding tied to the head: the
tie group of `runtime.parallel.groups`), or every rank (a module every stage holds,
`StageAssignment.shared`: the pp group). After backward each copy's gradient is the sum of all.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ppdsl.lowering.plan import Plan

from ppdsl.runtime.parallel.groups import ProcessGroups
from ppdsl.runtime.parallel.fsdp import local

__all__ = ["TiedGroup", "sum_tied_gradients", "tied_groups"]


@dataclass
class TiedGroup:
    names: tuple[str, ...]
    local: list[nn.Parameter]  # this rank's distinct copies
    canonical: bool  # this rank counts the group in the gradient norm
    over: Any  # the process group its gradients are summed over (None: this rank's copies only)


def tied_groups(plan: Plan, groups: ProcessGroups, tied_names: Sequence[Sequence[str]],
                by_name: Mapping[str, nn.Parameter], copies: Mapping[str, nn.Parameter]) -> list[TiedGroup]:
    """This rank's `TiedGroup` for each group of ``tied_names`` it holds: ``by_name`` its named
    parameters (the one stepped and counted in the norm comes first), ``copies`` the copies split
    from a tie within the rank (ZeRO-3)."""
    from ppdsl.runtime.stage.build import tied_parameter_ranks

    everyone = tuple(range(groups.layout.pp))
    out = []
    for names in tied_names:
        held: list[nn.Parameter] = []
        for p in [by_name.get(n) for n in names] + [copies.get(n) for n in names]:
            if p is not None and all(p is not q for q in held):
                held.append(p)
        holders = tied_parameter_ranks(plan, names)
        if groups.pp_rank not in holders:
            assert not held, (names, holders)
            continue
        if not held:
            raise ValueError(f"pipeline rank {groups.pp_rank} holds no copy of tied parameters {tuple(names)}")
        if len(holders) == 1:
            over = None
        elif holders == everyone and plan.stages[0].shared:
            over = groups.pp
        elif holders == groups.tie_pp_ranks:
            over = groups.tie
        else:
            raise ValueError(f"tied parameters {tuple(names)} live on pipeline ranks {holders}: ppdsl sums tied "
                             f"gradients over the first and last stage's ranks {groups.tie_pp_ranks} only")
        out.append(TiedGroup(tuple(names), held, groups.pp_rank == holders[0], over))
    return out


def sum_tied_gradients(tied: Sequence[TiedGroup]) -> None:
    """Every copy's gradient becomes the group's sum (a copy this rank's stages did not use takes
    part with zeros: its tie partners' ranks wait for it)."""
    for group in tied:
        for p in group.local:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        total = group.local[0].grad
        for p in group.local[1:]:
            total = total + p.grad
        if group.over is not None:
            dist.all_reduce(local(total), group=group.over)
        for p in group.local:
            p.grad.copy_(total)
