"""One virtual stage as a module (`StageModule`), and the microbatch it runs on (`MicroBatch`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch
from torch import nn

from ppdsl.runtime.stage.adapters.base import StageAdapter
from ppdsl.lowering.plan import StageAssignment


@attrs.frozen
class MicroBatch:
    """One microbatch. ``labels``: token ids (B, S) for causal LMs, class ids (B,) for BERT and
    image classifiers."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    attention_mask: torch.Tensor | None = None
    token_type_ids: torch.Tensor | None = None
    # packing = "documents": each token's position in its document (runtime.data.batch.Batch.position_ids)
    position_ids: torch.Tensor | None = None
    # context parallelism (runtime.parallel.context.SequenceShard): this cp rank's tokens of each
    # sequence, their global positions and next-token targets; None: whole sequences
    sequence_shard: Any = None
    # what the microbatch's summed token losses are divided by (runtime.data.batch.Batch.token_divisor):
    # None, the mean over its own counted tokens
    token_divisor: float | None = None
    # a model fed images (OwnForward.inputs = "pixels"): (B, C, H, W); input_ids is then a placeholder
    pixel_values: torch.Tensor | None = None
    # a speech model (OwnForward.inputs = "speech"): its audio features, (B, *input_shape)
    input_features: torch.Tensor | None = None

    def to(self, device: torch.device | str) -> MicroBatch:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=True)

        return MicroBatch(
            input_ids=move(self.input_ids),
            labels=move(self.labels),
            attention_mask=move(self.attention_mask),
            token_type_ids=move(self.token_type_ids),
            position_ids=move(self.position_ids),
            sequence_shard=None if self.sequence_shard is None else self.sequence_shard.to(device),
            token_divisor=self.token_divisor,
            pixel_values=move(self.pixel_values),
            input_features=move(self.input_features),
        )


class StageModule(nn.Module):
    """One virtual stage: its modules under their full-model paths, and the family's forward.

    ``forward(x, mb)``: on the first stage ``x`` is None and the tokens come from ``mb``; other
    stages take the hidden states (B, S, H); with ``sequence_parallel`` (B, S / tp, H), this tp
    rank's block of the sequence (the first stage splits its embeddings, the last all-gathers
    before the head). Middle stages return hidden states, the last stage
    the head's output (logits; vocab-local logits when the head is split without gather).
    ``activation_checkpointing`` (set by `runtime.parallel.parallelize.apply_ac` from the plan's train block): recompute
    each block's forward in backward instead of keeping its activations.
    """

    activation_checkpointing: bool = False
    # Set by `runtime.parallel.parallelize.apply_tp` from ``plan.sequence_parallel`` (tp > 1): the hidden states between
    # blocks, and between stages, are this tp rank's block of the sequence (dim 1).
    sequence_parallel: bool = False

    def __init__(
        self,
        assignment: StageAssignment,
        num_stages: int,
        adapter: StageAdapter,
        shell: nn.Module,
        tp_group: Any,
        block_names: Sequence[str],
        task: str = "causal_lm",
    ) -> None:
        super().__init__()
        self.assignment = assignment
        self.task = task  # the plan's (ppdsl.core.task_loss.TASKS): what the last stage's loss is
        self.num_stages = num_stages
        self.adapter = adapter
        self.tp_group = tp_group
        self.block_names = tuple(block_names)
        # hf_pretrained: parameters the checkpoint does not hold (a new head), left at their init
        self.pretrained_kept: tuple[str, ...] = ()
        # The partition (start, end of the real entries) of a head split without gather_output.
        self.head_partition: Any = None
        # A shallow copy of the full model's root object that shares this module's children,
        # parameters and buffers: adapters read its config and may call its methods (the
        # generic decoder's embed / head). Stored outside _modules so it is not a submodule.
        shell.__dict__.update(_modules=self._modules, _parameters=self._parameters, _buffers=self._buffers)
        self.__dict__["shell"] = shell

    @property
    def stage(self) -> int:
        return self.assignment.stage

    @property
    def is_first(self) -> bool:
        return self.assignment.stage == 0

    @property
    def is_last(self) -> bool:
        return self.assignment.stage == self.num_stages - 1

    @property
    def config(self) -> Any:
        """The HF config of the model (None for python factories)."""
        return getattr(self.shell, "config", None)

    def blocks(self) -> list[nn.Module]:
        return [self.get_submodule(name) for name in self.block_names]

    def train(self, mode: bool = True) -> StageModule:
        super().train(mode)
        self.shell.training = mode
        return self

    def forward(self, x: torch.Tensor | None, mb: MicroBatch) -> torch.Tensor:
        if mb.position_ids is None:
            return self._forward(x, mb)
        from ppdsl.core.document_masks import documents

        with documents(mb.position_ids):  # packed documents, for ppdsl's document masks (ModelRef.document_masks)
            return self._forward(x, mb)

    def _forward(self, x: torch.Tensor | None, mb: MicroBatch) -> torch.Tensor:
        if self.adapter.own_forward:
            return self.adapter.run_stage(self, x, mb)
        if self.is_first:
            if x is not None:
                raise ValueError(f"stage {self.stage} is the first stage: it takes its input from the microbatch, not x")
            hidden = self.adapter.embed(self, mb)
            if self.sequence_parallel:  # replicated embeddings -> this rank's sequence block
                from ppdsl.runtime.parallel.tp import scatter_seq

                hidden = scatter_seq(hidden, self.tp_group, 1)
        else:
            if x is None:
                raise ValueError(f"stage {self.stage} needs the previous stage's hidden states")
            hidden = x
        if self.block_names:
            ctx = self.adapter.context(self, self._full_like(hidden), mb)
            for block in self.blocks():
                hidden = self._run_block(block, hidden, ctx)
        if not self.is_last:
            return hidden
        if self.sequence_parallel:  # the head runs replicated on the whole sequence
            from ppdsl.runtime.parallel.tp import gather_seq_replicated

            hidden = gather_seq_replicated(hidden, self.tp_group, 1)
        return self.adapter.head(self, hidden, mb)

    def _full_like(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the adapter's ``context`` sees: under sequence parallelism a stand-in with the
        whole sequence's shape (a zero-stride view: no memory), since the masks, positions and
        rotary tables it builds from ``hidden.shape`` are for the full sequence that the
        attention modules see after their all-gather; otherwise ``hidden`` itself."""
        if not self.sequence_parallel:
            return hidden
        import torch.distributed as dist

        shape = list(hidden.shape)
        shape[1] *= dist.get_world_size(self.tp_group)
        return hidden.new_zeros(()).expand(shape)

    def _run_block(self, block: nn.Module, hidden: torch.Tensor, ctx: Any) -> torch.Tensor:
        """One block through the family adapter; with activation checkpointing (and autograd
        recording) under non-reentrant `torch.utils.checkpoint`: only the block's input is
        kept, its forward is recomputed in backward with the RNG state (dropout masks) and
        autocast state of the original forward. Non-reentrant recomputation happens inside
        whichever backward call first needs the block's saved tensors, once per call, so it
        composes with the executor's split backward (``backward_input`` recomputes, and
        ``backward_weight`` recomputes again for its own ``autograd.grad``)."""
        if self.activation_checkpointing and torch.is_grad_enabled():
            from torch.utils.checkpoint import checkpoint

            out = checkpoint(
                self.adapter.run_block, self, block, hidden, ctx, use_reentrant=False, preserve_rng_state=True
            )
        else:
            out = self.adapter.run_block(self, block, hidden, ctx)
        # transformers 4.x blocks return (hidden, ...), 5.x blocks the hidden state alone
        return out[0] if isinstance(out, tuple) else out

    def loss(self, output: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        """Scalar mean loss of one microbatch (last stage only); under context parallelism this
        rank's share of it (`runtime.parallel.context.sharded_loss`)."""
        if not self.is_last:
            raise ValueError(f"stage {self.stage} is not the last stage; only the last stage computes the loss")
        shard = mb.sequence_shard
        from ppdsl.runtime.stage.adapters.base import shifted_causal_lm_loss

        if shard is None and mb.token_divisor is not None:  # per token over the global batch (chat data)
            from ppdsl.core.task_loss import over_tokens, shifted_labels

            return over_tokens(shifted_causal_lm_loss(self, output, shifted_labels(mb.labels), "none"), mb.token_divisor)
        if shard is None:
            return self.adapter.loss(self, output, mb)

        from ppdsl.runtime.parallel.context import sharded_loss

        return sharded_loss(shifted_causal_lm_loss(self, output, shard.targets, "none"), shard)

    def extra_repr(self) -> str:
        a = self.assignment
        return f"stage={a.stage}, rank={a.rank}, chunk={a.chunk}, blocks=[{a.block_start}, {a.block_stop})"


class Container(nn.Module):
    """An intermediate path component (``transformer`` on a middle stage); never called."""
