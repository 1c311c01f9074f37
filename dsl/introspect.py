"""Model introspection on the meta device.

`introspect` builds a model without allocating memory (every tensor on ``torch.device("meta")``)
and returns a `ModelInfo`: pure data (no torch objects) describing every module path, its kind
and shapes, own parameter counts, tied parameters and the HF config. `ppdsl check` uses it for
the model-level rules (features % tp, heads % tp, vocab % tp, ...), `ppdsl plan` for parameter
counts per stage. Building the model itself is `ppdsl.core.build`, which the runtime uses too.

torch and transformers are imported lazily, inside the functions: importing this module is
instant and torch-free, like the rest of ``ppdsl.dsl``.
"""

from __future__ import annotations

import contextlib
import difflib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from ppdsl.core.build import build, exc_text, quiet_transformers
from ppdsl.core.config_tree import deep_merge
from ppdsl.core import model_inputs
from ppdsl.core.experts import expert_count
from ppdsl.core.own_tp import head_width

if TYPE_CHECKING:
    from torch import nn

__all__ = ["ModelInfo", "ModuleInfo", "block_paths", "describe", "introspect", "params_under", "size_problem"]


# check builds a model (on the meta device) only below these: a config beyond them is refused
# (E0408) instead of spending minutes and gigabytes tracing it. The largest published
# transformers have a few hundred blocks and about 2 x 10^12 parameters; a trace of 1,024 blocks
# takes about 50 s and 2 GB on two cores, and grows faster than the block count beyond.
MAX_BLOCKS = 1_024
MAX_PARAMS = 10**13


def size_problem(dims: Mapping[str, object]) -> str | None:
    """Why a model of these canonical dims (families.Family.dims) is too large to build at
    check time, or None. Parameters are estimated as blocks x (4 h^2 + 2 h ffn) + vocab x h."""
    def dim(name: str) -> int:
        v = dims.get(name)
        return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else 0

    layers, hidden, ffn, vocab = dim("layers"), dim("hidden"), dim("ffn"), dim("vocab")
    if layers > MAX_BLOCKS:
        return f"{layers:,} blocks, more than check builds ({MAX_BLOCKS:,})"
    estimate = layers * (4 * hidden * hidden + 2 * hidden * (ffn or 4 * hidden)) + vocab * hidden
    if estimate > MAX_PARAMS:
        return f"about {estimate:.2e} parameters, more than check builds ({MAX_PARAMS:.0e})"
    return None


@attrs.frozen
class ModuleInfo:
    """One module of a model, by path. Pure data: no torch objects."""

    path: str
    type_name: str
    kind: str  # "linear" | "conv1d" | "embedding" | "norm" | "container" | "other"
    in_features: int | None
    out_features: int | None
    num_embeddings: int | None
    embedding_dim: int | None
    has_bias: bool
    num_params: int  # own parameters only; a tied parameter counts at its first path only
    param_bytes: int
    children: tuple[str, ...]
    scalar_params: tuple[str, ...] = ()  # own 0-dim parameters (FSDP2, zero = 3, cannot shard them)
    experts: int = 0  # a MoE layer's experts module (ppdsl.core.experts): how many experts it holds
    head_dim: int | None = None  # an attention module's ``head_dim`` attribute (the own forward's kv parts)
    # its ``num_key_value_groups``: query heads per kv head, as transformers' repeat_kv reads them
    kv_groups: int | None = None
    # a layer that treats each position of the sequence alone (a linear layer, a norm over the
    # features, a dropout, an activation): what sequence parallelism may run on a part of the sequence
    position_wise: bool = False


@attrs.frozen
class ModelInfo:
    """A whole model: every module path ("" is the root), the config and the tied parameters.

    ``modules`` and ``config`` are plain dicts; treat them as read-only.
    """

    class_name: str
    modules: Mapping[str, ModuleInfo]
    config: Mapping[str, object]
    tied: tuple[tuple[str, str], ...]
    total_params: int
    # ppdsl.dsl.tp_dataflow.DataFlow of one meta forward (introspect(..., dataflow=True)), or None
    dataflow: Any = None
    dataflow_error: str | None = None  # why the forward could not be traced
    # ppdsl.dsl.own_layout.OwnLayout for an HF class no family claims (its own forward), else None
    own_layout: Any = None
    # ppdsl.dsl.attention_probe.AttentionProbe of one meta forward (HF models, dataflow=True), or None
    attention: Any = None
    attention_error: str | None = None  # why the probe forward failed
    # packing = "documents" (ppdsl.dsl.packing_probe): "" when the forward keeps attention inside
    # documents given restarting position ids, else why not; None: not probed
    packed_documents: str | None = None
    # with packed_documents "": True when only ppdsl's document masks (ppdsl.core.document_masks)
    # keep the documents apart (its mask builders do not read the position ids)
    document_masks: bool = False
    # ppdsl.dsl.saved_activations.SavedActivations of a training forward on meta (dataflow=True), or None
    saved: Any = None
    saved_error: str | None = None  # why that forward could not be traced


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def introspect(
    kind: str,
    target: str,
    config: Mapping[str, object],
    *,
    search_paths: Sequence[str] = (),
    dataflow: bool = False,
) -> ModelInfo:
    """Build the model on the meta device and describe it.

    ``search_paths`` are prepended to ``sys.path`` while a ``python`` factory is imported (for
    example the directory of the spec file). Raises `ModelLoadError` for any bad input.
    ``dataflow``: also run one forward on meta and record which layer feeds which
    (`ppdsl.dsl.tp_dataflow`); a forward that fails leaves ``dataflow_error`` set instead.
    """
    model, config_dict = build(kind, target, config, "meta", search_paths)
    info = describe(model, config_dict)
    full = deep_merge(config_dict, config)  # the built config's values, the spec's over them
    if not dataflow:
        return info
    from ppdsl.core.families import family_of

    if family_of(kind, target, config_dict).layout_from_trace:
        from .own_cut_proof import prove_cut
        from .own_layout import text_only_layout, trace_layout

        with quiet_transformers():
            layout = prove_cut(model, full, trace_layout(model, full))
            # an image path that does not trace: the text alone; a config the image path cannot run
            # with (image_width) is the user's to fix
            if not layout.ok and layout.refusal != "image_width" and \
                    model_inputs.kind_of(model) == model_inputs.IMAGE_TEXT:
                text = prove_cut(model, full, text_only_layout(model, full, layout))  # its text alone (W0437)
                if text.ok:  # the probes and proofs below feed it tokens too
                    layout = text
                    model.__dict__[model_inputs.TRACED_KIND] = layout.inputs
                # else the image path's refusal says more (a forward that requires the images: Blip2's)
            info = attrs.evolve(info, own_layout=layout)
    if kind != "python":
        info = _probe(model, full, info)
        info = _documents(model, full, info)
    from .tp_dataflow import trace_dataflow

    layers = [p for p, m in info.modules.items() if p and m.kind in ("linear", "conv1d", "embedding")]
    norms = [p for p, m in info.modules.items() if p and m.kind == "norm"]
    try:
        with quiet_transformers() if kind != "python" else contextlib.nullcontext():
            flow = trace_dataflow(model, full, layers, watched=norms)
    except Exception as exc:  # any failure of user or library code: the check falls back
        return _saved(model, full, layers, kind, attrs.evolve(info, dataflow_error=exc_text(exc)))
    return _saved(model, full, layers, kind, attrs.evolve(info, dataflow=flow))


def _saved(model: nn.Module, config: Mapping[str, object], layers: list[str], kind: str,
           info: ModelInfo) -> ModelInfo:
    """What a training forward saves for backward (`ppdsl.dsl.saved_activations`), for the memory
    figure of lowering/rank_memory.py."""
    from .saved_activations import trace_saved

    try:
        with quiet_transformers() if kind != "python" else contextlib.nullcontext():
            layout = info.own_layout
            traced = layout is not None and layout.ok
            return attrs.evolve(info, saved=trace_saved(model, config, layers, layout.positions if traced else 0,
                                                        _traced_blocks(info)))
    except Exception as exc:  # any failure of user or library code: lowering keeps its formula
        return attrs.evolve(info, saved_error=exc_text(exc))


def _traced_blocks(info: ModelInfo) -> str:
    """The path of the blocks the traced layout found ("" when none was traced)."""
    layout = info.own_layout
    return layout.blocks if layout is not None and layout.ok else ""


def _probe(model: nn.Module, config: Mapping[str, object], info: ModelInfo) -> ModelInfo:
    """Which attention the forward runs (`ppdsl.dsl.attention_probe`), for context parallelism;
    over the blocks `ppdsl.dsl.block_sample` picks, each later block's calls copied from the
    block standing for it."""
    from .attention_probe import probe_attention
    from .block_sample import index_in, moved, over_sampled_blocks
    from .tp_dataflow import _seq_len

    blocks = _traced_blocks(info)

    def repeated(probe: Any, reps: Mapping[int, int]) -> Any:
        calls = list(probe.calls)
        inside = [i for i, c in enumerate(calls) if index_in(c.module, blocks) is not None]
        copies = [attrs.evolve(c, module=moved(c.module, blocks, block - rep))
                  for block, rep in sorted(reps.items()) for c in probe.calls if index_in(c.module, blocks) == rep]
        at = inside[-1] + 1 if inside else len(calls)
        return attrs.evolve(probe, calls=tuple(calls[:at] + copies + calls[at:]))

    try:
        with quiet_transformers():
            return attrs.evolve(info, attention=over_sampled_blocks(
                model, blocks, lambda: probe_attention(model, config, _seq_len(config)), repeated))
    except Exception as exc:  # any failure of library code: check says cp cannot be proven
        return attrs.evolve(info, attention_error=exc_text(exc))


def _documents(model: nn.Module, config: Mapping[str, object], info: ModelInfo) -> ModelInfo:
    """Whether the forward keeps attention inside packed documents (`ppdsl.dsl.packing_probe`),
    over the blocks `ppdsl.dsl.block_sample` picks (each kind of block is asked)."""
    from .block_sample import over_sampled_blocks
    from .packing_probe import probe_documents
    from .tp_dataflow import _seq_len

    try:
        with quiet_transformers():
            why, masks = over_sampled_blocks(model, _traced_blocks(info),
                                             lambda: probe_documents(model, config, _seq_len(config), None),
                                             lambda answer, _: answer)
    except Exception as exc:  # any failure of library code: check says documents cannot be proven
        why, masks = f"its forward fails given position ids on meta ({exc_text(exc)})", False
    return attrs.evolve(info, packed_documents=why or "", document_masks=masks)


def describe(model: nn.Module, config: Mapping[str, object] | None = None) -> ModelInfo:
    """Describe an already built module (any device) as a `ModelInfo`."""
    owners, tied, total = _parameter_owners(model)
    modules = {
        path: _module_info(path, module, owners)
        for path, module in model.named_modules(remove_duplicate=False)
    }
    return ModelInfo(
        class_name=type(model).__name__,
        modules=modules,
        config=dict(config or {}),
        tied=tied,
        total_params=total,
    )


def block_paths(info: ModelInfo, container_path: str) -> list[str]:
    """Full paths of the children of an ``nn.ModuleList`` / ``nn.Sequential``, by index.

    Raises KeyError when the path does not exist, ValueError when it is not an indexed list.
    """
    module = _lookup(info, container_path)
    if module.kind != "container" or not all(c.isdigit() for c in module.children):
        raise ValueError(
            f"'{container_path}' is a {module.type_name}, not a list of blocks"
            " (nn.ModuleList or nn.Sequential)"
        )
    return [_join(container_path, c) for c in sorted(module.children, key=int)]


def params_under(info: ModelInfo, path: str) -> int:
    """Parameters of the module at ``path`` and everything below it (tied ones counted once)."""
    _lookup(info, path)
    if path == "":
        return info.total_params
    prefix = path + "."
    return sum(m.num_params for p, m in info.modules.items() if p == path or p.startswith(prefix))


# --------------------------------------------------------------------------------------------
# Describing a built module
# --------------------------------------------------------------------------------------------


def _join(parent: str, child: str) -> str:
    return f"{parent}.{child}" if parent else child


def _lookup(info: ModelInfo, path: str) -> ModuleInfo:
    try:
        return info.modules[path]
    except KeyError:
        close = difflib.get_close_matches(path, list(info.modules), n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise KeyError(f"{info.class_name} has no module '{path}'{hint}") from None


def _parameter_owners(model: nn.Module) -> tuple[dict[str, bool], tuple[tuple[str, str], ...], int]:
    """Map every parameter name to whether it owns its tensor (first name seen), find ties."""
    first_name: dict[int, str] = {}
    owners: dict[str, bool] = {}
    tied: list[tuple[str, str]] = []
    total = 0
    # Parameters are tied by object identity (HF assigns the same Parameter); on meta there is no
    # storage whose pointer could be compared.
    for name, param in model.named_parameters(remove_duplicate=False):
        owner = first_name.setdefault(id(param), name)
        owners[name] = owner == name
        if owner == name:
            total += param.numel()
        else:
            tied.append((owner, name))
    return owners, tuple(tied), total


def _module_info(path: str, module: nn.Module, owners: Mapping[str, bool]) -> ModuleInfo:
    own = [
        p
        for name, p in module._parameters.items()
        if p is not None and owners.get(_join(path, name), False)
    ]
    kind, shapes = _classify(module)
    bias = getattr(module, "bias", None)
    return ModuleInfo(
        path=path,
        type_name=type(module).__name__,
        kind=kind,
        in_features=shapes.get("in_features"),
        out_features=shapes.get("out_features"),
        num_embeddings=shapes.get("num_embeddings"),
        embedding_dim=shapes.get("embedding_dim"),
        has_bias=bias is not None and hasattr(bias, "shape"),
        num_params=sum(p.numel() for p in own),
        param_bytes=sum(p.numel() * p.element_size() for p in own),
        children=tuple(name for name, child in module._modules.items() if child is not None),
        scalar_params=tuple(name for name, p in module._parameters.items()
                            if p is not None and p.dim() == 0 and owners.get(_join(path, name), False)),
        experts=expert_count(module) or 0,
        head_dim=head_width(module),
        kv_groups=groups if type(groups := getattr(module, "num_key_value_groups", None)) is int else None,
        position_wise=_position_wise(module, kind),
    )


def _classify(module: nn.Module) -> tuple[str, dict[str, int]]:
    from torch import nn

    if isinstance(module, nn.Linear):
        return "linear", {"in_features": module.in_features, "out_features": module.out_features}
    weight = getattr(module, "weight", None)
    # transformers.pytorch_utils.Conv1D (GPT-2): weight is [in, out]; matched by name so that a
    # python-factory model never needs transformers imported.
    if type(module).__name__ == "Conv1D" and weight is not None and weight.dim() == 2:
        return "conv1d", {"in_features": weight.shape[0], "out_features": weight.shape[1]}
    if isinstance(module, nn.Embedding):
        return "embedding", {
            "num_embeddings": module.num_embeddings,
            "embedding_dim": module.embedding_dim,
        }
    if _is_norm(module):
        return "norm", {}
    if isinstance(module, (nn.ModuleList, nn.Sequential, nn.ModuleDict)):
        return "container", {}
    return "other", {}


def _position_wise(module: nn.Module, kind: str) -> bool:
    """Whether ``module`` (a leaf) computes each position from that position alone: a linear layer,
    a norm over the last dimension (torch's or transformers' LayerNorm / RMSNorm: not a batch or
    group norm, which mixes positions), a dropout, an identity, an activation."""
    from torch import nn
    from torch.nn.modules.dropout import _DropoutNd

    if kind in ("linear", "conv1d") or isinstance(module, (nn.LayerNorm, nn.RMSNorm, _DropoutNd, nn.Identity)):
        return True
    name, where = type(module).__name__, type(module).__module__
    if kind == "norm":
        return name.endswith(("RMSNorm", "LayerNorm")) and where.startswith("transformers.")
    return where in ("torch.nn.modules.activation", "transformers.activations")


def _is_norm(module: nn.Module) -> bool:
    from torch import nn
    from torch.nn.modules.batchnorm import _NormBase

    norms = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, _NormBase)
    return isinstance(module, norms) or type(module).__name__.endswith("Norm")
