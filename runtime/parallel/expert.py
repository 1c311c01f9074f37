"""Expert parallelism (`apply_ep`): each MoE layer's experts divided over the ep ranks.

The plan names the experts modules (`Plan.experts`, found by check: ppdsl.core.experts). On each
rank such a module keeps rows [lo, hi) of dim 0 of its parameters, the experts lo .. hi-1 of the
layer, and its class is swapped for a subclass (as FSDP2's ``fully_shard`` does) whose forward:

1. sorts the (token, k) pairs the router chose by expert, so they are grouped by the ep rank
   holding each expert;
2. sends each pair's hidden state to that rank (``all_to_all_single``, autograd: its backward
   sends the gradients home), with the expert id;
3. runs the module's *own* forward on what it received, each row routed to its local expert with
   weight 1;
4. sends the outputs back the same way, weights each by its router weight at home (so the router
   gets its gradient where it was computed) and sums each token's k outputs (`index_add`).

Dropless: every routed token reaches its expert, there is no capacity factor, so the output is
the one-process layer's. Parameter names stay the full model's; `local_shard` / `merge_shards`
(with `split_over = "ep"`) tell checkpoints, pretrained loading and export where the rows lie.
Gradients: an expert's gradient holds the contributions of every rank of its ep group; the
trainer sums it over the ranks holding the same experts and divides by dp (`runtime.train.trainer`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ppdsl.lowering.plan import Plan

_CLASSES: dict[type, type] = {}  # HF experts class -> its expert-parallel subclass


class ExpertParallel:
    """Mixin in front of an HF experts class (see the module docstring). Set by `apply_ep`."""

    split_over = "ep"  # not a tensor-parallel shard: its rows are split over the ep group
    ep_group: Any
    ep_size: int
    ep_rank: int
    global_experts: int
    _parameters: dict[str, nn.Parameter | None]

    @property
    def local_experts(self) -> int:
        return self.global_experts // self.ep_size

    @property
    def first_expert(self) -> int:
        return self.ep_rank * self.local_experts

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        k = top_k_index.shape[-1]
        expert = top_k_index.reshape(-1)
        order = torch.argsort(expert, stable=True)  # pairs grouped by expert, so by destination rank
        expert = expert[order]
        token = order // k
        send = torch.bincount(expert // self.local_experts, minlength=self.ep_size)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.ep_group)
        send_sizes, recv_sizes = send.tolist(), recv.tolist()
        received_expert = expert.new_empty(sum(recv_sizes))
        dist.all_to_all_single(received_expert, expert, recv_sizes, send_sizes, group=self.ep_group)
        received = all_to_all_single_autograd(hidden_states[token], recv_sizes, send_sizes, self.ep_group)
        local = (received_expert - self.first_expert).unsqueeze(-1)
        ones = torch.ones(local.shape, dtype=top_k_weights.dtype, device=local.device)
        out = super().forward(received, local, ones)  # type: ignore[misc]
        back = all_to_all_single_autograd(out, send_sizes, recv_sizes, self.ep_group)
        weighted = back * top_k_weights.reshape(-1)[order].unsqueeze(-1)
        return torch.zeros_like(hidden_states).index_add(0, token, weighted.to(hidden_states.dtype))

    def local_shard(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the full tensor of parameter `name` (its experts)."""
        if self._parameters.get(name) is None:
            raise ValueError(f"unknown parameter {name!r}")
        return full.narrow(0, self.first_expert, self.local_experts)

    def merge_shards(self, name: str, shards: Sequence[torch.Tensor]) -> torch.Tensor:
        """The full tensor of parameter `name` from every ep rank's rows (ep-rank order)."""
        if self._parameters.get(name) is None:
            raise ValueError(f"unknown parameter {name!r}")
        return torch.cat(list(shards), dim=0)


def _parallel_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"ExpertParallel{cls.__name__}", (ExpertParallel, cls), {})
    return _CLASSES[cls]


@torch.no_grad()
def shard_experts(module: nn.Module, group: Any, ep_size: int, ep_rank: int) -> None:
    """Keep this ep rank's experts of `module` (all of them materialised) and route through them."""
    experts = int(getattr(module, "num_experts"))
    assert experts % ep_size == 0, (experts, ep_size)  # E0243
    n = experts // ep_size
    for name, p in list(module._parameters.items()):
        if p is None:
            continue
        assert p.shape[0] == experts, (name, tuple(p.shape))  # ppdsl.core.experts
        rows = nn.Parameter(p.detach().narrow(0, ep_rank * n, n).clone(), requires_grad=p.requires_grad)
        setattr(module, name, rows)
    module.__class__ = _parallel_class(type(module))
    module.ep_group, module.ep_size, module.ep_rank, module.global_experts = group, ep_size, ep_rank, experts
    module.num_experts = n  # the HF forward's one-hot and loop run over the local experts


def apply_ep(stages: Sequence[nn.Module], plan: Plan, group: Any, ep_rank: int) -> None:
    """Divide the plan's experts modules that this rank's stages hold over the ep group."""
    for stage in stages:
        for e in plan.experts:
            try:
                module = stage.get_submodule(e.path)
            except AttributeError:
                continue  # another stage's layer
            assert getattr(module, "num_experts", None) == e.experts, (e, type(module).__name__)
            shard_experts(module, group, plan.mesh.ep, ep_rank)


def is_expert_shard(owner: nn.Module) -> bool:
    return getattr(owner, "split_over", "tp") == "ep"


def expert_parameters(stages: Sequence[nn.Module]) -> list[nn.Parameter]:
    """The parameters of this rank's expert shards, in module order."""
    return [p for stage in stages for m in stage.modules() if is_expert_shard(m)
            for p in m.parameters(recurse=False)]


def sync_expert_gradients(params: Sequence[nn.Parameter], groups: Any, bucket_bytes: int) -> None:
    """An expert's gradient already sums the tokens of its ep group (the all-to-all's backward):
    sum it over the ranks holding the same experts (`groups.expert_replicas`), divide by dp like
    every other gradient. A rank's expert tensor holds all its local experts; one process's holds
    all E and has a gradient whenever any expert was hit, so a rank whose experts got no token
    this step takes zeros (its replicas may have some)."""
    from ppdsl.runtime.parallel.grad_sync import allreduce_average

    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    dp = groups.layout.dp
    if groups.expert_replicas is not None:
        allreduce_average(grads, groups.expert_replicas, dp, bucket_bytes)
    else:
        for g in grads:
            g.div_(dp)


def gather_experts(stages: Sequence[nn.Module], group: Any, ep_size: int) -> dict[int, torch.Tensor]:
    """id(param) -> the full tensor of every expert shard of `stages`, gathered over the ep group
    (collective: every rank of the group calls it, same order)."""
    full: dict[int, torch.Tensor] = {}
    for stage in stages:
        for m in stage.modules():
            if not is_expert_shard(m):
                continue
            for name, p in m.named_parameters(recurse=False):
                shards = [torch.empty_like(p) for _ in range(ep_size)]
                dist.all_gather(shards, p.detach().contiguous(), group=group)
                full[id(p)] = m.merge_shards(name, shards)  # type: ignore[operator]
    return full
