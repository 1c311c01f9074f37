"""`ppdsl run --memory-trace`: each rank's peak of live tensor bytes over the run (issue 34).

On CUDA the figure is `torch.cuda.max_memory_allocated` since the tracker started (the caching
allocator's count of tensor bytes, not what it reserves). On CPU torch counts nothing, so
`LiveBytes`, a dispatch mode, counts every tensor storage alive: the parameters, gradients,
optimizer state and buffers the rank holds when tracking starts (`track`), and every storage an
op reads or writes from then on, until it is freed (a weak reference to the storage tells). Its
peak is the most bytes alive at once, and `at` says where it came (the phase and the op). torch's
MemTracker counts the same way but refuses a module called more than once per step, and every
microbatch calls it. The counter sees the ops of the thread that entered it (the training loop;
autograd runs a CPU backward in that thread) and storages it never saw an op touch are not
counted (a tensor made and freed outside any op).

`benchmarks/bench_memory.py` measures with the same counter.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import attrs
import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

class LiveBytes(TorchDispatchMode):
    """A dispatch mode whose ``peak`` is the most bytes of CPU tensor storages alive at once."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._refs: dict[int, Any] = {}
        self.phase = "forward / backward"  # set by the caller: what is running
        self.op = "state"
        self.at = ""  # the phase and op of the peak
        self.phase_peaks: dict[str, int] = {}  # each phase's most bytes alive at once

    def track(self, tree: Any) -> None:
        """Count the storages of the tensors in `tree` (any nesting) not counted yet."""
        for t in tree_flatten(tree)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            if is_traceable_wrapper_subclass(t):  # a DTensor (FSDP2): the local tensors it wraps
                attrs_, _ = t.__tensor_flatten__()  # type: ignore[attr-defined]
                self.track([getattr(t, a) for a in attrs_])
                continue
            if t.device.type != "cpu":
                continue
            try:
                st = t.untyped_storage()
            except (RuntimeError, NotImplementedError):  # no storage of its own (a functional wrapper)
                continue
            key, n = st.data_ptr(), st.nbytes()
            if n == 0 or key in self._refs:
                continue
            self.live += n
            if self.live > self.phase_peaks.get(self.phase, 0):
                self.phase_peaks[self.phase] = self.live
            if self.live > self.peak:
                self.peak, self.at = self.live, f"{self.phase}: {self.op}"
            self._refs[key] = weakref.ref(st, lambda _, k=key, n=n: self._free(k, n))

    def _free(self, key: int, n: int) -> None:
        if self._refs.pop(key, None) is not None:
            self.live -= n

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.op = getattr(func, "overloadpacket", func).__name__  # mm, not mm.default
        self.track((args, kwargs))
        out = func(*args, **(kwargs or {}))
        self.track(out)
        return out


@attrs.frozen
class MeasuredMemory:
    """One rank's measurement."""

    rank: int
    peak: int  # bytes
    start: int  # bytes alive when tracking started (CPU: the state `track` was given)
    at: str  # where the peak came (CPU), "" on CUDA
    how: str  # "live tensor bytes (dispatch counter)" or "torch.cuda.max_memory_allocated"


class MemoryTracker:
    """`track` the state, `start`, run the steps (`phase` names what runs), `stop`, `result`.
    `steps`: stop counting after that many steps (`after_step`), 0 for all of them."""

    def __init__(self, device: torch.device, rank: int, steps: int = 0) -> None:
        self.device, self.rank, self.limit = device, rank, steps
        self.mode = LiveBytes() if device.type == "cpu" else None
        self.steps = 0  # steps counted
        self._start = 0
        self._cuda_peak: int | None = None
        self._on = False
        if self.mode is None:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            self._start = torch.cuda.memory_allocated(device)

    def track(self, tensors: Iterable[Any]) -> None:
        if self.mode is not None:
            self.mode.track(list(tensors))
            self._start = self.mode.live

    def phase(self, name: str) -> None:
        if self.mode is not None:
            self.mode.phase = name

    def start(self) -> None:
        if self.mode is not None:
            self.mode.__enter__()
        self._on = True

    def after_step(self, step: int) -> None:
        """Count the step; stop once `steps` are counted."""
        if self._on:
            self.steps += 1
            if self.limit and self.steps >= self.limit:
                self.stop()

    def stop(self) -> None:
        if not self._on:
            return
        self._on = False
        if self.mode is not None:
            self.mode.__exit__(None, None, None)
        else:
            torch.cuda.synchronize(self.device)
            self._cuda_peak = torch.cuda.max_memory_allocated(self.device)

    def result(self) -> MeasuredMemory:
        self.stop()
        if self.mode is not None:
            return MeasuredMemory(self.rank, self.mode.peak, self._start, self.mode.at,
                                  "live tensor bytes (dispatch counter)")
        assert self._cuda_peak is not None
        return MeasuredMemory(self.rank, self._cuda_peak, self._start, "", "torch.cuda.max_memory_allocated")


def trainer_state(trainer: Any) -> list[torch.Tensor]:
    """What a rank holds between steps: parameters, gradients, optimizer state, buffers."""
    params = list(trainer.params)
    return [*params, *(p.grad for p in params if p.grad is not None),
            *(v for p in params for v in trainer.optimizer_state(p).values() if isinstance(v, torch.Tensor)),
            *(b for s in trainer.stages for b in s.buffers())]


def tracked_optimizer(trainer: Any, tracker: MemoryTracker) -> None:
    """Name the step's phases after the pipeline as the tracker's phase while they run: the
    gradient sync (and the inf / nan check), the clipping, the optimizer step (then forward /
    backward again), as lowering/rank_memory.py predicts them."""
    for method, phase in (("sync_gradients", "grad sync"), ("unscale_and_check", "grad sync"), ("clip", "clip"),
                          ("optimizer_step", "optimizer")):
        _named(trainer, method, phase, tracker)


def _named(trainer: Any, method: str, phase: str, tracker: MemoryTracker) -> None:
    run = getattr(trainer, method)

    def named(*args: Any, **kwargs: Any) -> Any:
        tracker.phase(phase)
        try:
            return run(*args, **kwargs)
        finally:
            tracker.phase("forward / backward")

    setattr(trainer, method, named)
