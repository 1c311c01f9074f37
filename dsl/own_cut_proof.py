"""Check proves the own forward's cut before launch: stage 0 and stage 1 of a cut at the middle
block run on meta with the stage adapter's mechanics (`ppdsl.core.own_cut`), then the task's loss
(`ppdsl.core.task_loss`) on stage 1's logits. A failure is the layout's ``cut_fails`` refusal
(E0425)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from ppdsl.core.meta_values import meta_values
from .own_layout import OwnLayout

if TYPE_CHECKING:
    from ppdsl.dsl.introspect import ModelInfo
    from torch import nn

__all__ = ["check_carried_shapes", "prove_cut"]


def prove_cut(model: nn.Module, config: Any, layout: OwnLayout) -> OwnLayout:
    """``layout``, or its ``cut_fails`` refusal when a two-stage cut fails on meta: at the middle
    block, and at each block where the traced hidden state changes shape (a stack whose width
    changes between blocks, Swin's and ConvNext's: each boundary carries its own shape).
    ``model`` (built on meta) is left as it was."""
    if not layout.ok or layout.uncuttable:  # nothing to prove: it runs whole (pp = 1) or not at all
        return layout
    n = len(model.get_submodule(layout.blocks))
    shapes = _traced_shapes(layout)
    # the middle block, and each block where the hidden state changes shape: every shape a
    # boundary can carry is sent and received once (cutting at every block would cost a meta
    # forward per block: MobileNet's 13, Swin's stages of 24 blocks)
    cuts = sorted({n // 2, *(k for k in range(1, len(shapes)) if shapes[k] != shapes[k - 1])} & set(range(1, n)))
    for k in cuts:
        try:
            problem = _run_cut(model, config, layout, k)
        except Exception as exc:  # any failure of library code in the cut forward
            from ppdsl.core.build import exc_text

            problem = exc_text(exc)
        if problem is not None:
            return OwnLayout(refusal="cut_fails",
                             reason=f"its forward, cut into two stages at block {k} of '{layout.blocks}' the way the "
                                    f"stages run it, fails on the meta device: {problem.rstrip('.')}")
    return layout


def _traced_shapes(layout: OwnLayout) -> tuple[tuple[int, ...], ...]:
    """The traced shapes the boundaries carry: a model fed images sends what the trace measured
    (its input is the run's); a token model's length is the spec's seq_len, not the trace's, so
    its boundaries are (microbatch, seq, hidden), not taken from the trace."""
    from ppdsl.core.model_inputs import PIXELS

    return layout.block_shapes if layout.inputs == PIXELS else ()


def _run_cut(model: nn.Module, config: Any, layout: OwnLayout, k: int) -> str | None:
    """What goes wrong when stage 0 and stage 1 of a cut before block ``k`` run on meta, or None."""
    import torch

    from ppdsl.core import model_inputs, own_cut
    from ppdsl.core.hidden_width import hidden_width
    from ppdsl.core.task_loss import own_task
    from .tp_dataflow import _seq_len

    blocks = model.get_submodule(layout.blocks)
    if len(blocks) < 2:
        return None  # one block: one stage, nothing to cut
    if not layout.first:
        return "no module runs before the blocks"
    task = own_task(type(model).__name__, layout.inputs)
    seq = _seq_len(dict(config))
    given = model_inputs.meta_inputs(model, 2, seq, config, kind=layout.inputs)  # the traced kind (W0437's: tokens)
    ids = given.get("input_ids")
    try:
        inputs = own_cut.model_inputs(model, ids, token_type_ids=torch.zeros_like(ids)
                                      if task == "sequence_classification" else None, pixel_values=given.get("pixel_values"),
                                      labels=given.get("decoder_input_ids"), input_features=given.get("input_features"))
    except ValueError as exc:  # a seq2seq model that cannot tell its decoder's input
        return str(exc)
    traced = _traced_shapes(layout)
    if len(traced) == len(blocks) and traced[k]:
        activation = (2, *traced[k])  # as traced: what the boundary before block k carries
    else:
        first = model.get_submodule(layout.first[0])
        config = getattr(model, "config", None)
        hidden = hidden_width(layout.width, None, config.to_dict() if config is not None else {},
                              first.embedding_dim if isinstance(first, torch.nn.Embedding) else None)
        if hidden is None:
            return (f"cannot tell the width of {type(model).__name__}'s hidden state: no hidden size in its config and "
                    f"'{layout.first[0]}' is not an nn.Embedding")
        activation = (2, seq if layout.inputs in model_inputs.TEXT_KINDS else layout.positions, hidden)
    was_training = model.training
    model.train()  # as the stages run it
    try:
        with meta_values():
            return _run_stages(model, layout, blocks, inputs, task, activation, k)
    finally:
        model.train(was_training)


def _run_stages(model: nn.Module, layout: OwnLayout, blocks: Any, inputs: dict[str, Any], task: str,
                activation: tuple[int, ...], k: int) -> str | None:
    import torch

    from ppdsl.core import own_cut
    from ppdsl.core.build import exc_text
    from ppdsl.core.task_loss import task_loss

    n, outputs = len(blocks), layout.block_outputs
    # what the boundary carries besides the hidden state (T5's position bias), at this batch and length
    carried = [(j, (activation[0], *own_cut.carried_at(dims, activation[1])))
               for j, dims in (layout.carried[k] if k < len(layout.carried) else ())]
    shapes = [activation, *(shape for _, shape in carried)]
    undo = own_cut.cut_block_list(model, layout.blocks, {i: blocks[i] for i in range(k)}, blocks, outputs,
                                  layout.block_plain)
    undo += own_cut.drop_modules(model, layout.last)  # stage 0 holds none of them
    undo += own_cut.hook_stop(blocks[k - 1], [j for j, _ in carried])
    try:
        sent, stopped = own_cut.run_forward(model, inputs)
    finally:
        own_cut.undo(undo)
    if not stopped:
        return f"stage 0's forward ended before block {k - 1}'s output"
    wire = activation if not carried else (activation[0], sum(math.prod(s[1:]) for s in shapes))
    if tuple(sent.shape) != wire:
        what = "the shape traced there" if _traced_shapes(layout) else "(microbatch, sequence, hidden)"
        if carried:
            what += (f" and outputs {', '.join(str(j) for j, _ in carried)} of block {k - 1} (which block {k} reads) "
                     f"of shapes {', '.join(str(s) for _, s in carried)}, flattened")
        return f"stage 0 sends a hidden state of shape {tuple(sent.shape)}, not {wire} {what}"
    received, *extra = own_cut.unpack_boundary(torch.empty(wire, dtype=torch.float32, device="meta"), shapes)
    undo = own_cut.cut_block_list(model, layout.blocks, {i: blocks[i] for i in range(k, n)}, blocks, outputs,
                                  layout.block_plain)
    undo += own_cut.stand_in_modules(model, layout.first, model, activation[-1], activation[1], "meta")
    undo += own_cut.hook_receive(blocks[k], lambda: received)
    if carried:
        undo += own_cut.hook_carry(model.get_submodule(layout.blocks)[k - 1],
                                   lambda: {j: t for (j, _), t in zip(carried, extra)})
    try:
        logits, _ = own_cut.run_forward(model, own_cut.later_stage_inputs(model, layout.inputs, inputs))
    finally:
        own_cut.undo(undo)
    from ppdsl.core.task_loss import CLASSIFICATION_TASKS

    ids = inputs.get("decoder_input_ids", inputs.get("input_ids"))  # a speech model's targets: its decoder's length
    batch = activation[0]
    labels = torch.zeros((batch,), dtype=torch.long, device="meta") if task in CLASSIFICATION_TASKS else ids
    try:
        task_loss(task, model.config, logits, labels)
    except Exception as exc:
        return f"the {task} loss does not fit the last stage's logits of shape {tuple(logits.shape)}: {exc_text(exc)}"
    return None


def check_carried_shapes(spec: Any, info: ModelInfo | None) -> list[Any]:
    """E0420 when what the stage boundaries carry besides the hidden state (`OwnLayout.carried`,
    measured at the trace's two short lengths) has another shape at the spec's ``seq_len``, the
    one the plan sizes the boundaries with (LongT5's position bias counts blocks of the sequence):
    the whole model's forward runs on meta at that length, each block's carried outputs recorded.
    Nothing where pp is 1, nothing is carried, or the input is not token ids (an image's
    boundaries are the trace's own sizes)."""
    from ppdsl.core.build import build, exc_text, quiet_transformers
    from ppdsl.core.model_inputs import TEXT_KINDS

    from .own_check import carried_refusal, is_one

    layout = getattr(info, "own_layout", None)
    seq_len = spec.train.seq_len
    if layout is None or not layout.ok or not any(layout.carried) or layout.inputs not in TEXT_KINDS or \
            is_one(spec.mesh.pp) or not isinstance(seq_len, int):
        return []
    model, _ = build(spec.model.source.kind, spec.model.source.target, dict(spec.model.config), "meta", ())
    try:
        with quiet_transformers():
            got = _carried_shapes_at(model, spec.pipeline.blocks, layout, seq_len, dict(spec.model.config))
    except Exception as exc:  # any failure of library code at this length
        got = f"its forward fails on meta at seq_len = {seq_len}: {exc_text(exc)}"
    if got is None:
        return []
    return [carried_refusal(info.class_name, spec.span("train.seq_len") or spec.span("mesh.pp"), got,
                            "set another seq_len (the shapes the trace measured hold at short lengths), or pp = 1",
                            label="the boundaries are sized at this length")]


def _carried_shapes_at(model: nn.Module, blocks: str, layout: OwnLayout, seq_len: int, config: Any) -> str | None:
    from ppdsl.core import own_cut

    from .own_layout import block_output_shapes

    wanted = {(i - 1, j) for i, row in enumerate(layout.carried) for j, _ in row}
    sent = block_output_shapes(model, blocks, wanted, seq_len, config, layout.inputs)
    for i, row in enumerate(layout.carried):
        for j, dims in row:
            expected = own_cut.carried_at(dims, seq_len)
            got = sent.get((i - 1, j))
            if got is None or tuple(got[1:]) != expected:
                return (f"output {j} of block {i - 1}, which block {i} reads, is "
                        f"{tuple(got[1:]) if got else 'not returned'} per sample at seq_len = {seq_len}, not {expected} "
                        "as measured at the trace's short lengths")
    return None
