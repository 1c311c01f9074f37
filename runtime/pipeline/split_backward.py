"""Split backward: the input gradient now (B), the weight gradient later (W), for zero-bubble
schedules.

B keeps the gradients arriving at the autograd nodes where the weight branches leave the
input-gradient path, so W computes only the weight branches (the method of
torch.distributed.pipelining's ``stage_backward_input`` / ``stage_backward_weight``).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node


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
class WeightGroup:
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
) -> list[WeightGroup] | None:
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
    by_node: dict[Node, WeightGroup] = {}
    for p in params:
        p_node = _grad_node(p)
        if p_node not in parents:
            continue  # unused by this stage: its gradient stays None, as in a full backward
        _, met = _upward([p_node], parents, input_path)
        merged = {id(by_node[n]): by_node[n] for n in met if n in by_node}
        group = WeightGroup([p], sorted(met, key=id))
        for other in merged.values():
            group.params += other.params
            group.intermediates += [n for n in other.intermediates if n not in group.intermediates]
        for n in group.intermediates:
            by_node[n] = group
    return list({id(g): g for g in by_node.values()}.values())


def backward_input(
    out: torch.Tensor, grad: torch.Tensor | None, x: torch.Tensor, params: Sequence[torch.Tensor] | None = None
) -> tuple[torch.Tensor | None, list[WeightGroup] | None]:
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


def backward_weight(groups: list[WeightGroup], before: BeforeWeight | None = None) -> None:
    """W of a split backward: accumulate the weight gradients of every group. `before(params)`
    runs before each group's gradients are computed (ZeRO-3 with resharding all-gathers the
    weights there: a fused norm's backward reads its weight even for the weight's gradient)."""
    for k, group in enumerate(groups):
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
            dws = torch.autograd.grad(edges, group.params, grads, allow_unused=True,
                                      retain_graph=k < len(groups) - 1)
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


