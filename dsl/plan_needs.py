"""What a plan needs beyond a valid spec (E0429): a spec check accepts without the model may still
lack what lowering must know, and that is said here, as a diagnostic at the model's line, rather
than raised by lowering after check passed.

- The own forward's layout (blocks, the hidden state's place in a block's output, the task) is
  traced from the model: `plan --no-model` and `schedule SPEC` (which never builds the model) of
  such a class cannot lower it.
- Without the model, the number of blocks comes from the config's layer count; a config that
  gives none leaves the stages unknown.
- An HF class no family runs and the own forward does not take (check without the model cannot
  tell which): run, verify and plan need one of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .blocks import block_count
from .diagnostics import Diagnostic, error
from .families import DIM_ALIASES, by_name, run_refusal
from .spec import Spec

if TYPE_CHECKING:
    from ppdsl.dsl.introspect import ModelInfo

__all__ = ["plan_needs"]


def plan_needs(spec: Spec, info: ModelInfo | None, runnable: bool) -> list[Diagnostic]:
    """E0429 where lowering ``spec`` (with check's model facts ``info``, None without the model)
    would fail, or (``runnable``: run, verify, plan) no model family runs the class."""
    source = spec.model.source
    where = spec.span("model.source")
    traced = by_name(spec.model.family).layout_from_trace
    if traced and getattr(getattr(info, "own_layout", None), "ok", False) is not True:
        return [error("E0429", where,
                      f"{source.target} runs its own forward, whose layout ppdsl traces from the model: a plan of it "
                      "needs the model, which --no-model does not build",
                      label="traced when the model is built",
                      hint="drop --no-model; for a schedule alone: ppdsl schedule --style S --pp P --microbatches M")]
    if block_count(spec.pipeline.blocks, spec.model.dims, info) is None:
        return [error("E0429", where,
                      f"the number of blocks in '{spec.pipeline.blocks}' is unknown without the model: the config "
                      f"gives no layer count ({' or '.join(DIM_ALIASES['layers'])})",
                      label="not built with --no-model",
                      hint="drop --no-model, or give the layer count in the config")]
    class_name = getattr(info, "class_name", None) or source.target
    refusal = run_refusal(source.kind, spec.model.family, class_name) if runnable else None
    if refusal is not None:
        return [error("E0429", where, refusal, label="no model family runs it",
                      hint="check it with the model: the own forward runs most HF classes")]
    return []
