"""Cut a stage out of the skeleton (like torch.distributed.pipelining's ``pipeline_module_split``):
its first / last modules, its blocks, copies of the parameter-free modules, then its meta
parameters materialised on the device.

Parameters held by a module the stages split (the root's: Blip2's ``query_tokens``; LLaVA-NeXT's
``model.image_newline``), which check's trace proved the forward reads before the blocks only,
are the first stage's; a later stage holds zeros of their shape in their place (not saved, never
trained), which its forward reads only on its way to its stand-ins (check's cut proof runs it so)."""

from __future__ import annotations

import copy

import torch
from torch import nn

from ppdsl.runtime.stage.adapters.base import StageAdapter
from ppdsl.lowering.plan import Plan, StageAssignment

from ppdsl.core.module_paths import under
from ppdsl.runtime.stage.module import Container, StageModule


def has_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def assemble_stage(plan: Plan, assignment: StageAssignment, adapter: StageAdapter, skeleton: nn.Module) -> StageModule:
    block_ids = range(assignment.block_start, assignment.block_stop)
    shell = copy.copy(skeleton)
    stage = StageModule(
        assignment,
        num_stages=len(plan.stages),
        adapter=adapter,
        shell=shell,
        tp_group=None,  # set by apply_tp when tp > 1
        block_names=[f"{plan.blocks}.{i}" for i in block_ids],
        task=plan.model.task,
    )
    keep = set(assignment.first) | set(assignment.last) | set(assignment.shared)
    _populate(stage, skeleton, "", keep, plan.blocks, block_ids, adapter.own_forward, assignment.stage == 0)
    for name, buf in skeleton._buffers.items():
        if buf is not None:
            stage.register_buffer(name, buf, persistent=name not in skeleton._non_persistent_buffers_set)
    return stage


def _populate(dst: nn.Module, src: nn.Module, prefix: str, keep: set[str], blocks: str, block_ids: range,
              real_containers: bool = False, first: bool = False) -> None:
    """Copy into ``dst`` the part of ``src``'s subtree this stage needs (see module docstring).
    ``real_containers`` (the own forward, which calls them): an intermediate module is a shallow
    copy of the real one holding only the stage's part, not a `Container`. ``first``: the first
    stage, which holds the split modules' own parameters (a later one zeros of their shape)."""
    for name, param in src._parameters.items():
        if param is None:
            continue
        if first:
            dst.register_parameter(name, param)
        else:
            dst.register_buffer(name, torch.zeros(param.shape, dtype=param.dtype), persistent=False)
    for name, child in src.named_children():
        path = f"{prefix}.{name}" if prefix else name
        if path in keep:
            dst.add_module(name, child)
        elif path == blocks:
            if len(block_ids):
                dst.add_module(name, nn.ModuleDict({str(i): child[i] for i in block_ids}))
        elif not has_params(child):
            dst.add_module(name, copy.deepcopy(child))
        elif any(under(k, path) for k in keep) or (under(blocks, path) and len(block_ids)):
            sub = _real_container(child) if real_containers else Container()
            for buf_name, buf in child._buffers.items():
                if buf is not None:
                    sub.register_buffer(buf_name, buf, persistent=buf_name not in child._non_persistent_buffers_set)
            _populate(sub, child, path, keep, blocks, block_ids, real_containers, first)
            dst.add_module(name, sub)


def _real_container(module: nn.Module) -> nn.Module:
    """A shallow copy of ``module`` with its own, empty, module / parameter / buffer / hook tables."""
    sub = copy.copy(module)
    for table in ("_modules", "_parameters", "_buffers", "_forward_hooks", "_forward_pre_hooks",
                  "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called",
                  "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks", "_load_state_dict_pre_hooks"):
        if table in module.__dict__:
            sub.__dict__[table] = type(module.__dict__[table])()
    sub.__dict__["_non_persistent_buffers_set"] = set()
    return sub


def materialize(module: nn.Module, device: torch.device, memo: dict[int, nn.Parameter],
                dtype: torch.dtype = torch.float32) -> None:
    """Replace meta parameters by uninitialised ones on ``device`` (one per meta Parameter, via
    ``memo``, so tied parameters stay one object, and a module several stages hold is done once);
    move buffers to ``device``. Floating parameters and buffers built in float32 become ``dtype``
    (the plan's `parameter_dtype`); a model that builds some in another dtype keeps those."""
    for m in module.modules():
        for name, param in list(m._parameters.items()):
            if param is None:
                continue
            new = memo.get(id(param))
            if new is None:
                assert param.is_meta, f"parameter {name} of {type(m).__name__} is not on meta"
                new = nn.Parameter(torch.empty_like(param, device=device, dtype=_as(param.dtype, dtype)),
                                   requires_grad=param.requires_grad)
                memo[id(param)] = memo[id(new)] = new  # a module two of the rank's stages hold (shared) meets it again
            m._parameters[name] = new
        for name, buf in list(m._buffers.items()):
            if buf is not None:
                assert not buf.is_meta, f"buffer {name} of {type(m).__name__} is on meta"
                m._buffers[name] = buf.to(device, _as(buf.dtype, dtype))


def _as(built: torch.dtype, wanted: torch.dtype) -> torch.dtype:
    return wanted if built == torch.float32 else built
