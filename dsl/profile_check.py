"""Check-time diagnostics of `pipeline.profile` (E0314, E0316): the measured cost profile a spec
splits its stages on (`balance = measured`) and predicts its step time from.

The file is read like a data file: the locate pass (dsl/resolve/located.py) made its path
absolute against the spec's directory and refused one outside it under `--no-model` (E0419).
Here it must load as a profile (lowering/costs.py, the format `ppdsl tune` writes) and be a
profile of this model at these shapes: the same `seq_len`, one entry per block, and, with the
model built, the same parameters per block.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

from .blocks import block_count
from .diagnostics import Diagnostic, error
from .spec import Spec
from ppdsl.core.schedules.profile import CostProfile

if TYPE_CHECKING:
    from ppdsl.dsl.introspect import ModelInfo

_REMEASURE = "measure it again for this spec: ppdsl tune SPEC --world N --profile FILE (a new FILE)"


def load_profile(path: str) -> CostProfile:
    """The profile at `path`; ValueError (with the reason) when it is not one."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ValueError("does not exist") from None
    except IsADirectoryError:
        raise ValueError("is a directory, not a file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot be read: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError("is not a cost profile: a JSON object is expected")
    try:
        return CostProfile.from_json(data)
    except ValueError as exc:
        raise ValueError(f"is not a cost profile this ppdsl reads: {exc}") from None
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"is not a cost profile: missing or malformed field {exc}") from None


def check_profile(spec: Spec, info: ModelInfo | None = None) -> list[Diagnostic]:
    """`info`: the built model's ModelInfo, or None (``--no-model``: the config's layer count)."""
    p = spec.pipeline
    if p.profile is None:
        return []
    span = spec.span("pipeline.profile")
    shown = f"'{os.path.relpath(p.profile, os.path.dirname(os.path.abspath(spec.file)))}'"
    try:
        profile = load_profile(p.profile)
    except ValueError as exc:
        return [error("E0314", span, f"cost profile {shown} {exc}", label="not a profile",
                      hint="ppdsl tune SPEC --world N --profile FILE measures the model and writes one")]
    out = []
    if spec.train.seq_len is not None and profile.seq_len != spec.train.seq_len:
        out.append(error("E0316", span, f"the cost profile was measured at seq_len {profile.seq_len}, "
                                        f"the spec trains at {spec.train.seq_len}",
                         label=f"profile of {profile.model}", hint=_REMEASURE))
    blocks = block_count(p.blocks, spec.model.dims, info)
    if blocks is not None and blocks != len(profile.blocks):
        out.append(error("E0316", span, f"the cost profile has {len(profile.blocks)} blocks, "
                                        f"the model has {blocks}",
                         label=f"profile of {profile.model}", hint=_REMEASURE))
    elif blocks is not None and info is not None:
        from .introspect import params_under

        for i, part in enumerate(profile.blocks):
            have = params_under(info, f"{p.blocks}.{i}")
            if part.params != have:
                out.append(error("E0316", span, f"block {i} of the cost profile has {part.params} parameters, "
                                                f"the model's has {have}: a profile of another model",
                                 label=f"profile of {profile.model}", hint=_REMEASURE))
                break
    return out
