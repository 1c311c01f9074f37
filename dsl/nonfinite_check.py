"""W0325: max_nonfinite given with on_nonfinite = stop (the first non-finite step stops: the
limit is never used). W0326: on_nonfinite = stop with precision = fp16 (the loss scaler's first
overflow, an ordinary event while it finds its scale, would stop the run)."""

from __future__ import annotations

from . import diagnostics as dg
from .diagnostics import Diagnostic
from .spec import Spec


def check_nonfinite(spec: Spec) -> list[Diagnostic]:
    t = spec.train
    if t.on_nonfinite != "stop":
        return []
    out = []
    if "train.max_nonfinite" in spec.spans:  # given, not the default
        out.append(dg.warning("W0325", spec.spans["train.max_nonfinite"],
                              f"max_nonfinite = {t.max_nonfinite} has no effect: on_nonfinite = stop stops at the "
                              "first step whose loss or a gradient is not finite",
                              label="on_nonfinite = stop",
                              hint="set on_nonfinite = skip to skip up to max_nonfinite such steps in a row, "
                                   "or remove max_nonfinite"))
    if t.precision == "fp16":
        out.append(dg.warning("W0326", spec.span("train.on_nonfinite"),
                              "on_nonfinite = stop with precision = fp16: the loss scaler's first overflow stops "
                              "the run, though an overflow is how the scaler finds its scale",
                              label="precision = fp16",
                              hint="keep on_nonfinite = skip (the default) under fp16: an overflowed step is "
                                   "skipped and the scale halved; max_nonfinite bounds a run that keeps overflowing"))
    return out
