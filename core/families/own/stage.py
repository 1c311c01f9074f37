"""The model's own forward as a pipeline stage (tp = 1), for HF classes no other family claims.

A stage holds the whole skeleton: its intermediate modules are shallow copies of the real ones
(``model`` is still an ``Olmo2Model``, whose ``forward`` runs), with only the modules the plan
gives the stage. `OwnStage.prepare` then:

- puts the block list back as an ``nn.ModuleList`` as long as the model's, holding the stage's
  blocks at their own indices and a parameter-free pass-through (`_Skipped`) elsewhere, so
  ``enumerate(self.layers)``, ``self.layers[: n]`` and ``config.layer_types[i]`` mean what they
  mean in one process; each block keeps its attributes (``layer_idx``, sliding-window flags);
- replaces each ``first`` module a later stage does not hold by a parameter-free stand-in
  (`_ShapeOnly`) that returns zeros of the right shape and dtype: the forward still builds its
  masks, positions and rotary tables itself (check's trace proved the blocks read no value of it);
- hooks the stage's first block (a non-first stage: its hidden state becomes the activation
  received) and its last block (a non-last stage: `_StageOutput` carries the block's output out
  of the forward).

The last stage returns the model's ``logits``; the loss is computed here the way the families do
(causal-LM shift, or the sequence-classification rules on the already pooled logits).
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ppdsl.core.families.stage_base import StageAdapter, causal_lm_loss, sequence_classification_loss

if TYPE_CHECKING:
    from ppdsl.lowering.plan import Plan
    from ppdsl.runtime.stage import MicroBatch, StageModule


class _StageOutput(Exception):
    """Raised by the hook on a non-last stage's last block: its output hidden state."""

    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__("stage output")
        self.hidden = hidden


class _Skipped(nn.Module):
    """A block another stage holds: passes the hidden state through (never reached after this
    stage's blocks; before them, the first held block replaces whatever it passes)."""

    def __init__(self, as_tuple: bool, like: nn.Module) -> None:
        super().__init__()
        self.as_tuple = as_tuple
        # the block's plain attributes, which the forward may read (ModernBERT's attention_type)
        for key, value in vars(like).items():
            if not key.startswith("_") and key != "training" and not isinstance(value, (nn.Module, torch.Tensor)):
                self.__dict__[key] = value

    def forward(self, hidden_states: torch.Tensor | None = None, *args: Any, **kwargs: Any) -> Any:
        hidden = hidden_states if hidden_states is not None else kwargs.get("hidden_states")
        return (hidden,) if self.as_tuple else hidden


class _ShapeOnly(nn.Module):
    """A module before the blocks that this stage does not hold: zeros shaped like its output.
    Token ids in: (*ids, width), the embedding width (``hidden`` for an embeddings module that
    is not one ``nn.Embedding``); features in: the same shape (norms), or ``out_features`` wide."""

    def __init__(self, like: nn.Module, hidden: int) -> None:
        super().__init__()
        weight = next(like.parameters(), None)
        self.dtype = weight.dtype if weight is not None and weight.is_floating_point() else torch.float32
        self.width = like.embedding_dim if isinstance(like, nn.Embedding) else \
            like.out_features if isinstance(like, nn.Linear) else None
        self.hidden = hidden

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        x = next((t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)), None)
        if x is None:
            raise ValueError("a stand-in for a module this stage does not hold got no tensor input")
        if not x.is_floating_point():  # token ids
            return torch.zeros((*x.shape, self.width or self.hidden), dtype=self.dtype, device=x.device)
        if self.width is not None:
            return x.new_zeros((*x.shape[:-1], self.width))
        return torch.zeros_like(x)


class OwnStage(StageAdapter):
    fixed_layout = False
    own_forward = True

    def check_layout(self, plan: Plan) -> None:
        if plan.own_forward is None:
            raise ValueError("the plan runs the model's own forward (family 'own') but records no own_forward; "
                             "lower it again with ppdsl check")
        if plan.mesh.tp > 1:
            raise ValueError(f"the model's own forward runs at tp = 1 only (the plan has tp = {plan.mesh.tp})")
        empty = [a.stage for a in plan.stages if a.num_blocks == 0]
        if empty:
            raise ValueError(f"stage {empty[0]} holds no block: the model's own forward needs one on every stage")

    def prepare(self, stage: StageModule, plan: Plan, skeleton: nn.Module) -> None:
        assert plan.own_forward is not None
        parent_path, _, name = plan.blocks.rpartition(".")
        parent = stage.get_submodule(parent_path) if parent_path else stage
        held = dict(getattr(parent, name).items()) if name in parent._modules else {}
        as_tuple = plan.own_forward.block_output == "tuple"
        skeleton_blocks = skeleton.get_submodule(plan.blocks)
        parent._modules[name] = nn.ModuleList([held[str(i)] if str(i) in held else
                                               _Skipped(as_tuple, skeleton_blocks[i]) for i in range(plan.num_blocks)])
        if not stage.is_first:
            hidden = self.hidden_size(skeleton, plan)
            for path in plan.stages[0].first:
                owner_path, _, leaf = path.rpartition(".")
                owner = stage.get_submodule(owner_path) if owner_path else stage
                owner._modules[leaf] = _ShapeOnly(skeleton.get_submodule(path), hidden)
        blocks = stage.blocks()
        first, last = blocks[0], blocks[-1]
        if not stage.is_first:
            first.register_forward_pre_hook(_receive(stage), with_kwargs=True)
        if not stage.is_last:
            last.register_forward_hook(_send)
        for block in blocks:
            block.forward = _checkpointed(stage, block.forward)  # type: ignore[method-assign]
        stage.__dict__["own_task"] = plan.own_forward.task

    def run_stage(self, stage: StageModule, x: torch.Tensor | None, mb: MicroBatch) -> torch.Tensor:
        if stage.is_first != (x is None):
            raise ValueError(f"stage {stage.stage} takes " + (
                "its input from the microbatch, not x" if stage.is_first else "the previous stage's hidden states"))
        stage.__dict__["own_received"] = x
        try:
            out = stage.shell(**_model_inputs(stage.shell, mb))
        except _StageOutput as done:
            return done.hidden
        finally:
            stage.__dict__["own_received"] = None
        if not stage.is_last:
            raise ValueError(f"stage {stage.stage}: the forward ended before its last block's output")
        return out.logits if hasattr(out, "logits") else out[0]

    def loss(self, stage: StageModule, output: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        if stage.__dict__.get("own_task") == "sequence_classification":
            return sequence_classification_loss(stage, output, mb.labels)
        return causal_lm_loss(stage, output, mb.labels)


def _receive(stage: StageModule) -> Any:
    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        received = stage.__dict__.get("own_received")
        assert received is not None, "the stage's first block ran without a received activation"
        if args and isinstance(args[0], torch.Tensor):
            return (received, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": received}
    return hook


def _send(module: nn.Module, args: Any, output: Any) -> None:
    raise _StageOutput(output if isinstance(output, torch.Tensor) else output[0])


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
    accepted = inspect.signature(model.forward).parameters
    out: dict[str, Any] = {"input_ids": mb.input_ids}
    if mb.attention_mask is not None:
        out["attention_mask"] = mb.attention_mask
    if mb.token_type_ids is not None and "token_type_ids" in accepted:
        out["token_type_ids"] = mb.token_type_ids
    if "use_cache" in accepted:
        out["use_cache"] = False
    return out
