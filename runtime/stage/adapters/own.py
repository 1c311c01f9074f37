"""The model's own forward as a pipeline stage, for HF classes no other family claims.

A stage holds the whole skeleton: its intermediate modules are shallow copies of the real ones
(``model`` is still an ``Olmo2Model``, whose ``forward`` runs), with only the modules the plan
gives the stage. `OwnStage.prepare` cuts it with `ppdsl.core.own_cut`, the mechanics check runs
on meta before launch: the block list keeps the stage's blocks at their own indices
(pass-throughs elsewhere), the ``first`` modules a later stage does not hold become shape-only
stand-ins, a non-first stage's first block receives the activation, a non-last stage's last
block ends the forward. A boundary that carries more than the hidden state (the plan's
`Boundary.tensors`: T5's position bias) travels as one flattened tensor: the sending stage's last
block hands over those outputs too, and the receiving stage's pass-through before its first block
returns them (`own_cut.pack_boundary`, `hook_carry`). Each block runs under activation
checkpointing when the plan asks.

Tensor parallelism replaces the split layers in place (runtime/parallel/parallelize.py); the forward,
which check ran at local shapes on meta, then works on this rank's share of the heads. With sequence
parallelism the first stage's first block takes this tp rank's block of the sequence, the blocks
gather it where they split (`ppdsl.core.sequence_regions`), the boundaries carry the block, and the
last stage's last block gives the whole sequence back for the final norm and the head.

The last stage returns the model's ``logits``; the loss is the task's (`ppdsl.core.task_loss`:
causal-LM shift, or the sequence- / image-classification rules on the already pooled logits),
the one the single-process reference computes for these classes too. A model fed images
(`ppdsl.core.model_inputs`) gets the microbatch's ``pixel_values`` in the parameters' dtype, a
speech model its ``input_features``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ppdsl.core import own_cut
from ppdsl.runtime.stage.adapters.base import StageAdapter, causal_lm_loss, sequence_classification_loss
from ppdsl.core.task_loss import CLASSIFICATION_TASKS, task_loss

if TYPE_CHECKING:
    from ppdsl.lowering.plan import Plan
    from ppdsl.runtime.stage.build import MicroBatch, StageModule


class OwnStage(StageAdapter):
    fixed_layout = False
    own_forward = True

    def check_layout(self, plan: Plan) -> None:
        if plan.own_forward is None:
            raise ValueError("the plan runs the model's own forward (family 'own') but records no own_forward; "
                             "lower it again with ppdsl check")
        empty = [a.stage for a in plan.stages if a.num_blocks == 0]
        if empty:
            raise ValueError(f"stage {empty[0]} holds no block: the model's own forward needs one on every stage")

    def prepare(self, stage: StageModule, plan: Plan, skeleton: nn.Module) -> None:
        assert plan.own_forward is not None
        parent_path, _, name = plan.blocks.rpartition(".")
        parent = stage.get_submodule(parent_path) if parent_path else stage
        held = {int(i): b for i, b in getattr(parent, name).items()} if name in parent._modules else {}
        own_cut.cut_block_list(stage, plan.blocks, held, skeleton.get_submodule(plan.blocks),
                               plan.own_forward.block_outputs, plan.own_forward.block_plain)
        if not stage.is_first:  # fed images or audio, a stand-in returns the activation (its length: the blocks' positions)
            own_cut.stand_in_modules(stage, plan.stages[0].first, skeleton, plan.model.hidden,
                                     plan.train.seq_len if plan.own_forward.inputs in ("pixels", "speech") else None)
        blocks = stage.blocks()
        if not stage.is_first:
            own_cut.hook_receive(blocks[0], lambda: stage.__dict__.get("own_received"))
            incoming = plan.boundary(stage.stage - 1)
            if incoming is not None and len(incoming.tensors) > 1:  # T5's position bias besides the hidden state
                own_cut.hook_carry(stage.get_submodule(plan.blocks)[min(held) - 1],
                                   lambda: stage.__dict__.get("own_carried") or {})
                stage.__dict__["own_incoming"] = incoming.tensors
        if not stage.is_last:
            outgoing = plan.boundary(stage.stage)
            own_cut.hook_stop(blocks[-1], tuple(t.output for t in outgoing.tensors[1:]) if outgoing is not None else ())
        if plan.sequence_parallel and plan.mesh.tp > 1:  # the blocks and the boundaries hold 1/tp of the sequence
            from ppdsl.runtime.parallel.tp import gather_seq_replicated, scatter_seq

            if stage.is_first:
                own_cut.hook_hidden_in(blocks[0], lambda h: scatter_seq(h, stage.tp_group, 1))
            if stage.is_last:
                own_cut.hook_hidden_out(blocks[-1], lambda h: gather_seq_replicated(h, stage.tp_group, 1))
        for block in blocks:
            block.forward = _checkpointed(stage, block.forward)  # type: ignore[method-assign]
        stage.__dict__["own_inputs"] = plan.own_forward.inputs

    def run_stage(self, stage: StageModule, x: torch.Tensor | None, mb: MicroBatch) -> torch.Tensor:
        if stage.is_first != (x is None):
            raise ValueError(f"stage {stage.stage} takes " + (
                "its input from the microbatch, not x" if stage.is_first else "the previous stage's hidden states"))
        incoming = stage.__dict__.get("own_incoming")
        if x is not None and incoming:
            x, *carried = own_cut.unpack_boundary(x, [t.shape for t in incoming])
            stage.__dict__["own_carried"] = {t.output: c for t, c in zip(incoming[1:], carried)}
        stage.__dict__["own_received"] = x
        try:
            inputs = _model_inputs(stage.shell, mb)
            if not stage.is_first:  # an image-text model's vision tower runs in the first stage only
                inputs = own_cut.later_stage_inputs(stage.shell, stage.__dict__["own_inputs"], inputs)
            out, stopped = own_cut.run_forward(stage.shell, inputs)
        finally:
            stage.__dict__["own_received"] = stage.__dict__["own_carried"] = None
        if stopped != (not stage.is_last):
            raise ValueError(f"stage {stage.stage}: the forward ended before its last block's output")
        return out

    def loss(self, stage: StageModule, output: torch.Tensor, mb: MicroBatch) -> torch.Tensor:  # whole sequences
        if stage.head_partition is None:
            return task_loss(stage.task, stage.config, output, mb.labels)
        # a head split over tp without gathering its output: this rank's slice of the logits
        if stage.task in CLASSIFICATION_TASKS:
            return sequence_classification_loss(stage, output, mb.labels)
        if stage.task == "seq2seq_lm":  # targets at the same positions, unshifted
            from ppdsl.runtime.stage.adapters.base import shifted_causal_lm_loss
            return shifted_causal_lm_loss(stage, output, mb.labels)
        return causal_lm_loss(stage, output, mb.labels)


def _checkpointed(stage: StageModule, forward: Any) -> Any:
    """The block's forward, under non-reentrant activation checkpointing when the stage asks
    for it and autograd records (as `StageModule._run_block` does for the families)."""
    def run(*args: Any, **kwargs: Any) -> Any:
        if stage.activation_checkpointing and torch.is_grad_enabled():
            from torch.utils.checkpoint import checkpoint

            return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)
        return forward(*args, **kwargs)
    return run


def _model_inputs(model: nn.Module, mb: MicroBatch) -> dict[str, Any]:
    shard = mb.sequence_shard
    return own_cut.model_inputs(model, mb.input_ids, mb.attention_mask, mb.token_type_ids,
                                getattr(mb, "position_ids", None) if shard is None else shard.position_ids,
                                own_cut.as_parameters(model, getattr(mb, "pixel_values", None)), mb.labels,
                                own_cut.as_parameters(model, getattr(mb, "input_features", None)))
