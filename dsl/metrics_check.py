"""Check-time advice about `train.metrics` (W0419): the sink a spec asks for can be written.

TensorBoard event files need the optional `tensorboard` package (``pip install
'ppdsl[tensorboard]'``). Its absence is a warning, not an error: check may run on another machine
than the run, and a run without it still writes metrics.jsonl (and says so when it starts).
"""

from __future__ import annotations

import importlib.util

from .diagnostics import Diagnostic, warning
from .spec import Spec


def tensorboard_installed() -> bool:
    return importlib.util.find_spec("tensorboard") is not None


def check_metrics(spec: Spec) -> list[Diagnostic]:
    if spec.train.metrics != "tensorboard" or tensorboard_installed():
        return []
    return [warning(
        "W0419", spec.span("train.metrics"),
        "metrics = tensorboard, but the tensorboard package is not installed here: the run writes metrics.jsonl only",
        label="no event files", hint="pip install 'ppdsl[tensorboard]' (or pip install tensorboard)")]


__all__ = ["check_metrics", "tensorboard_installed"]
