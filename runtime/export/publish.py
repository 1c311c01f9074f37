"""``ppdsl export RUN_DIR OUT_DIR``: validate the model a run left in ``RUN_DIR/final`` (config,
every expected tensor present with the right shape) and publish it as OUT_DIR; and
`load_exported`, which rebuilds an exported ``python(...)`` model.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn



from ppdsl.runtime.export.write import FORMAT, PPDSL_MODEL_FILE, WEIGHTS_FILE
from ppdsl.runtime.export.atomic_dir import FINAL_DIR, ExportError, atomic_dir, check_destination


# ---------------------------------------------------------------------------------------------
# After a run: `ppdsl export RUN_DIR OUT_DIR`
# ---------------------------------------------------------------------------------------------


def export(run_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], *, force: bool = False) -> Path:
    """Publish the model a run left in ``RUN_DIR/final`` (or ``RUN_DIR`` itself, when it is a
    model directory) as ``out_dir``, after checking it: config readable, every tensor the model
    needs present with its shape, nothing unknown. Atomic; refuses an occupied ``out_dir``
    unless ``force``."""
    source = _model_dir_of(Path(run_dir))
    out = Path(out_dir)
    src, dst = source.resolve(), out.resolve()
    if dst == src or dst in src.parents or src in dst.parents:
        raise ExportError(f"OUT_DIR {out} overlaps the run's model directory {source}: choose a directory outside it")
    check_destination(out, force)
    _validate(source)
    with atomic_dir(out, force) as tmp:
        for entry in sorted(source.iterdir()):
            if entry.is_file():
                shutil.copy2(entry, tmp / entry.name)
            elif entry.is_dir():
                shutil.copytree(entry, tmp / entry.name)
    return out


def cli_export(run_dir: str, out_dir: str, force: bool = False, stream: Any = None) -> int:
    """``ppdsl export RUN_DIR OUT_DIR [--force]``: 0 exported, 2 unusable input / occupied
    OUT_DIR (a message, no traceback), 1 an unexpected failure."""
    stream = stream or sys.stderr
    try:
        out = export(run_dir, out_dir, force=force)
    except ExportError as exc:
        print(f"ppdsl export: {exc}", file=stream)
        return 2
    except OSError as exc:
        print(f"ppdsl export: {exc}", file=stream)
        return 1
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(f"exported {_model_dir_of(Path(run_dir))} -> {out} ({size / 2**20:.1f} MiB)")
    return 0


def load_exported(directory: str | os.PathLike[str], device: str = "cpu") -> nn.Module:
    """The model in an exported directory: an HF one through its class's ``from_pretrained``
    (class from ``config.json``'s ``architectures``), a python-factory one rebuilt by calling
    the factory and loading the weights (ties restored)."""
    directory = Path(directory)
    if (directory / PPDSL_MODEL_FILE).is_file():
        return _load_python(directory, device)
    import transformers

    config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
    archs = getattr(config, "architectures", None) or []
    cls = getattr(transformers, archs[0], None) if archs else None
    if cls is None:
        cls = transformers.AutoModel
    return cls.from_pretrained(directory, local_files_only=True).to(device)


def _load_python(directory: Path, device: str) -> nn.Module:
    from safetensors.torch import load_file

    from ppdsl.core.build import build_model

    meta = _read_ppdsl_meta(directory)
    module = build_model("python", meta["factory"], meta["config"], device="cpu")
    state = load_file(str(directory / WEIGHTS_FILE))
    for names in meta.get("tied", []):
        for alias in names[1:]:
            state.setdefault(alias, state[names[0]])
    result = module.load_state_dict(state, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise ExportError(f"{directory}: missing {result.missing_keys[:5]}, unexpected {result.unexpected_keys[:5]}")
    return module.to(device)


def _model_dir_of(run_dir: Path) -> Path:
    if not run_dir.is_dir():
        raise ExportError(f"RUN_DIR {run_dir} is not a directory")
    for candidate in (run_dir / FINAL_DIR, run_dir):
        if (candidate / WEIGHTS_FILE).is_file() or (candidate / "model.safetensors.index.json").is_file():
            if (candidate / "config.json").is_file() or (candidate / PPDSL_MODEL_FILE).is_file():
                return candidate
    raise ExportError(
        f"RUN_DIR {run_dir} holds no trained model: a run writes it to {run_dir / FINAL_DIR} "
        "(config.json or ppdsl_model.json, and model.safetensors) when training ends"
    )


def _read_ppdsl_meta(directory: Path) -> dict[str, Any]:
    try:
        meta = json.loads((directory / PPDSL_MODEL_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ExportError(f"cannot read {directory / PPDSL_MODEL_FILE}: {exc}") from None
    if (not isinstance(meta, dict) or meta.get("format") != FORMAT or not isinstance(meta.get("factory"), str)
            or not isinstance(meta.get("config"), dict) or not isinstance(meta.get("tied", []), list)):
        raise ExportError(f"{directory / PPDSL_MODEL_FILE} is not a ppdsl model description ({FORMAT})")
    return meta


def _validate(source: Path) -> None:
    """Build the model on the meta device from the directory's description and compare its
    parameters and persistent buffers with the safetensors headers (no tensor is read)."""
    from ppdsl.runtime.stage.weights import safetensors_files

    try:
        keys = safetensors_files(source)
    except Exception as exc:  # a truncated or foreign file
        raise ExportError(f"cannot read the weights in {source}: {exc}") from None
    try:
        shapes = _header_shapes(keys)
    except Exception as exc:  # a missing or truncated shard
        raise ExportError(f"cannot read the weights in {source}: {exc}") from None
    module, groups = _meta_model(source)
    alias_of = {n: names for names in groups for n in names}
    expected = {}
    for name, t in _saved_state(module).items():
        expected[name] = tuple(t.shape)
    missing = [n for n in expected if n not in shapes and not any(a in shapes for a in alias_of.get(n, ()))]
    unknown = [k for k in shapes if k not in expected]
    wrong = [f"{k} {shapes[k]} (expected {expected[k]})"
             for k in shapes if k in expected and shapes[k] != expected[k]]
    problems = []
    if missing:
        problems.append(f"missing {len(missing)} tensor(s): {', '.join(missing[:5])}")
    if unknown:
        problems.append(f"{len(unknown)} unknown tensor(s): {', '.join(unknown[:5])}")
    if wrong:
        problems.append(f"wrong shapes: {', '.join(wrong[:5])}")
    if problems:
        raise ExportError(f"{source} does not hold a complete model: " + "; ".join(problems))


def _saved_state(module: nn.Module) -> Mapping[str, Any]:
    """The state dict under the names ``save_pretrained`` writes: transformers 5 reverts a class's
    weight conversions there (LLaVA's ``model.language_model.*`` is saved as its checkpoints'
    ``language_model.model.*``, and read back through the same mapping)."""
    state = module.state_dict(keep_vars=True)
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4.x saves the module's own names
        return state
    from transformers import PreTrainedModel

    return revert_weight_conversion(module, state) if isinstance(module, PreTrainedModel) else state


def _header_shapes(keys: Mapping[str, str]) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    out: dict[str, tuple[int, ...]] = {}
    by_file: dict[str, list[str]] = {}
    for k, f in keys.items():
        by_file.setdefault(f, []).append(k)
    for f, ks in by_file.items():
        with safe_open(f, framework="pt") as fh:
            for k in ks:
                out[k] = tuple(int(d) for d in fh.get_slice(k).get_shape())
    return out


def _meta_model(source: Path) -> tuple[nn.Module, list[tuple[str, ...]]]:
    from ppdsl.core.build import ModelLoadError, build_model

    from ppdsl.runtime.stage.skeleton import tied_groups as _tied_groups

    try:
        if (source / PPDSL_MODEL_FILE).is_file():
            meta = _read_ppdsl_meta(source)
            module = build_model("python", meta["factory"], meta["config"], device="meta")
        else:
            module = build_model("hf_pretrained", str(source), {}, device="meta")
    except ModelLoadError as exc:
        raise ExportError(f"{source}: {exc}") from None
    return module, _tied_groups(module)


