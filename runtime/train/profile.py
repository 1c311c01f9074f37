"""Measure a ``CostProfile`` (``lowering.costs``): one process, the real model, the real shapes.

Per block: its inputs are captured from one forward of the whole model, then the block is run
alone on them: F (forward with autograd on), B (``autograd.grad`` with respect to the input
only), B + W (a full backward; W is the difference) and the bytes autograd saves during F.
The first modules (embeddings) are timed the same way; the last ones (head and loss) inside
whole-model passes (from the last block's output to the loss, and from the start of the
backward to the gradient reaching the last block), their backward split evenly into B and W.
Each figure is a median of a few repetitions, at two microbatch sizes. The communication model
comes from a gloo micro-benchmark between two local processes (``measure_comm``).
"""

from __future__ import annotations

import os
import socket
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from ppdsl.lowering.costs import CommModel, CostProfile, Linear, PartCost
from ppdsl.lowering.memory import value_bytes
from ppdsl.lowering.plan import Plan

from ppdsl.runtime.data.source import make_data
from ppdsl.runtime.train.optim import build_optimizer, parameter_dtype
from ppdsl.runtime.verify.reference_loss import reference_loss
from ppdsl.runtime.stage.build import build_reference_model

REPEATS = 7


def _median_time(fn: Callable[[], Any], repeats: int = REPEATS) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _first_tensor(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        return next(o for o in out if isinstance(o, torch.Tensor))
    if hasattr(out, "last_hidden_state"):
        return out.last_hidden_state
    raise TypeError(f"cannot find the output tensor of {type(out).__name__}")


def _saved_bytes(fn: Callable[[], Any]) -> int:
    seen: set[int] = set()
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        ptr = t.untyped_storage().data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            total += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total


class _Replay:
    """One module called again on the arguments it got in the model's forward."""

    def __init__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        # a key/value cache the model's forward made (transformers' DynamicCache) would grow by
        # each replay's keys: every call must see only its own tokens
        kwargs = {k: None if type(v).__name__.endswith("Cache") else v for k, v in kwargs.items()}
        self.module, self.args, self.kwargs = module, args, kwargs
        self.index = next(i for i, a in enumerate(args) if isinstance(a, torch.Tensor)) if args else -1

    def _inputs(self) -> tuple[tuple, torch.Tensor | None]:
        args = [a.detach() if isinstance(a, torch.Tensor) else a for a in self.args]
        x = None
        if self.index >= 0 and args[self.index].is_floating_point():
            x = args[self.index].requires_grad_(True)
            args[self.index] = x
        return tuple(args), x

    def forward(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        args, x = self._inputs()
        return _first_tensor(self.module(*args, **self.kwargs)), x

    def times(self) -> tuple[float, float, float, int]:
        """F, B, W seconds and saved bytes."""
        f = _median_time(self.forward)
        out, _ = self.forward()
        grad = torch.randn_like(out)

        def input_grad() -> None:
            o, x = self.forward()
            if x is not None:  # a module whose first float argument is not on its output's path (BART's decoder)
                torch.autograd.grad(o, x, grad, allow_unused=True)

        def full() -> None:
            o, _ = self.forward()
            o.backward(grad)

        fb = _median_time(input_grad)
        ffull = _median_time(full)
        self.module.zero_grad(set_to_none=True)
        b = max(0.0, fb - f) if self.index >= 0 and self.args[self.index].is_floating_point() else 0.0
        bw = max(0.0, ffull - f)
        return f, b, max(0.0, bw - b), _saved_bytes(self.forward)


def _part_at(model: nn.Module, plan: Plan, mb: Any) -> dict[str, Any]:
    blocks = model.get_submodule(plan.blocks)
    first_paths = plan.stages[0].first
    captured: dict[str, tuple[tuple, dict]] = {}
    hooks = []
    named = [(f"{plan.blocks}.{i}", blk) for i, blk in enumerate(blocks.children())]
    named += [(p, model.get_submodule(p)) for p in first_paths]
    for name, mod in named:
        def hook(m: nn.Module, args: tuple, kwargs: dict, name: str = name) -> None:
            captured.setdefault(name, (args, kwargs))
        hooks.append(mod.register_forward_pre_hook(hook, with_kwargs=True))
    boundary: list[int] = []
    hooks.append(next(iter(blocks.children())).register_forward_hook(
        lambda m, a, o: boundary.append(_first_tensor(o).numel() * _first_tensor(o).element_size())))
    with torch.no_grad():
        reference_loss(plan, model, mb)
    for h in hooks:
        h.remove()
    block_times = [_Replay(blk, *captured[name]).times() for name, blk in named[: len(blocks)]]
    first_times = [_Replay(model.get_submodule(p), *captured[p]).times() for p in first_paths if p in captured]
    loss_fn = lambda: reference_loss(plan, model, mb)  # noqa: E731
    total_saved = _saved_bytes(loss_fn)
    first = tuple(sum(t[i] for t in first_times) for i in range(4))
    inner = [sum(t[i] for t in block_times) + first[i] for i in range(4)]
    last_f, last_bw = _head_times(list(blocks.children())[-1], loss_fn)
    model.zero_grad(set_to_none=True)
    last = (last_f, last_bw / 2, last_bw / 2, max(0, total_saved - int(inner[3])))
    return {"blocks": block_times, "first": first, "last": last, "boundary": boundary[0]}


def _head_times(last_block: nn.Module, loss_fn: Callable[[], torch.Tensor]) -> tuple[float, float]:
    """F and B + W of what follows the last block (head and loss), timed inside whole-model
    passes: from the last block's forward end to the loss, and from the start of the backward
    to the gradient reaching the last block's output."""
    marks: dict[str, float] = {}
    def forward_end(module: nn.Module, args: Any, out: Any) -> None:
        marks["f"] = time.perf_counter()

    def grad_reached(module: nn.Module, grad: Any) -> None:  # returns None: the gradient is kept
        marks.setdefault("b", time.perf_counter())

    hooks = [last_block.register_forward_hook(forward_end), last_block.register_full_backward_pre_hook(grad_reached)]
    fs, bws = [], []
    try:
        for i in range(REPEATS + 1):
            marks.clear()
            loss = loss_fn()
            end = time.perf_counter()
            start = time.perf_counter()
            loss.backward()
            if i:  # the first is a warm-up
                fs.append(end - marks["f"])
                bws.append(marks["b"] - start)
    finally:
        for h in hooks:
            h.remove()
    return statistics.median(fs), statistics.median(bws)


def _params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def measure_profile(plans: Sequence[Plan], comm: CommModel) -> CostProfile:
    """Profile the model of `plans` (two world-1 plans of different microbatch sizes)."""
    assert len(plans) == 2
    plan = plans[0]
    model = build_reference_model(plan.model, torch.device("cpu"), plan.train.seed,
                                     parameter_dtype(plan.train.precision))
    model.train()
    runs, sizes = [], []
    for p in plans:
        mb = next(iter(make_data(p).microbatches(0, 0, torch.device("cpu"))))
        sizes.append(p.train.microbatch_size)
        runs.append(_part_at(model, p, mb))
    s0, s1 = sizes

    def fit(v0: float, v1: float) -> Linear:
        return Linear.fit(s0, v0, s1, v1)

    def part(t0: Sequence[float], t1: Sequence[float], params: int) -> PartCost:
        return PartCost(fit(t0[0], t1[0]), fit(t0[1], t1[1]), fit(t0[2], t1[2]), fit(t0[3], t1[3]), params)

    blocks_mod = list(model.get_submodule(plan.blocks).children())
    first_params = sum(_params(model.get_submodule(p)) for p in plan.stages[0].first)
    last_params = sum(_params(model.get_submodule(p)) for p in plan.stages[-1].last)
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer = build_optimizer(params, plan.train.optimizer)
    opt_s = _median_time(optimizer.step)
    return CostProfile(
        model=f"{plan.model.kind}:{plan.model.target}", seq_len=plan.train.seq_len, samples=(s0, s1),
        blocks=tuple(part(a, b, _params(m)) for a, b, m in zip(runs[0]["blocks"], runs[1]["blocks"], blocks_mod)),
        first=part(runs[0]["first"], runs[1]["first"], first_params),
        last=part(runs[0]["last"], runs[1]["last"], last_params),
        boundary_bytes=fit(runs[0]["boundary"], runs[1]["boundary"]),
        optimizer_per_param=opt_s / max(1, sum(p.numel() for p in params)),
        comm=comm, cpus=len(os.sched_getaffinity(0)), device="cpu",
        value_bytes=value_bytes(plan.train.precision),
    )


# ---- communication ---------------------------------------------------------------------------

COMM_SIZES = (1 << 10, 1 << 16, 1 << 20)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _comm_worker(rank: int, port: int, out: Any) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=__import__("datetime").timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    p2p, ar = {}, {}
    for n in COMM_SIZES:
        t = torch.zeros(n // 4)

        def pingpong() -> None:
            if rank == 0:
                dist.send(t, 1)
                dist.recv(t, 1)
            else:
                dist.recv(t, 0)
                dist.send(t, 0)

        p2p[n] = _median_time(pingpong, 7) / 2
        ar[n] = _median_time(lambda: dist.all_reduce(t), 7)
    if rank == 0:
        out.put((p2p, ar))
    dist.barrier()
    dist.destroy_process_group()


def _fit(points: dict[int, float]) -> tuple[float, float]:
    xs = sorted(points)
    lo, hi = xs[0], xs[-1]
    per_byte = max(0.0, (points[hi] - points[lo]) / (hi - lo))
    return max(0.0, points[lo] - per_byte * lo), per_byte


def measure_comm(timeout_s: float = 120.0) -> CommModel:
    """Latency and seconds per byte of gloo p2p and all-reduce between two local processes."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_comm_worker, args=(r, port, q), daemon=True) for r in range(2)]
    for proc in procs:
        proc.start()
    try:
        p2p, ar = q.get(timeout=timeout_s)
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    p2p_lat, p2p_byte = _fit(p2p)
    ar_lat, ar_byte = _fit(ar)
    return CommModel(p2p_lat, p2p_byte, ar_lat, ar_byte)

