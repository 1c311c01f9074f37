"""ZeRO stage 1 over a reduce-scatter: each data-parallel rank owns whole parameters.

Ownership: parameters are assigned in order to the least-loaded dp rank (by element count, ties
to the lowest rank), the same on every replica. A step then

1. reduce-scatters the gradients (sum, then / dp) so each rank receives only the averaged
   gradients of the parameters it owns; the others' gradients are dropped (``None``);
2. (the trainer clips by the global norm, summed over dp as well: each gradient lives once);
3. steps a plain torch optimizer over the owned parameters (it holds their state: Adam
   moments exist once over the dp group);
4. all-gathers the updated parameters.

The flat layout: rank r's segment holds its owned parameters back to back, every segment
padded to the largest one (S elements), so reduce-scatter / all-gather move equal chunks; both
go in buckets of about ``bucket_bytes`` per rank (the same offset window of every segment).
Bytes per rank for N gradient elements: the reduce-scatter sends (dp-1)/dp * dp*S ~ (dp-1)/dp * N
elements, half of a ring all-reduce's 2 (dp-1)/dp * N; the parameter all-gather sends the
other half. A parameter that got no gradient on this step (unused by the rank's stages: the
replicas run the same stages, so all skip it) keeps ``grad = None`` on its owner and is not
stepped, as in one process.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def _all_gather(output: torch.Tensor, input: torch.Tensor, group: Any) -> None:
    # newer torch names it all_gather_single (all_gather_into_tensor warns); torch 2.6 has only that
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(output, input, group=group)


def _reduce_scatter(output: torch.Tensor, input: torch.Tensor, group: Any) -> None:
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(output, input, group=group)


def assign_owners(numels: Sequence[int], dp: int) -> list[int]:
    """The dp rank owning each parameter: greedy, in order, to the least-loaded rank."""
    load = [0] * dp
    owners = []
    for n in numels:
        r = min(range(dp), key=lambda i: (load[i], i))
        owners.append(r)
        load[r] += n
    return owners


class ZeroOneOptimizer(torch.optim.Optimizer):
    """An optimizer over every parameter of the rank (so the LR schedule drives it) whose
    step runs `inner`, a torch optimizer over the parameters this dp rank owns."""

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        groups: list[dict[str, Any]],
        build: Callable[[list[nn.Parameter]], torch.optim.Optimizer | None],
        dp_group: Any,
        dp: int,
        dp_rank: int,
        bucket_bytes: int,
        lr: float,
    ) -> None:
        super().__init__(groups, {"lr": lr})
        self.params = list(params)
        self.dp_group, self.dp, self.dp_rank = dp_group, dp, dp_rank
        owners = assign_owners([p.numel() for p in self.params], dp)
        self.owner = {id(p): r for p, r in zip(self.params, owners)}
        self.segments: list[list[nn.Parameter]] = [[p for p, r in zip(self.params, owners) if r == k] for k in range(dp)]
        self.owned = self.segments[dp_rank]
        self.segment = max(sum(p.numel() for p in seg) for seg in self.segments)
        dtypes = {p.dtype for p in self.params}
        assert len(dtypes) <= 1, f"ZeRO-1 needs one parameter dtype, got {dtypes}"
        self.dtype = next(iter(dtypes), torch.float32)
        self.window = max(1, bucket_bytes // max(1, self.dtype.itemsize))
        self.inner = build(self.owned) if self.owned else None
        # bytes this rank handed to the gradient reduce-scatter / parameter all-gather (measured)
        self.sent_bytes = {"reduce_scatter": 0, "all_gather": 0}

    def owns(self, p: nn.Parameter) -> bool:
        return self.owner[id(p)] == self.dp_rank

    # -- flat segments ---------------------------------------------------------------------

    def _pieces(self, seg: list[nn.Parameter], a: int, b: int) -> list[tuple[nn.Parameter, int, int, int]]:
        """(param, start, stop in its flat view, offset in the window) of `seg` within [a, b)."""
        out, at = [], 0
        for p in seg:
            lo, hi = max(a, at), min(b, at + p.numel())
            if lo < hi:
                out.append((p, lo - at, hi - at, lo - a))
            at += p.numel()
        return out

    def _windows(self) -> list[tuple[int, int]]:
        return [(a, min(a + self.window, self.segment)) for a in range(0, self.segment, self.window)]

    # -- the gradient sync (reduce-scatter) and the step -------------------------------------

    @torch.no_grad()
    def reduce_scatter_gradients(self) -> None:
        """Owned gradients <- their mean over dp; other gradients <- None."""
        had_grad = {id(p): p.grad is not None for p in self.owned}
        device = self.params[0].device if self.params else torch.device("cpu")
        received: dict[int, torch.Tensor] = {}
        for a, b in self._windows():
            w = b - a
            flat = torch.zeros(self.dp * w, dtype=self.dtype, device=device)
            for r, seg in enumerate(self.segments):
                for p, lo, hi, off in self._pieces(seg, a, b):
                    if p.grad is not None:
                        flat[r * w + off : r * w + off + hi - lo].copy_(p.grad.reshape(-1)[lo:hi])
            out = torch.empty(w, dtype=self.dtype, device=device)
            _reduce_scatter(out, flat, group=self.dp_group)
            self.sent_bytes["reduce_scatter"] += flat.numel() * flat.element_size() * (self.dp - 1) // self.dp
            out.div_(self.dp)
            for p, lo, hi, off in self._pieces(self.owned, a, b):
                buf = received.setdefault(id(p), torch.empty(p.numel(), dtype=self.dtype, device=device))
                buf[lo:hi].copy_(out[off : off + hi - lo])
        for p in self.params:
            if self.owns(p) and had_grad[id(p)]:
                p.grad = received[id(p)].view_as(p)
            else:
                p.grad = None

    @torch.no_grad()
    def all_gather_parameters(self) -> None:
        device = self.params[0].device if self.params else torch.device("cpu")
        for a, b in self._windows():
            w = b - a
            mine = torch.zeros(w, dtype=self.dtype, device=device)
            for p, lo, hi, off in self._pieces(self.owned, a, b):
                mine[off : off + hi - lo].copy_(p.detach().reshape(-1)[lo:hi])
            flat = torch.empty(self.dp * w, dtype=self.dtype, device=device)
            _all_gather(flat, mine, group=self.dp_group)
            self.sent_bytes["all_gather"] += mine.numel() * mine.element_size() * (self.dp - 1)
            for r, seg in enumerate(self.segments):
                if r == self.dp_rank:
                    continue
                for p, lo, hi, off in self._pieces(seg, a, b):
                    p.data.view(-1)[lo:hi].copy_(flat[r * w + off : r * w + off + hi - lo])

    @torch.no_grad()
    def gathered_gradients(self) -> dict[int, torch.Tensor | None]:
        """id(param) -> its averaged gradient on every rank (verification only: an all-gather
        of what the reduce-scatter spread)."""
        saved = {id(p): p.detach().clone() for p in self.params}
        for p in self.params:
            p.data.copy_(p.grad if p.grad is not None else torch.zeros_like(p))
        self.all_gather_parameters()
        out = {id(p): p.detach().clone() for p in self.params}
        for p in self.params:
            p.data.copy_(saved[id(p)])
        return out

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        if self.inner is not None:
            lr = self.param_groups[0]["lr"]
            for g in self.inner.param_groups:
                g["lr"] = lr
            self.inner.step()
        self.all_gather_parameters()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    def state_of(self, p: nn.Parameter) -> dict[str, Any]:
        """The optimizer state of parameter `p` (empty when another rank owns it)."""
        return {} if self.inner is None or not self.owns(p) else self.inner.state.get(p, {})
