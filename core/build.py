"""Building a model from its source: the one builder check (on meta) and the runtime use.

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
instant and torch-free, so ``ppdsl check`` can import it.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import importlib
import inspect
import os
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["KINDS", "ModelLoadError", "add_model_path", "build", "build_model", "exc_text", "factory_defaults",
           "is_stdlib", "quiet_transformers"]

KINDS = ("hf", "hf_pretrained", "python")

# Keyword arguments every PreTrainedConfig accepts that are neither in the dataclass signature
# nor readable attributes of a default instance.
_HF_EXTRA_CONFIG_KWARGS = frozenset({"attn_implementation", "experts_implementation", "num_labels"})


class ModelLoadError(Exception):
    """A model could not be built; the message is meant for the user, without a traceback.
    `key`: the config key at fault as a path (``("text_config", "num_layers")``), when one is;
    `code`: the diagnostic check reports it as."""

    key: tuple[str, ...] = ()
    code: str = "E0401"


def _key_error(message: str, key: tuple[str, ...], code: str = "E0401") -> ModelLoadError:
    exc = ModelLoadError(message)
    exc.key, exc.code = key, code  # instance attributes: the exception still pickles with its message
    return exc


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
    model, _ = build(kind, target, config, device, search_paths)
    return model



def build(
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


def _hf_model_class(name: object) -> Any:
    transformers = _import_transformers()
    if not isinstance(name, str) or not name.isidentifier():  # (a config's architectures may hold anything)
        raise ModelLoadError(f"{name!r} is not a transformers class name")
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


@functools.lru_cache(maxsize=None)
def _kwargs_read(config_cls: Any) -> frozenset[str]:
    """Keyword arguments a config class's own methods take out of ``**kwargs``
    (``kwargs.pop("partial_rotary_factor", ...)``: transformers 5 moves it into
    ``rope_parameters``), over its transformers base classes and mixins. Such a key is known
    where the modeling code reads it from there (`_config_reads_of_file`)."""
    import ast
    import textwrap

    out: set[str] = set()
    for cls in config_cls.__mro__:
        if not getattr(cls, "__module__", "").startswith("transformers"):
            continue
        for fn in vars(cls).values():
            if not inspect.isfunction(fn):  # instance methods only: from_pretrained's download options are no keys
                continue
            try:
                tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
            except (OSError, TypeError, SyntaxError, IndentationError):
                continue
            for node in ast.walk(tree):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                        and node.func.attr in ("pop", "get") and isinstance(node.func.value, ast.Name) \
                        and node.func.value.id == "kwargs" and node.args and isinstance(node.args[0], ast.Constant) \
                        and isinstance(node.args[0].value, str) and not node.args[0].value.startswith("_"):
                    out.add(node.args[0].value)
    return frozenset(out)


def _check_config_keys(config_cls: Any, config: Mapping[str, object], model_cls: Any = None,
                       path: tuple[str, ...] = ()) -> None:
    """A key is known when the config class declares it (its ``__init__`` keywords, attribute-map
    aliases, the attributes of a default instance) or when the model's modeling code reads it
    from the config (``config.head_dim``, ``getattr(config, "head_dim", None)``: Qwen2Config
    declares no head_dim, but Qwen2's attention reads one when it is set)."""
    known, suggestible = _known_config_keys(config_cls)
    unknown = [k for k in config if k not in known and not (k == "image_size" and not path and _takes_images(model_cls))]
    if not unknown:
        return
    default = _default_config(config_cls)
    reads = sorted(k for k in modeling_config_reads(config_cls, model_cls) if not callable(getattr(config_cls, k, None)))
    # a keyword the config moves into a dict the modeling code reads it from (rope_parameters)
    reads += sorted(_kwargs_read(config_cls) & modeling_config_reads(config_cls, model_cls, nested=True))
    for key in unknown:
        value = getattr(default, key, _MISSING) if not key.startswith("_") else _MISSING
        if (value is _MISSING or callable(value)) and key not in reads:
            where = f" (in {'.'.join(path)})" if path else ""
            raise _key_error(
                f"unknown config key '{key}' for {config_cls.__name__}{where}"
                + _did_you_mean(key, suggestible + [k for k in reads if k not in known]),
                (*path, key),
            )


def _takes_images(model_cls: Any) -> bool:
    """A model fed images whose config may not say their size (ResNet's, ConvNext's): ppdsl reads
    ``image_size`` of its config (`ppdsl.core.model_inputs.pixel_shape`), so the spec may write it."""
    from .model_inputs import PIXELS, input_kind

    try:
        return input_kind(tuple(inspect.signature(model_cls.forward).parameters)) == PIXELS
    except (TypeError, ValueError, AttributeError):
        return False


def modeling_config_reads(config_cls: Any, model_cls: Any = None, nested: bool = False) -> frozenset[str]:
    """The config keys the modeling code of a config class's model family reads: every
    ``modeling_*.py`` beside the config class's module (transformers keeps a family's config and
    modeling code in one package), and the model class's own module when it lives elsewhere.
    `nested`: the keys it reads from the config's dict attributes instead
    (``config.rope_parameters["partial_rotary_factor"]``, ``.get(...)``)."""
    files = set(_modeling_files(getattr(config_cls, "__module__", "")))
    module = sys.modules.get(getattr(model_cls, "__module__", "") or "")
    if getattr(module, "__file__", None):
        files.add(os.path.realpath(module.__file__))  # type: ignore[union-attr]
    out: set[str] = set()
    for path in sorted(files):
        out |= _config_reads_of_file(path)[1 if nested else 0]
    return frozenset(out)


def _modeling_files(config_module: str) -> list[str]:
    module = sys.modules.get(config_module)
    path = getattr(module, "__file__", None)
    if not path or not config_module.startswith("transformers.models."):
        return []
    folder = os.path.dirname(os.path.realpath(path))
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return []
    return [os.path.join(folder, n) for n in names if n.startswith("modeling_") and n.endswith(".py")
            and not n.startswith(("modeling_tf_", "modeling_flax_"))]


@functools.lru_cache(maxsize=256)
def _config_reads_of_file(path: str) -> tuple[frozenset[str], frozenset[str]]:
    """Keys a module reads from a config: ``<config>.key`` and ``getattr(<config>, "key", ...)`` /
    ``hasattr(<config>, "key")``, where ``<config>`` is a name or attribute called ``config`` or
    ending in ``_config`` (``self.config``, ``text_config``); and, second, the keys it reads from
    a dict attribute of one (``<config>.rope_parameters["key"]`` or ``.get("key")``). Parsed once
    per process."""
    import ast

    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return frozenset(), frozenset()

    def is_config(node: ast.AST) -> bool:
        name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
        return name == "config" or name.endswith("_config")

    def key(node: ast.AST) -> str | None:
        return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) \
            and not node.value.startswith("_") else None

    out: set[str] = set()
    nested: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and is_config(node.value) and not node.attr.startswith("_"):
            out.add(node.attr)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr") \
                and len(node.args) >= 2 and is_config(node.args[0]) and key(node.args[1]):
            out.add(node.args[1].value)
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and is_config(node.value.value) \
                and key(node.slice):
            nested.add(node.slice.value)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                and isinstance(node.func.value, ast.Attribute) and is_config(node.func.value.value) \
                and node.args and key(node.args[0]):
            nested.add(node.args[0].value)
    return frozenset(out), frozenset(nested)


_MISSING = object()


def _default_config(config_cls: Any) -> Any:
    try:
        return config_cls()
    except Exception:  # a config that needs arguments: fall back to class attributes
        return config_cls


# ---- nested config blocks: `config { text_config { ... } }` ------------------------------------

_NOT_KWARGS = ("transformers_version", "model_type")  # to_dict's keys that are no constructor value


def _nested(config: Mapping[str, object]) -> tuple[dict[str, object], dict[str, Mapping[str, object]]]:
    """The config's plain values, and its nested blocks (dict values) by key."""
    flat = {k: v for k, v in config.items() if not isinstance(v, Mapping)}
    return flat, {k: v for k, v in config.items() if isinstance(v, Mapping)}


def _sub_config_value(config_cls: Any, base: Any, key: str, block: Mapping[str, object],
                      path: tuple[str, ...]) -> Any:
    """What `key = <block>` passes to `config_cls`: for a sub-config (``text_config``), the
    sub-config built from the values ``base`` (a default instance, or a loaded config) has for it,
    the block's over them; for a dict-valued key (``rope_parameters``), the dict updated. Keys the
    block leaves out keep their values; values the sub-config derives from others (``head_dim``)
    are derived again."""
    current = getattr(base, key, None)
    transformers = _import_transformers()
    if isinstance(current, Mapping):
        return {**current, **block}
    sub_cls = type(current) if isinstance(current, _config_base(transformers)) else \
        (getattr(config_cls, "sub_configs", None) or {}).get(key)
    written_type = block.get("model_type")
    if isinstance(written_type, str) and written_type != getattr(sub_cls, "model_type", None):
        try:
            sub_cls, current = transformers.CONFIG_MAPPING[written_type], None
        except KeyError:
            raise _key_error(f"{'.'.join(path)}.model_type = {written_type!r}: transformers has no model type "
                             f"'{written_type}'" + _did_you_mean(written_type, list(transformers.CONFIG_MAPPING)),
                             (*path, "model_type")) from None
    if sub_cls is None or not isinstance(sub_cls, type):
        subs = sorted(getattr(config_cls, "sub_configs", None) or {})
        what = f"{current!r}"[:40]
        raise _key_error(
            f"config key '{'.'.join(path)}' is not a sub-config of {config_cls.__name__} (its value: {what}), so it "
            "takes no block" + (f"; its sub-configs: {', '.join(subs)}" if subs else
                               f"; {config_cls.__name__} has no sub-configs"), path, code="E0434")
    if sub_cls is transformers.AutoConfig:  # a sub-config of any model type, none by default
        raise _key_error(f"config key '{'.'.join(path)}' of {config_cls.__name__} has no default model: name its "
                         f"model_type (`{key} {{ model_type = \"llama\", ... }}`)", path, code="E0434")
    own = {k: v for k, v in block.items() if k != "model_type"}
    _check_config_keys(sub_cls, own, None, path)
    values = _underived_kwargs(current) if type(current) is sub_cls else {}
    flat, blocks = _nested(own)
    values.update(flat)
    for inner, inner_block in blocks.items():
        values[inner] = _sub_config_value(sub_cls, current if current is not None else _default_config(sub_cls),
                                          inner, inner_block, (*path, inner))
    try:
        with quiet_transformers():
            return sub_cls(**values)
    except Exception as exc:
        raise _key_error(f"invalid {'.'.join(path)} ({sub_cls.__name__}): {exc_text(exc)}", path) from None


def _config_base(transformers: Any) -> type:
    return getattr(transformers, "PreTrainedConfig", None) or transformers.PretrainedConfig


def _underived_kwargs(cfg: Any) -> dict[str, object]:
    """The constructor values that rebuild ``cfg``: those differing from its class's defaults,
    less those the class derives from the others (a head_dim computed from hidden_size)."""
    cls = type(cfg)
    values = {k: v for k, v in cfg.to_dict().items() if k not in _NOT_KWARGS}
    try:
        with quiet_transformers():
            plain = cls().to_dict()
    except Exception:
        return values
    values = {k: v for k, v in values.items() if plain.get(k, _MISSING) != v}
    for key in list(values):
        rest = {k: v for k, v in values.items() if k != key}
        try:
            with quiet_transformers():
                derived = cls(**rest).to_dict().get(key, _MISSING)
        except Exception:
            continue
        if derived == values[key]:
            values = rest
    return values


def _with_blocks(config_cls: Any, cfg_or_default: Any, blocks: Mapping[str, Mapping[str, object]]) -> dict[str, object]:
    """key -> the value each nested block passes (`_sub_config_value`)."""
    return {key: _sub_config_value(config_cls, cfg_or_default, key, block, (key,)) for key, block in blocks.items()}


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
    with _device_context(device), quiet_transformers():
        try:
            model = cls(cfg)
        except Exception as exc:
            raise ModelLoadError(f"cannot build {cls.__name__}: {exc_text(exc)}") from None
    _without_padding_warning(model)
    return model


def _without_padding_warning(model: nn.Module) -> None:
    """A microbatch without padding carries no attention mask; HF's warning about pad tokens
    without one then reads config attributes some configs lack (FunnelConfig.bos_token_id in 5.24:
    AttributeError on a batch holding the pad id). It changes no number: off."""
    for module in model.modules():
        if hasattr(module, "warn_if_padding_and_no_attention_mask"):
            module.warn_if_padding_and_no_attention_mask = _no_warning


def _no_warning(*args: Any, **kwargs: Any) -> None:  # a module-level function: the model still pickles
    return None


def _build_hf(
    target: str, config: Mapping[str, object], device: str | torch.device
) -> tuple[nn.Module, dict[str, object]]:
    cls = _hf_model_class(target)
    config_cls = cls.config_class
    _check_config_keys(config_cls, config, cls)
    flat, blocks = _nested(config)
    kwargs = _hf_kwargs(flat)
    if blocks:
        kwargs.update(_with_blocks(config_cls, _default_config(config_cls), blocks))
    try:
        with quiet_transformers():
            cfg = config_cls(**kwargs)
    except Exception as exc:
        raise ModelLoadError(f"invalid config for {config_cls.__name__}: {exc_text(exc)}") from None
    return _instantiate_hf(cls, cfg, device), _hf_config_dict(cfg)


def _build_hf_pretrained(
    target: str, config: Mapping[str, object], device: str | torch.device
) -> tuple[nn.Module, dict[str, object]]:
    config_file = _local_config_file(target)
    target = os.path.dirname(config_file)
    transformers = _import_transformers()
    flat, blocks = _nested(config)
    with quiet_transformers():
        if config:
            _check_config_keys(_local_config_class(transformers, target), config)
        cfg = _load_local_config(transformers, target, _hf_kwargs(flat))
    for key, value in _with_blocks(type(cfg), cfg, blocks).items():  # over the file's sub-configs
        setattr(cfg, key, value)
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
    from .locate import PretrainedDirError, read_pretrained_config, resolve_pretrained_dir

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
    from .locate import read_pretrained_config

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
            f"hf_pretrained: cannot load the config in '{target}': {exc_text(exc)}"
        ) from None


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
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
            raise ModelLoadError(f"{target} raised {exc_text(exc)}") from None
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
    if is_stdlib(module_name):
        raise ModelLoadError(f"'{module_name}' is a module of Python's standard library, not a model factory; "
                             "python(...) names a function or nn.Module class of your own or an installed package")
    with _extra_sys_path(search_paths):
        try:
            module = importlib.import_module(module_name)
        except BaseException as exc:  # SyntaxError, SystemExit in user code, ...
            if isinstance(exc, KeyboardInterrupt):
                raise
            raise ModelLoadError(f"cannot import '{module_name}': {exc_text(exc)}") from None
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


def is_stdlib(module_name: str) -> bool:
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
    if is_stdlib(getattr(obj, "__module__", "") or ""):
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


def exc_text(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__
