"""The whole model as a skeleton (parameters on the meta device, buffers real on the CPU), and
the checks a plan must pass against it before any stage is built."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Sequence

from torch import nn

from ppdsl.core.config_tree import thawed
from ppdsl.core.module_paths import under
from ppdsl.core.phrasing import not_divisible_by_tp
from ppdsl.lowering.plan import ModelRef, Plan

TP_STYLES = ("column", "row", "vocab", "replicate")


def build_skeleton(model: ModelRef) -> nn.Module:
    """The full model with parameters on the meta device and buffers real on the CPU."""
    from ppdsl.core.build import ModelLoadError, build_model

    with params_on_meta():
        try:
            # list values back as lists and nested blocks as dicts (the plan holds tuples and
            # FrozenDicts; strict HF configs refuse tuples)
            config = {k: thawed(v) for k, v in model.config_dict.items()}
            built = build_model(model.kind, model.target, config, device="cpu")
        except ModelLoadError as exc:
            raise ValueError(str(exc)) from None
    if model.document_masks:  # packed documents its own mask builders do not see
        from ppdsl.core.document_masks import use_document_masks

        use_document_masks(built)
    return built


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """Every parameter registered while active is moved to the meta device right away (its
    CPU allocation lives only until then); buffers and everything else stay real. Like
    accelerate's ``init_empty_weights(include_buffers=False)``. One Parameter registered under
    two names (``w = nn.Parameter(...); a.weight = w; b.weight = w``) stays one meta Parameter:
    the skeleton keeps the model's ties, as check's meta build finds them."""
    original = nn.Module.register_parameter
    moved: dict[int, tuple[weakref.ref, nn.Parameter]] = {}  # id of a real Parameter -> its meta one

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and not param.is_meta:
            seen = moved.get(id(param))
            if seen is not None and seen[0]() is param:
                module._parameters[name] = seen[1]
                return
            p = module._parameters[name]
            meta = type(p)(p.to("meta"), requires_grad=p.requires_grad)
            module._parameters[name] = meta
            # a weak reference: the real tensor is freed as before; a dead entry is dropped, so a
            # new Parameter that reuses the id is not taken for it
            key = id(param)
            moved[key] = (weakref.ref(param, lambda _ref, key=key: moved.pop(key, None)), meta)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def tied_groups(model: nn.Module) -> list[tuple[str, ...]]:
    by_id: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
    return [tuple(names) for names in by_id.values() if len(names) > 1]


def tied_map(model: nn.Module, groups: Sequence[tuple[str, ...]]) -> dict[str, tuple[str, nn.Module]]:
    """Every non-canonical tied name -> (canonical name, the canonical owner module)."""
    out = {}
    for names in groups:
        canonical = names[0]
        owner = model.get_submodule(canonical.rpartition(".")[0])
        for name in names[1:]:
            out[name] = (canonical, owner)
    return out


def check_request(plan: Plan, pp_rank: int) -> None:
    if plan.model.tied is None:
        raise ValueError("the plan was lowered without the model (--no-model), so it does not hold what check learned "
                         "of it; lower it with the model")
    if not 0 <= pp_rank < plan.mesh.pp:
        raise ValueError(f"pipeline rank {pp_rank} is outside the plan's pp = {plan.mesh.pp}")
    if not plan.stages_of(pp_rank):
        raise ValueError(f"the plan assigns no stage to pipeline rank {pp_rank}")
    if plan.sequence_parallel and plan.mesh.tp > 1:
        check_sequence_split(plan)
    for r in plan.tp:
        if r.style not in TP_STYLES:
            raise ValueError(f"{r.path}: unknown tensor-parallel style '{r.style}'")


def check_sequence_split(plan: Plan) -> None:
    if plan.train.seq_len % plan.mesh.tp != 0:
        raise ValueError(
            "sequence_parallel: " + not_divisible_by_tp(f"seq_len = {plan.train.seq_len}", plan.mesh.tp)
        )


def check_paths(skeleton: nn.Module, plan: Plan) -> None:
    blocks = submodule(skeleton, plan.blocks, "blocks")
    if not isinstance(blocks, (nn.ModuleList, nn.Sequential)):
        raise ValueError(f"blocks '{plan.blocks}' is a {type(blocks).__name__}, not an nn.ModuleList / nn.Sequential")
    if plan.num_blocks != len(blocks):
        raise ValueError(f"the plan counts {plan.num_blocks} blocks, '{plan.blocks}' has {len(blocks)}")
    for a in plan.stages:
        if not 0 <= a.block_start <= a.block_stop <= len(blocks):
            raise ValueError(f"stage {a.stage}: blocks [{a.block_start}, {a.block_stop}) outside 0..{len(blocks)}")
        for path in (*a.first, *a.last, *a.shared):
            submodule(skeleton, path, f"stage {a.stage}")
            if path == plan.blocks or under(path, plan.blocks) or under(plan.blocks, path):
                raise ValueError(f"stage {a.stage}: '{path}' overlaps the block list '{plan.blocks}'")
    for r in plan.tp:
        submodule(skeleton, r.path, "tensor_parallel")


def submodule(model: nn.Module, path: str, where: str) -> nn.Module:
    try:
        return model.get_submodule(path)
    except AttributeError:
        raise ValueError(f"{where}: {type(model).__name__} has no module '{path}'") from None


