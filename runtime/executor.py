"""One pipeline executor for every schedule of the IR.

A schedule lists, per pipeline rank, the compute actions F / B / W in order. Communication is
implied by the stage -> rank placement (see ``ppdsl.core.schedules.ir``); ``comm_plan`` turns one
rank's action list into ``Step``s once, before training, so a training step only walks a
precomputed list:

- a message is an activation or an input gradient between two pipeline ranks; its receive
  buffer comes from a pool allocated once, as large as the most buffers the plan ever holds
  (shapes from the plan, never exchanged at run time);
- between a pair of ranks, messages are matched in order (NCCL ignores tags), so a rank posts
  its receives from a peer in exactly the order in which that peer sends them;
- the sends an action produces go out in the same ``batch_isend_irecv`` call as the receives
  the next action needs (Megatron's send_forward_recv_backward), and are only waited at the
  end of the step, so no schedule order can deadlock on a send.

Backward is either full (B) or split (B = input gradient only, W = weight gradient later, for
zero-bubble schedules). The split keeps, from B, the gradients arriving at the autograd nodes
where the weight branches leave the input-gradient path, so W computes only the weight
branches (the method of torch.distributed.pipelining's ``stage_backward_input``/``_weight``).
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.graph import GradientEdge, Node

from ppdsl.lowering.plan import Plan
from ppdsl.core.schedules.ir import Action, Op, Schedule

from .groups import ProcessGroups

if TYPE_CHECKING:
    from .trace import Recorder

MessageKind = Literal["act", "grad"]


class Stage(Protocol):
    """What the executor needs of a stage module (``runtime.stage.StageModule``)."""

    @property
    def stage(self) -> int: ...  # the virtual stage index

    def forward(self, x: torch.Tensor | None, mb: Any) -> torch.Tensor: ...

    def loss(self, output: torch.Tensor, mb: Any) -> torch.Tensor: ...

    def parameters(self) -> Iterator[nn.Parameter]: ...


# ---------------------------------------------------------------------------------------------
# The communication plan (pure Python)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Message:
    kind: MessageKind  # "act": output of stage - 1 for `stage`; "grad": input gradient of stage + 1
    microbatch: int
    stage: int  # the virtual stage that consumes it
    src: int  # pipeline ranks
    dst: int


@dataclass(frozen=True)
class Step:
    action: Action
    post: tuple[Message, ...]  # receives to post before this action, in per-peer send order
    needs: Message | None  # the received message this action consumes
    send: Message | None  # the message this action produces for another rank


def produced(action: Action, stage_ranks: Sequence[int]) -> Message | None:
    """The message `action` sends to another pipeline rank, if any."""
    s, mb, here = action.stage, action.microbatch, stage_ranks[action.stage]
    if action.op is Op.F and s + 1 < len(stage_ranks) and stage_ranks[s + 1] != here:
        return Message("act", mb, s + 1, here, stage_ranks[s + 1])
    if action.op is Op.B and s > 0 and stage_ranks[s - 1] != here:
        return Message("grad", mb, s - 1, here, stage_ranks[s - 1])
    return None


def consumed(action: Action, stage_ranks: Sequence[int]) -> Message | None:
    """The message `action` receives from another pipeline rank, if any."""
    s, mb, here = action.stage, action.microbatch, stage_ranks[action.stage]
    if action.op is Op.F and s > 0 and stage_ranks[s - 1] != here:
        return Message("act", mb, s, stage_ranks[s - 1], here)
    if action.op is Op.B and s + 1 < len(stage_ranks) and stage_ranks[s + 1] != here:
        return Message("grad", mb, s, stage_ranks[s + 1], here)
    return None


def rank_actions(schedule: Schedule, rank: int, forward_only: bool) -> tuple[Action, ...]:
    actions = schedule.ranks[rank]
    return tuple(a for a in actions if a.op is Op.F) if forward_only else actions


def comm_plan(
    schedule: Schedule, rank: int, *, forward_only: bool = False, lookahead: int = 1
) -> tuple[Step, ...]:
    """Rank `rank`'s actions with the receives to post before each and the send after each.

    `lookahead`: receives are posted for the next `lookahead` actions (1 = just in time).
    Raises ValueError when a rank needs a message that no rank sends.
    """
    assert lookahead >= 1
    stage_ranks = schedule.stage_ranks
    sent_to_me: dict[int, collections.deque[Message]] = collections.defaultdict(collections.deque)
    for src in range(schedule.pp):
        for a in rank_actions(schedule, src, forward_only):
            msg = produced(a, stage_ranks)
            if msg is not None and msg.dst == rank:
                sent_to_me[src].append(msg)
    actions = rank_actions(schedule, rank, forward_only)
    posted: set[Message] = set()
    steps = []
    for i, action in enumerate(actions):
        post: list[Message] = []
        for ahead in actions[i : i + lookahead]:
            msg = consumed(ahead, stage_ranks)
            if msg is None or msg in posted:
                continue
            queue = sent_to_me[msg.src]
            if msg not in queue:
                raise ValueError(f"rank {rank}: {ahead} needs {msg}, which rank {msg.src} never sends")
            while True:  # post everything the peer sends before msg, to keep per-pair order
                head = queue.popleft()
                post.append(head)
                posted.add(head)
                if head == msg:
                    break
        steps.append(Step(action, tuple(post), consumed(action, stage_ranks), produced(action, stage_ranks)))
    leftover = [m for q in sent_to_me.values() for m in q]
    if leftover:
        raise ValueError(f"rank {rank} never receives {leftover[0]} (and {len(leftover) - 1} more)")
    return tuple(steps)


# ---------------------------------------------------------------------------------------------
# Split backward: input gradient now, weight gradient later
# ---------------------------------------------------------------------------------------------


def _grad_node(t: torch.Tensor) -> Node | None:
    """grad_fn of `t`, or its AccumulateGrad node when `t` is a leaf that requires grad."""
    if t.grad_fn is not None:
        return t.grad_fn
    if not t.requires_grad:
        return None
    with torch.enable_grad():
        return t.view_as(t).grad_fn.next_functions[0][0]


def _parents(root: Node) -> dict[Node, list[Node]]:
    """Reverse edges of the autograd graph under `root`: node -> the nodes that consume it."""
    parents: dict[Node, list[Node]] = collections.defaultdict(list)
    seen = {root}
    queue = collections.deque([root])
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            parents[child].append(node)
            if child not in seen:
                seen.add(child)
                queue.append(child)
    return parents


def _upward(starts: Sequence[Node], parents: dict[Node, list[Node]], stop: set[Node]) -> tuple[set[Node], set[Node]]:
    """Nodes reachable from `starts` towards the output without entering `stop`; and the
    `stop` nodes met on the way."""
    closure, met = set(starts), set()
    queue = collections.deque(starts)
    while queue:
        for parent in parents.get(queue.popleft(), ()):
            if parent in closure:
                continue
            if parent in stop:
                met.add(parent)
                continue
            closure.add(parent)
            queue.append(parent)
    return closure, met


@dataclass
class _WeightGroup:
    params: list[torch.Tensor]
    intermediates: list[Node]
    grads: dict[Node, tuple[torch.Tensor | None, ...]] = field(default_factory=dict)


def graph_parameters(out: torch.Tensor, exclude: Sequence[torch.Tensor] = ()) -> list[torch.Tensor]:
    """The leaf tensors that require grad which `out`'s autograd graph accumulates into (the
    ``variable`` of its AccumulateGrad nodes), in the graph's breadth-first order, without
    `exclude` (a stage's input). These are the tensors the forward used, whatever the module
    holds now: FSDP2 swaps the unsharded parameters back for the sharded ones after a forward
    (zero = 3 with reshard_after_forward), and the weight gradients belong on the former."""
    root = _grad_node(out)
    if root is None:
        return []
    skip = {id(t) for t in exclude}
    found: dict[int, torch.Tensor] = {}
    seen = {root}
    queue = collections.deque([root])
    while queue:
        node = queue.popleft()
        variable = getattr(node, "variable", None)  # AccumulateGrad only
        if isinstance(variable, torch.Tensor) and id(variable) not in skip:
            found.setdefault(id(variable), variable)
        for child, _ in node.next_functions:
            if child is not None and child not in seen:
                seen.add(child)
                queue.append(child)
    return list(found.values())


def _weight_groups(
    out: torch.Tensor, x: torch.Tensor, params: Sequence[torch.Tensor] | None = None
) -> list[_WeightGroup] | None:
    """Group the parameters (default: every one `out`'s graph uses, ``graph_parameters``) by
    the input-path nodes their gradients leave from; None when the output does not depend on
    `x` (then W has to run a full backward)."""
    out_node, x_node = _grad_node(out), _grad_node(x)
    if out_node is None or x_node is None:
        return None
    parents = _parents(out_node)
    if x_node not in parents:
        return None
    if params is None:
        params = graph_parameters(out, (x,))
    input_path, _ = _upward([x_node], parents, set())
    by_node: dict[Node, _WeightGroup] = {}
    for p in params:
        p_node = _grad_node(p)
        if p_node not in parents:
            continue  # unused by this stage: its gradient stays None, as in a full backward
        _, met = _upward([p_node], parents, input_path)
        merged = {id(by_node[n]): by_node[n] for n in met if n in by_node}
        group = _WeightGroup([p], sorted(met, key=id))
        for other in merged.values():
            group.params += other.params
            group.intermediates += [n for n in other.intermediates if n not in group.intermediates]
        for n in group.intermediates:
            by_node[n] = group
    return list({id(g): g for g in by_node.values()}.values())


def backward_input(
    out: torch.Tensor, grad: torch.Tensor | None, x: torch.Tensor, params: Sequence[torch.Tensor] | None = None
) -> tuple[torch.Tensor | None, list[_WeightGroup] | None]:
    """B of a split backward: the gradient of `x`, and what ``backward_weight`` needs to
    accumulate the gradients of `params` (default: every parameter the graph used)."""
    groups = _weight_groups(out, x, params)
    if groups is None:
        return None, None
    handles = []
    for group in groups:
        for node in group.intermediates:

            def keep(grad_outputs: tuple[torch.Tensor | None, ...], group=group, node=node) -> None:
                group.grads[node] = grad_outputs

            handles.append(node.register_prehook(keep))
    try:
        (dx,) = torch.autograd.grad(out, (x,), None if grad is None else (grad,), retain_graph=True)
    finally:
        for h in handles:
            h.remove()
    return dx, groups


BeforeWeight = Callable[[Sequence[torch.Tensor]], None]  # backward_weight's hook: the parameters of a group


def backward_weight(groups: list[_WeightGroup], before: BeforeWeight | None = None) -> None:
    """W of a split backward: accumulate the weight gradients of every group. `before(params)`
    runs before each group's gradients are computed (ZeRO-3 with resharding all-gathers the
    weights there: a fused norm's backward reads its weight even for the weight's gradient)."""
    for group in groups:
        edges, grads = [], []
        for node in group.intermediates:
            for i, g in enumerate(group.grads.get(node, ())):
                if g is not None:
                    edges.append(GradientEdge(node, i))
                    grads.append(g)
        if not edges:
            continue
        if before is not None:
            before(group.params)
        handles = []
        if len(group.intermediates) > 1:
            # one intermediate can lie below another: pin each to its saved gradient so the
            # flow from the upper one is not counted twice
            for node in group.intermediates:
                saved = group.grads.get(node)
                if saved is not None:
                    handles.append(node.register_prehook(lambda _g, saved=saved: saved))
        try:
            dws = torch.autograd.grad(edges, group.params, grads, allow_unused=True)
        finally:
            for h in handles:
                h.remove()
        for p, dw in zip(group.params, dws):
            _accumulate(p, dw)
        group.grads.clear()


def _accumulate(p: torch.Tensor, dw: torch.Tensor | None) -> None:
    if dw is None:
        return
    if p.grad is None:
        p.grad = dw.clone(memory_format=torch.contiguous_format)  # dw may alias a saved gradient
    else:
        p.grad += dw


# ---------------------------------------------------------------------------------------------
# The executor
# ---------------------------------------------------------------------------------------------


class _BufferPool:
    """Receive buffers of one shape and dtype, reused across microbatches and steps."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        self.shape, self.dtype, self.device = shape, dtype, device
        self._free: list[torch.Tensor] = []
        self.allocated = 0

    def _new(self) -> torch.Tensor:
        self.allocated += 1
        return torch.empty(self.shape, dtype=self.dtype, device=self.device)

    def take(self) -> torch.Tensor:
        return self._free.pop() if self._free else self._new()

    def give(self, t: torch.Tensor) -> None:
        self._free.append(t)

    def reserve(self, n: int) -> None:
        """Allocate up front so that a step never allocates (`n`: the most buffers in use)."""
        self._free += [self._new() for _ in range(n - len(self._free))]


def buffers_in_use(steps: Sequence[Step], split_backward: bool, forward_only: bool = False) -> int:
    """The most receive buffers a rank holds at once when running `steps`: a buffer is taken
    when its receive is posted and given back when its (microbatch, stage) is done (after F
    when evaluating, else after the last of B / W)."""
    live = peak = 0
    held: collections.Counter[tuple[int, int]] = collections.Counter()
    for step in steps:
        live += len(step.post)
        peak = max(peak, live)
        a = step.action
        if step.needs is not None:
            held[(a.microbatch, a.stage)] += 1
        done = forward_only or a.op is (Op.W if split_backward else Op.B)
        if done:
            live -= held.pop((a.microbatch, a.stage), 0)
    return peak


@dataclass
class _Slot:
    """What one (microbatch, stage) keeps from its forward until its backward is done."""

    x: torch.Tensor | None = None  # stage input (a leaf), None on stage 0
    out: torch.Tensor | None = None  # stage output, or the scaled loss on the last stage
    grad: torch.Tensor | None = None  # gradient of `out` (None on the last stage)
    weight: list[_WeightGroup] | None = None  # split backward: pending weight gradients
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

    `activation_shape`: the shape of every tensor that crosses a stage boundary (activation
    and its gradient), from ``runtime.stage.activation_shape(plan)``. `wire_dtype`: their dtype
    on the wire (the parameters' dtype). `autocast`: a context factory for mixed precision.
    """

    def __init__(
        self,
        plan: Plan,
        stages: Sequence[Stage],
        groups: ProcessGroups,
        device: torch.device,
        activation_shape: Sequence[int],
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
        self._train_steps = comm_plan(schedule, self.pp_rank, lookahead=lookahead)
        self._eval_steps = comm_plan(schedule, self.pp_rank, forward_only=True, lookahead=lookahead)
        self._pool = _BufferPool(tuple(activation_shape), wire_dtype, device)
        self._pool.reserve(buffers_in_use(self._train_steps, self.split_backward))
        self._holds_loss = self.last_stage in self.stages
        # global ranks of this rank's pipeline peers, by pipeline rank
        self._peer = tuple(groups.pp_peer(r) for r in range(schedule.pp))
        self.recorder: Recorder | None = None  # runtime.trace: set to time every train step's actions
        self.progress: Any = None  # runtime.failure.StepStatus: told each action (the hang watchdog reads it)
        # a context factory around each split backward's W, yielding the `before` hook of
        # ``backward_weight`` (runtime.fsdp.WeightAccess under zero = 3 with resharding)
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
        totals = torch.zeros(2, dtype=torch.float32, device=self.device)
        if self._holds_loss and g.tp_rank == 0:
            totals[0] = sum_losses(state.losses) / self.microbatches
            if state.scores:
                totals[1] = sum_losses(state.scores)
        if g.layout.world > 1:
            dist.all_reduce(totals)
        return totals[0].item() / g.layout.dp, totals[1].item()

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
            buf = self._pool.take()
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

    def _take(self, state: _StepState, msg: Message | None, key: tuple[MessageKind, int, int]) -> tuple[torch.Tensor, bool]:
        """The tensor an action consumes: received (True) or handed over on this rank (False)."""
        if msg is not None:
            buf, _ = state.inbox.pop(msg)
            return buf, True
        return state.local.pop(key), False

    def _send(self, state: _StepState, msg: Message | None, key: tuple[MessageKind, int, int], t: torch.Tensor) -> None:
        if msg is None:
            state.local[key] = t
        else:
            state.unsent.append((msg, t.detach().to(self._pool.dtype).contiguous()))

    # -- compute ---------------------------------------------------------------------------

    def _forward(self, state: _StepState, step: Step) -> None:
        mb, s = step.action.microbatch, step.action.stage
        slot = state.slots.setdefault((mb, s), _Slot())
        module, data = self.stages[s], state.microbatches[mb]
        x = None
        if s > 0:
            x, received = self._take(state, step.needs, ("act", mb, s))
            if received:
                slot.buffers.append(x)
            x = x.detach()
            if not state.forward_only:
                x.requires_grad_(True)
        with self.autocast():
            out = module(x, data)  # through __call__: module hooks (FSDP's) run
            if s == self.last_stage:
                loss = module.loss(out, data)
        if s == self.last_stage:
            if state.forward_only:
                state.losses.append(loss.detach().float())
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
            grad, received = self._take(state, step.needs, ("grad", mb, s))
            if received:
                slot.buffers.append(grad)
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
            self._pool.give(buf)

    # -- loss ------------------------------------------------------------------------------

    def _mean_loss(self, state: _StepState) -> float:
        """Sum of the microbatch losses (mean for eval) on the last stage, averaged over dp and
        made known to every rank by one all-reduce over the world."""
        g = self.groups
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        if self._holds_loss and g.tp_rank == 0:
            total = sum_losses(state.losses)
            if state.forward_only:
                total = total / self.microbatches
        total = total.to(device=self.device, dtype=torch.float32)
        if g.layout.world > 1:
            dist.all_reduce(total)
        return total.item() / g.layout.dp

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


def sum_losses(losses: Sequence[torch.Tensor]) -> torch.Tensor:
    """The step loss from per-microbatch (scaled) losses; the reference uses the same routine
    so that both add in the same order."""
    total = losses[0].detach().float()
    for loss in losses[1:]:
        total = total + loss.detach().float()
    return total
