"""Model introspection on the meta device.

`introspect` builds a model without allocating memory (every tensor on ``torch.device("meta")``)
and returns a `ModelInfo`: pure data (no torch objects) describing every module path, its kind
and shapes, own parameter counts, tied parameters and the HF config. `ppdsl check` uses it for
the model-level rules (features % tp, heads % tp, vocab % tp, ...), `ppdsl plan` for parameter
counts per stage. `build_model` is the same construction, returning the `nn.Module` itself, for
the runtime.

Model sources (``kind``):

- ``"hf"``: ``target`` is a transformers model class name (``"GPT2LMHeadModel"``); ``config`` are
  keyword arguments of its config class. Keys the config class does not know are rejected
  (HF configs would silently keep them as attributes).
- ``"hf_pretrained"``: ``target`` is a local directory holding ``config.json``; the model class
  comes from ``config.architectures[0]``; ``config`` overrides values of the file. Nothing is
  downloaded and no weights are read: the structure only.
- ``"python"``: ``target`` is ``"pkg.module:callable"``, called with ``**config``; it must return
  an ``nn.Module``.

torch and transformers are imported lazily, inside the functions: importing this module is
instant and torch-free, like the rest of ``ppdsl.dsl``.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import inspect
import os
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = [
    "add_model_path",
    "ModelInfo",
    "ModelLoadError",
    "ModuleInfo",
    "block_paths",
    "build_model",
    "factory_defaults",
    "introspect",
    "params_under",
    "size_problem",
]

KINDS = ("hf", "hf_pretrained", "python")

# Keyword arguments every PreTrainedConfig accepts that are neither in the dataclass signature
# nor readable attributes of a default instance.
_HF_EXTRA_CONFIG_KWARGS = frozenset({"attn_implementation", "experts_implementation", "num_labels"})


# check builds a model (on the meta device) only below these: a config beyond them is refused
# (E0407) instead of spending minutes creating a million modules. The largest published
# transformers have a few hundred blocks and about 2 x 10^12 parameters.
MAX_BLOCKS = 10_000
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


class ModelLoadError(Exception):
    """A model could not be built; the message is meant for the user, without a traceback."""


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
    model, config_dict = _build(kind, target, config, "meta", search_paths)
    info = describe(model, config_dict)
    if not dataflow:
        return info
    from ppdsl.dsl.tp_dataflow import trace_dataflow

    layers = [p for p, m in info.modules.items() if p and m.kind in ("linear", "conv1d", "embedding")]
    norms = [p for p, m in info.modules.items() if p and m.kind == "norm"]
    try:
        with _quiet_transformers() if kind != "python" else contextlib.nullcontext():
            flow = trace_dataflow(model, {**config_dict, **config}, layers, watched=norms)
    except Exception as exc:  # any failure of user or library code: the check falls back
        return attrs.evolve(info, dataflow_error=_exc_text(exc))
    return attrs.evolve(info, dataflow=flow)


def build_model(
    kind: str,
    target: str,
    config: Mapping[str, object],
    device: str | torch.device = "meta",
    *,
    search_paths: Sequence[str] = (),
) -> nn.Module:
    """Build the model with every tensor created on ``device`` (``"meta"``: nothing allocated).

    HF models get ``attn_implementation="eager"`` unless ``config`` names another. On meta,
    non-persistent buffers (Llama's ``rotary_emb.inv_freq``, BERT's ``position_ids``) are meta
    too: after ``to_empty`` they hold garbage and are not in the state dict, so whoever
    materialises the model must recompute them.
    """
    model, _ = _build(kind, target, config, device, search_paths)
    return model


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


def _is_norm(module: nn.Module) -> bool:
    from torch import nn
    from torch.nn.modules.batchnorm import _NormBase

    norms = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, _NormBase)
    return isinstance(module, norms) or type(module).__name__.endswith("Norm")


# --------------------------------------------------------------------------------------------
# Building
# --------------------------------------------------------------------------------------------


def _build(
    kind: str,
    target: str,
    config: Mapping[str, object],
    device: str | torch.device,
    search_paths: Sequence[str],
) -> tuple[nn.Module, dict[str, object]]:
    if kind == "hf":
        return _build_hf(target, config, device)
    if kind == "hf_pretrained":
        return _build_hf_pretrained(target, config, device)
    if kind == "python":
        return _build_python(target, config, device, search_paths), {}
    raise ModelLoadError(f"unknown model source kind '{kind}'; expected one of {', '.join(KINDS)}")


def _device_context(device: str | torch.device) -> Any:
    import torch

    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ModelLoadError(f"invalid device {device!r}: {exc}") from None


# ---- transformers ---------------------------------------------------------------------------


def _import_transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - transformers is a runtime dependency
        raise ModelLoadError(
            f"hf model sources need the 'transformers' package ({exc});"
            " install ppdsl[runtime]"
        ) from None
    return transformers


def _hf_model_class(name: str) -> Any:
    transformers = _import_transformers()
    if not name.isidentifier():
        raise ModelLoadError(f"'{name}' is not a transformers class name")
    try:
        cls = getattr(transformers, name)
    except AttributeError:
        raise ModelLoadError(
            f"transformers {transformers.__version__} has no class '{name}'"
            + _did_you_mean(name, [n for n in dir(transformers) if not n.startswith("_")])
        ) from None
    except Exception as exc:  # a lazy submodule that fails to import (missing backend, ...)
        raise ModelLoadError(f"cannot import transformers.{name}: {exc}") from None
    is_model = isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)
    if not is_model and not name.startswith("Auto"):
        raise ModelLoadError(f"transformers.{name} is not a model class")
    if getattr(cls, "config_class", None) is None:
        raise ModelLoadError(
            f"transformers.{name} has no config class (an auto or abstract class);"
            " name a concrete model class such as 'GPT2LMHeadModel'"
        )
    return cls


def _known_config_keys(config_cls: Any) -> tuple[set[str], list[str]]:
    """Keys a config class accepts, and the subset worth suggesting in a did-you-mean."""
    params = [
        p.name
        for p in inspect.signature(config_cls.__init__).parameters.values()
        if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name != "self"
    ]
    aliases = list(getattr(config_cls, "attribute_map", {}) or {})
    suggestible = params + aliases + sorted(_HF_EXTRA_CONFIG_KWARGS)
    return set(suggestible), suggestible


def _check_config_keys(config_cls: Any, config: Mapping[str, object]) -> None:
    known, suggestible = _known_config_keys(config_cls)
    unknown = [k for k in config if k not in known]
    if not unknown:
        return
    default = _default_config(config_cls)
    for key in unknown:
        value = getattr(default, key, _MISSING) if not key.startswith("_") else _MISSING
        if value is _MISSING or callable(value):
            raise ModelLoadError(
                f"unknown config key '{key}' for {config_cls.__name__}"
                + _did_you_mean(key, suggestible)
            )


_MISSING = object()


def _default_config(config_cls: Any) -> Any:
    try:
        return config_cls()
    except Exception:  # a config that needs arguments: fall back to class attributes
        return config_cls


def _hf_config_dict(cfg: Any) -> dict[str, object]:
    """``cfg.to_dict()`` plus the class's attribute-map aliases (GPT-2's ``hidden_size`` ->
    ``n_embd``), so that generic rules can read the same names across model families."""
    out: dict[str, object] = dict(cfg.to_dict())
    for alias, real in (getattr(type(cfg), "attribute_map", {}) or {}).items():
        if alias not in out and real in out:
            out[alias] = out[real]
    return out


def _hf_kwargs(config: Mapping[str, object]) -> dict[str, object]:
    kwargs = dict(config)
    kwargs.setdefault("attn_implementation", "eager")
    return kwargs


def _instantiate_hf(cls: Any, cfg: Any, device: str | torch.device) -> nn.Module:
    with _device_context(device), _quiet_transformers():
        try:
            return cls(cfg)
        except Exception as exc:
            raise ModelLoadError(f"cannot build {cls.__name__}: {_exc_text(exc)}") from None


def _build_hf(
    target: str, config: Mapping[str, object], device: str | torch.device
) -> tuple[nn.Module, dict[str, object]]:
    cls = _hf_model_class(target)
    config_cls = cls.config_class
    _check_config_keys(config_cls, config)
    try:
        with _quiet_transformers():
            cfg = config_cls(**_hf_kwargs(config))
    except Exception as exc:
        raise ModelLoadError(f"invalid config for {config_cls.__name__}: {_exc_text(exc)}") from None
    return _instantiate_hf(cls, cfg, device), _hf_config_dict(cfg)


def _build_hf_pretrained(
    target: str, config: Mapping[str, object], device: str | torch.device
) -> tuple[nn.Module, dict[str, object]]:
    config_file = _local_config_file(target)
    target = os.path.dirname(config_file)
    transformers = _import_transformers()
    with _quiet_transformers():
        if config:
            _check_config_keys(_local_config_class(transformers, target), config)
        cfg = _load_local_config(transformers, target, _hf_kwargs(config))
    architectures = getattr(cfg, "architectures", None) or []
    if architectures:
        cls = _hf_model_class(architectures[0])
        return _instantiate_hf(cls, cfg, device), _hf_config_dict(cfg)
    try:
        cls = transformers.AutoModel._model_mapping[type(cfg)]
    except Exception:
        raise ModelLoadError(
            f"{config_file} names no 'architectures' and its model_type has no base model class"
        ) from None
    return _instantiate_hf(cls, cfg, device), _hf_config_dict(cfg)


def _local_config_file(target: str) -> str:
    """The config.json of the directory ``target`` names (a path or ``package:NAME``)."""
    from ppdsl.dsl.locate import PretrainedDirError, read_pretrained_config, resolve_pretrained_dir

    try:
        target = str(resolve_pretrained_dir(target, require_config=False))
    except PretrainedDirError as exc:
        raise ModelLoadError(f"hf_pretrained: {exc}") from None
    config_file = os.path.join(target, "config.json")
    if not os.path.isfile(config_file):
        raise ModelLoadError(f"hf_pretrained: '{target}' has no config.json")
    try:
        read_pretrained_config(target)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"hf_pretrained: cannot read {config_file}: {exc}") from None
    return config_file


def _local_config_class(transformers: Any, target: str) -> type:
    """The config class of the directory's config.json (its ``model_type``), without loading
    the file into a config a second time."""
    from ppdsl.dsl.locate import read_pretrained_config

    model_type = read_pretrained_config(target).get("model_type")
    try:
        return transformers.CONFIG_MAPPING[model_type]
    except (KeyError, TypeError):  # AutoConfig says why (no or an unknown model_type)
        return type(_load_local_config(transformers, target, {}))


def _load_local_config(transformers: Any, target: str, kwargs: Mapping[str, object]) -> Any:
    try:
        return transformers.AutoConfig.from_pretrained(
            target, local_files_only=True, trust_remote_code=False, **kwargs
        )
    except Exception as exc:
        raise ModelLoadError(
            f"hf_pretrained: cannot load the config in '{target}': {_exc_text(exc)}"
        ) from None


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Silence transformers' logger (warnings about unused kwargs, init on meta, ...)."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


# ---- python factories -----------------------------------------------------------------------


def _build_python(
    target: str,
    config: Mapping[str, object],
    device: str | torch.device,
    search_paths: Sequence[str],
) -> nn.Module:
    from torch import nn

    module_name, _, attr = target.partition(":")
    if not module_name or not attr or ":" in attr:
        raise ModelLoadError(f"python model source '{target}' must look like 'pkg.module:callable'")
    factory = _python_callable(module_name, attr, search_paths)
    _check_factory_kwargs(factory, target, config)
    with _device_context(device):
        try:
            model = factory(**config)
        except Exception as exc:
            raise ModelLoadError(f"{target} raised {_exc_text(exc)}") from None
    if not isinstance(model, nn.Module):
        raise ModelLoadError(
            f"{target} returned a {type(model).__name__}, not a torch.nn.Module"
        )
    return model


def _python_callable(module_name: str, attr: str, search_paths: Sequence[str]) -> Any:
    """The factory a ``python(...)`` source names, refused before it is ever called when it is not
    a model factory: a module of Python's standard library (refused before import), or an object
    that is not a function or class of the user's (a builtin such as ``os.system``, a class that
    is no ``nn.Module``, a function defined in the standard library)."""
    if _is_stdlib(module_name):
        raise ModelLoadError(f"'{module_name}' is a module of Python's standard library, not a model factory; "
                             "python(...) names a function or nn.Module class of your own or an installed package")
    with _extra_sys_path(search_paths):
        try:
            module = importlib.import_module(module_name)
        except BaseException as exc:  # SyntaxError, SystemExit in user code, ...
            if isinstance(exc, KeyboardInterrupt):
                raise
            raise ModelLoadError(f"cannot import '{module_name}': {_exc_text(exc)}") from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = [n for n in dir(obj) if not n.startswith("_")]
            raise ModelLoadError(
                f"module '{module_name}' has no attribute '{attr}'" + _did_you_mean(part, names)
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise ModelLoadError(f"{module_name}:{attr} is not callable")
    _refuse_non_factory(obj, f"{module_name}:{attr}")
    return obj


def _is_stdlib(module_name: str) -> bool:
    top = module_name.partition(".")[0]
    return top in sys.stdlib_module_names or top in sys.builtin_module_names


def _refuse_non_factory(obj: Any, target: str) -> None:
    from torch import nn

    if inspect.isclass(obj):
        if not issubclass(obj, nn.Module):
            raise ModelLoadError(f"{target} is a class but not a torch.nn.Module, so not a model factory")
        return
    if not inspect.isfunction(obj):  # builtins, partials, bound methods, callable instances
        raise ModelLoadError(f"{target} is a {type(obj).__name__}, not a model factory: name a Python function "
                             "that returns an nn.Module, or an nn.Module class")
    if _is_stdlib(getattr(obj, "__module__", "") or ""):
        raise ModelLoadError(f"{target} is {obj.__module__}.{obj.__qualname__} from Python's standard library, "
                             "not a model factory")


def factory_defaults(target: str, search_paths: Sequence[str] = ()) -> dict[str, object]:
    """The keyword defaults of a ``python("pkg.module:factory")`` target: what a config key left
    out of the spec takes (the factory is looked up as for building, never called)."""
    module_name, _, attr = target.partition(":")
    factory = _python_callable(module_name, attr, search_paths)
    try:
        parameters = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return {}
    return {p.name: p.default for p in parameters if p.default is not p.empty}


def _check_factory_kwargs(factory: Any, target: str, config: Mapping[str, object]) -> None:
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # builtins without a signature: let the call decide
        return
    try:
        signature.bind(**config)
    except TypeError as exc:
        names = [
            p.name
            for p in signature.parameters.values()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        ]
        unknown = [k for k in config if k not in names]
        has_var_kw = any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values())
        if unknown and not has_var_kw:
            raise ModelLoadError(
                f"unknown argument '{unknown[0]}' for {target}" + _did_you_mean(unknown[0], names)
            ) from None
        raise ModelLoadError(f"bad arguments for {target}: {exc}") from None


def add_model_path(directory: str) -> None:
    """Let ``python(...)`` sources find modules in `directory` (the spec's): searched after
    the installed packages, for the rest of this process and the processes it spawns."""
    path = os.path.abspath(directory)
    if path not in sys.path:
        sys.path.append(path)


@contextlib.contextmanager
def _extra_sys_path(paths: Sequence[str]) -> Iterator[None]:
    added = [os.path.abspath(p) for p in paths if os.path.abspath(p) not in sys.path]
    sys.path[:0] = added
    try:
        yield
    finally:
        for p in added:
            with contextlib.suppress(ValueError):
                sys.path.remove(p)


# ---- messages -------------------------------------------------------------------------------


def _did_you_mean(name: str, candidates: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""


def _exc_text(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__
