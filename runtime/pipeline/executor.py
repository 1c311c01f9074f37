"""One pipeline executor for every schedule of the IR.

A schedule lists, per pipeline rank, the compute actions F / B / W in order. Communication is
implied by the stage -> rank placement (see ``ppdsl.core.schedules.ir``); the message pass
``ppdsl.core.schedules.messages`` turns one rank's action list into ``Step``s once, before training
(the same steps ``core.schedules.simulate`` runs to check the schedule), so a training step only
walks a precomputed list:

- a message is an activation or an input gradient between two pipeline ranks; its receive
  buffer comes from a pool allocated once, as large as the most buffers the plan ever holds
  (shapes from the plan, never exchanged at run time);
- between a pair of ranks, messages are matched in order (NCCL ignores tags), so a rank posts
  its receives from a peer in exactly the order in which that peer sends them;
- the sends an action produces go out in the same ``batch_isend_irecv`` call as the receives
  the next action needs (Megatron's send_forward_recv_backward), and are only waited at the
  end of the step, so no schedule order can deadlock on a send.

Backward is either full (B) or split (B = input gradient only, W = weight gradient later, for
zero-bubble schedules; ``runtime.pipeline.split_backward``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from ppdsl.lowering.plan import Plan
from ppdsl.core.schedules.ir import Action, Op
from ppdsl.core.schedules.messages import Message, MessageKind, Step, message_steps
from ppdsl.core.task_loss import at_least_fp32

from ppdsl.runtime.pipeline.recv_buffers import BufferPool, buffers_in_use
from ppdsl.runtime.parallel.groups import ProcessGroups
from ppdsl.runtime.pipeline.split_backward import BeforeWeight, WeightGroup, backward_input, backward_weight
from ppdsl.runtime.pipeline.step_loss import _loss_dtype, sum_losses

if TYPE_CHECKING:
    from ppdsl.runtime.train.trace import Recorder


class Stage(Protocol):
    """What the executor needs of a stage module (``runtime.stage.build.StageModule``)."""

    @property
    def stage(self) -> int: ...  # the virtual stage index

    def forward(self, x: torch.Tensor | None, mb: Any) -> torch.Tensor: ...

    def loss(self, output: torch.Tensor, mb: Any) -> torch.Tensor: ...

    def parameters(self) -> Iterator[nn.Parameter]: ...


# ---------------------------------------------------------------------------------------------
# The executor
# ---------------------------------------------------------------------------------------------


@dataclass
class _Slot:
    """What one (microbatch, stage) keeps from its forward until its backward is done."""

    x: torch.Tensor | None = None  # stage input (a leaf), None on stage 0
    out: torch.Tensor | None = None  # stage output, or the scaled loss on the last stage
    grad: torch.Tensor | None = None  # gradient of `out` (None on the last stage)
    weight: list[WeightGroup] | None = None  # split backward: pending weight gradients
    buffers: list[torch.Tensor] = field(default_factory=list)  # pool buffers to give back


@dataclass
class _StepState:
    microbatches: Sequence[Any]
    loss_scale: float
    forward_only: bool
    slots: dict[tuple[int, int], _Slot] = field(default_factory=dict)
    inbox: dict[Message, tuple[torch.Tensor, list[Any]]] = field(default_factory=dict)
    local: dict[tuple[MessageKind, int, int], torch.Tensor] = field(default_factory=dict)
    unsent: list[tuple[Message, torch.Tensor]] = field(default_factory=list)
    send_works: list[Any] = field(default_factory=list)
    in_flight: list[torch.Tensor] = field(default_factory=list)  # sent tensors, alive until waited
    losses: list[torch.Tensor] = field(default_factory=list)
    # forward only: score(stage, output, microbatch) of each microbatch on the last stage
    score: Callable[[Any, torch.Tensor, Any], torch.Tensor] | None = None
    scores: list[torch.Tensor] = field(default_factory=list)


class PipelineExecutor:
    """Runs the plan's schedule on this rank's stages, one training (or evaluation) step at a time.

    `activation_shape`: the shape of the tensor that crosses each stage boundary (activation
    and its gradient): one shape for every boundary, or one per boundary by sending stage
    (``runtime.stage.build.boundary_shapes(plan)``: the plan's, as check traced them). `wire_dtype`:
    their dtype on the wire (the parameters' dtype). `autocast`: a context factory for mixed
    precision.
    """

    def __init__(
        self,
        plan: Plan,
        stages: Sequence[Stage],
        groups: ProcessGroups,
        device: torch.device,
        activation_shape: Sequence[int] | Sequence[Sequence[int]],
        *,
        wire_dtype: torch.dtype = torch.float32,
        autocast: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
        lookahead: int = 1,
    ) -> None:
        schedule = plan.schedule
        self.plan, self.schedule, self.groups, self.device = plan, schedule, groups, device
        self.pp_rank = groups.pp_rank
        self.stages = {s.stage: s for s in stages}
        expected = set(schedule.stages_of(self.pp_rank))
        if set(self.stages) != expected:
            raise ValueError(f"pipeline rank {self.pp_rank} holds stages {sorted(expected)}, got {sorted(self.stages)}")
        self.last_stage = schedule.num_stages - 1
        self.microbatches = schedule.microbatches
        self.split_backward = schedule.split_backward
        self.autocast = autocast
        self._train_steps = message_steps(schedule, self.pp_rank, lookahead=lookahead)
        self._eval_steps = message_steps(schedule, self.pp_rank, forward_only=True, lookahead=lookahead)
        self._boundary = _per_boundary(activation_shape, schedule.num_stages)
        # one pool per wire length, each as large as the most buffers of that length held at once
        self._pools = {n: BufferPool((n,), wire_dtype, device) for n in {_wire_numel(s) for s in self._boundary}}
        for n, pool in self._pools.items():
            pool.reserve(buffers_in_use(self._train_steps, self.split_backward,
                                        held=lambda m, n=n: _wire_numel(self._shape_of(m)) == n))
        # the dtype each boundary's tensors leave their stage in, read from the first message
        self._sent_dtype: dict[tuple[MessageKind, int], torch.dtype] = {}
        self._dtype = wire_dtype
        self._holds_loss = self.last_stage in self.stages
        # global ranks of this rank's pipeline peers, by pipeline rank
        self._peer = tuple(groups.pp_peer(r) for r in range(schedule.pp))
        self.recorder: Recorder | None = None  # runtime.train.trace: set to time every train step's actions
        self.progress: Any = None  # runtime.run.failure.StepStatus: told each action (the hang watchdog reads it)
        # a context factory around each split backward's W, yielding the `before` hook of
        # ``backward_weight`` (runtime.parallel.fsdp.WeightAccess under zero = 3 with resharding)
        self.weight_access: Callable[[], contextlib.AbstractContextManager[BeforeWeight]] | None = None
        self._warm_up_p2p()

    # -- public ----------------------------------------------------------------------------

    def train_step(self, microbatches: Sequence[Any], loss_scale: float = 1.0) -> float:
        """Forward and backward of every microbatch; gradients accumulate in the parameters'
        ``.grad`` (not zeroed here). Returns the step's mean loss, the same on every rank."""
        state = _StepState(self._check(microbatches), loss_scale, forward_only=False)
        rec = self.recorder
        if rec is None:
            with torch.enable_grad():
                self._run(self._train_steps, state)
            return self._mean_loss(state)
        start = rec.now()
        with torch.enable_grad():
            self._run(self._train_steps, state, rec)
        t = rec.now()
        loss = self._mean_loss(state)
        end = rec.now()
        rec.events += [("loss all-reduce", -1, -1, t, end), ("pipeline", -1, -1, start, end)]
        return loss

    @torch.no_grad()
    def eval_step(self, microbatches: Sequence[Any]) -> float:
        """Forward only; returns the mean loss over the microbatches on every rank."""
        state = _StepState(self._check(microbatches), 1.0, forward_only=True)
        self._run(self._eval_steps, state)
        return self._mean_loss(state)

    @torch.no_grad()
    def eval_sums(
        self, microbatches: Sequence[Any], score: Callable[[Any, torch.Tensor, Any], torch.Tensor] | None = None
    ) -> tuple[float, float]:
        """Forward only: (the mean loss over the microbatches, averaged over dp; the sum of
        ``score(stage, output, microbatch)`` over the microbatches and dp replicas), the same on
        every rank. `score` runs on every tp rank of the last stage (it may be collective over
        tp), tp rank 0's result counts."""
        state = _StepState(self._check(microbatches), 1.0, forward_only=True, score=score)
        self._run(self._eval_steps, state)
        g = self.groups
        totals = torch.zeros(2, dtype=_loss_dtype(g, self._dtype), device=self.device)
        if self._holds_loss and g.tp_rank == 0:
            totals[0] = sum_losses(state.losses) / self.microbatches
            if state.scores:
                totals[1] = sum_losses(state.scores)
        if g.layout.world > 1:
            dist.all_reduce(totals)
        return totals[0].item() / g.layout.replicas, totals[1].item()

    # -- the step loop ---------------------------------------------------------------------

    def _check(self, microbatches: Sequence[Any]) -> Sequence[Any]:
        if len(microbatches) != self.microbatches:
            raise ValueError(f"the schedule runs {self.microbatches} microbatches, got {len(microbatches)}")
        return microbatches

    def _run(self, steps: Sequence[Step], state: _StepState, rec: Recorder | None = None) -> None:
        progress = self.progress
        for step in steps:
            if progress is not None:
                progress.act(step.action)
            if rec is not None:
                self._run_traced(step, state, rec)
                continue
            self._exchange(state, step.post)
            if step.needs is not None:
                self._wait(state, step.needs)
            self._compute(state, step)
        if rec is None:
            self._exchange(state, ())
            for work in state.send_works:
                work.wait()
        else:
            t0 = rec.now()
            self._exchange(state, ())
            t1 = rec.now()
            for work in state.send_works:
                work.wait()
            t2 = rec.now()
            rec.events += [("p2p", -1, -1, t0, t1), ("send wait", -1, -1, t1, t2)]
        assert not state.inbox and not state.local and not state.slots, (state.inbox, state.local, state.slots)

    def _compute(self, state: _StepState, step: Step) -> None:
        op = step.action.op
        if op is Op.F:
            self._forward(state, step)
        elif op is Op.B:
            self._backward(state, step)
        else:
            self._weight(state, step.action)

    def _run_traced(self, step: Step, state: _StepState, rec: Recorder) -> None:
        """One step of the loop in `_run`, each part timed into `rec`."""
        a, now, events = step.action, rec.now, rec.events
        t0 = now()
        if state.unsent or step.post:
            self._exchange(state, step.post)
            t1 = now()
            events.append(("p2p", -1, -1, t0, t1))
            t0 = t1
        if step.needs is not None:
            self._wait(state, step.needs)
            t1 = now()
            events.append(("wait", a.stage, a.microbatch, t0, t1))
            t0 = t1
        self._compute(state, step)
        events.append((a.op.value, a.stage, a.microbatch, t0, now()))

    def _exchange(self, state: _StepState, post: Sequence[Message]) -> None:
        """One batched p2p call: the previous action's send and the receives posted now."""
        ops, recvs = [], []
        for msg, tensor in state.unsent:
            ops.append(dist.P2POp(dist.isend, tensor, self._peer[msg.dst]))
        for msg in post:
            buf = self._pools[_wire_numel(self._shape_of(msg))].take()
            ops.append(dist.P2POp(dist.irecv, buf, self._peer[msg.src]))
            recvs.append((msg, buf))
        if not ops:
            return
        works = dist.batch_isend_irecv(ops)
        n_send = len(state.unsent)
        state.in_flight += [t for _, t in state.unsent]
        state.unsent = []
        if len(works) == len(ops):  # one work per op (gloo)
            state.send_works += works[:n_send]
            for (msg, buf), work in zip(recvs, works[n_send:]):
                state.inbox[msg] = (buf, [work])
        else:  # one coalesced work for the whole batch (NCCL)
            state.send_works += works
            for msg, buf in recvs:
                state.inbox[msg] = (buf, works)

    def _wait(self, state: _StepState, msg: Message) -> None:
        buf, works = state.inbox[msg]
        for work in works:
            work.wait()

    def _take(self, state: _StepState, msg: Message | None,
              key: tuple[MessageKind, int, int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The tensor an action consumes, in the dtype its stage sent it in, and the receive buffer
        it came in (None: handed over on this rank)."""
        if msg is None:
            return state.local.pop(key), None
        buf, _ = state.inbox.pop(msg)
        boundary = (msg.kind, msg.stage)
        dtype = self._sent_dtype.get(boundary)
        if dtype is None:  # the same every microbatch and step: read once (a host sync on CUDA)
            dtype = self._sent_dtype[boundary] = _WIRE_DTYPES[int(buf[-1].item())]
        t = buf[:-1].view(self._shape_of(msg))
        return (t if t.dtype == dtype else t.to(dtype)), buf

    def _send(self, state: _StepState, msg: Message | None, key: tuple[MessageKind, int, int], t: torch.Tensor) -> None:
        """A tensor for another stage: handed over on this rank, or put on the wire in the wire dtype
        (which holds every value of a lower-precision one exactly) with a last element naming its
        own dtype, so the receiver computes on what one process would: a block under autocast may
        pass on bf16 (Swin's), which the next block must not get as fp32."""
        if msg is None:
            state.local[key] = t
            return
        wire = torch.empty(t.numel() + 1, dtype=self._dtype, device=t.device)
        wire[:-1].copy_(t.detach().reshape(-1))
        wire[-1] = _WIRE_CODES[t.dtype]
        state.unsent.append((msg, wire))

    # -- compute ---------------------------------------------------------------------------

    def _forward(self, state: _StepState, step: Step) -> None:
        mb, s = step.action.microbatch, step.action.stage
        slot = state.slots.setdefault((mb, s), _Slot())
        module, data = self.stages[s], state.microbatches[mb]
        x = None
        if s > 0:
            x, buf = self._take(state, step.needs, ("act", mb, s))
            if buf is not None:
                slot.buffers.append(buf)
            x = x.detach()
            if not state.forward_only:
                x.requires_grad_(True)
        with self.autocast():
            out = module(x, data)  # through __call__: module hooks (FSDP's) run
            if s == self.last_stage:
                loss = module.loss(out, data)
        if s == self.last_stage:
            if state.forward_only:
                state.losses.append(at_least_fp32(loss.detach()))
                if state.score is not None:
                    state.scores.append(state.score(module, out, data).detach().float())
            else:
                scaled = loss / self.microbatches
                state.losses.append(scaled.detach())
                slot.out = scaled if state.loss_scale == 1.0 else scaled * state.loss_scale
        else:
            self._send(state, step.send, ("act", mb, s + 1), out)
            if not state.forward_only:
                slot.out = out
        slot.x = None if state.forward_only else x
        if state.forward_only:
            self._release(state, (mb, s))

    def _backward(self, state: _StepState, step: Step) -> None:
        mb, s = step.action.microbatch, step.action.stage
        slot = state.slots[(mb, s)]
        if s < self.last_stage:
            grad, buf = self._take(state, step.needs, ("grad", mb, s))
            if buf is not None:
                slot.buffers.append(buf)
            slot.grad = grad if grad.dtype == slot.out.dtype else grad.to(slot.out.dtype)
        dx = None
        if self.split_backward:
            if slot.x is not None:
                dx, slot.weight = backward_input(slot.out, slot.grad, slot.x)
            if slot.weight is not None:
                slot.out = slot.grad = None  # W starts from the saved intermediate gradients
        else:
            torch.autograd.backward(slot.out, None if slot.grad is None else slot.grad)
            dx = None if slot.x is None else slot.x.grad
            slot.out = slot.grad = None
        if s > 0:
            assert dx is not None, f"stage {s} got no input gradient for microbatch {mb}"
            self._send(state, step.send, ("grad", mb, s - 1), dx)
        slot.x = None
        if not self.split_backward:
            self._release(state, (mb, s))

    def _weight(self, state: _StepState, action: Action) -> None:
        key = (action.microbatch, action.stage)
        slot = state.slots[key]
        if slot.weight is not None:
            if self.weight_access is None:
                backward_weight(slot.weight)
            else:
                with self.weight_access() as need:
                    backward_weight(slot.weight, need)
        else:  # the input does not require grad (stage 0): W is the whole backward
            torch.autograd.backward(slot.out, slot.grad)
        slot.weight = slot.out = slot.grad = None
        self._release(state, key)

    def _release(self, state: _StepState, key: tuple[int, int]) -> None:
        slot = state.slots.pop(key)
        for buf in slot.buffers:
            self._pools[buf.numel()].give(buf)

    @property
    def _pool(self) -> Any:
        """All receive buffers as one count (``allocated``: what the pools hold together)."""
        return _Allocated(sum(p.allocated for p in self._pools.values()))

    def _shape_of(self, msg: Message) -> tuple[int, ...]:
        """The shape of a message: its boundary's (an activation for stage s crossed s - 1 -> s, an
        input gradient for stage s crossed s -> s + 1)."""
        return self._boundary[msg.stage - 1 if msg.kind == "act" else msg.stage]

    # -- loss ------------------------------------------------------------------------------

    def _mean_loss(self, state: _StepState) -> float:
        """Sum of the microbatch losses (mean for eval) on the last stage, averaged over dp and
        made known to every rank by one all-reduce over the world."""
        g = self.groups
        dtype = _loss_dtype(g, self._dtype)
        total = torch.zeros((), dtype=dtype, device=self.device)
        if self._holds_loss and g.tp_rank == 0:
            total = sum_losses(state.losses)
            if state.forward_only:
                total = total / self.microbatches
        total = total.to(device=self.device, dtype=dtype)
        if g.layout.world > 1:
            dist.all_reduce(total)
        return total.item() / g.layout.replicas

    # -- setup -----------------------------------------------------------------------------

    def _warm_up_p2p(self) -> None:
        """Exchange one tiny tensor with both pipeline neighbours: NCCL wants the first batched
        p2p call of a group to involve every rank, and a missing peer fails here, early."""
        pp = self.schedule.pp
        if pp == 1:
            return
        nxt, prv = (self.pp_rank + 1) % pp, (self.pp_rank - 1) % pp
        out = torch.full((1,), float(self.pp_rank), device=self.device)
        got = torch.empty(1, device=self.device)
        works = dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, out, self._peer[nxt]), dist.P2POp(dist.irecv, got, self._peer[prv])]
        )
        for w in works:
            w.wait()
        assert int(got.item()) == prv, (got, prv)


@dataclass(frozen=True)
class _Allocated:
    allocated: int


# a wire message: the tensor's values, then the code of its own dtype
_WIRE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_WIRE_CODES = {d: float(i) for i, d in enumerate(_WIRE_DTYPES)}


def _wire_numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n + 1


def _per_boundary(shapes: Sequence[int] | Sequence[Sequence[int]], stages: int) -> tuple[tuple[int, ...], ...]:
    """One shape per boundary (by sending stage): the given list, or one shape repeated. One stage
    has no boundary."""
    if stages <= 1:
        return ()
    if shapes and not isinstance(shapes[0], int):
        out = tuple(tuple(int(d) for d in shape) for shape in shapes)  # type: ignore[union-attr]
        if len(out) != stages - 1:
            raise ValueError(f"{len(out)} boundary shapes for {stages} stages")
        return out
    return (tuple(int(d) for d in shapes),) * max(stages - 1, 1)  # type: ignore[arg-type]
