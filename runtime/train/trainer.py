"""One training step of one rank: pipeline step, gradient synchronisation, clipping, optimizer.
The loop over the steps is `runtime.train.loop`; data-parallel averaging `runtime.parallel.grad_sync`.

Per step: the executor runs the schedule (gradients accumulate over the microbatches), then

1. tied parameters (GPT-2's wte / lm_head on the first and last stage) get the sum of their
   copies' gradients;
2. sequence-parallel replicated parameters get their partial gradients summed over tp;
3. data-parallel replicas average their gradients (bucketed all-reduce, once per step; with
   ZeRO-1 a reduce-scatter, each rank keeping the gradients of the parameters it owns:
   ``runtime.parallel.zero``; with ZeRO-3 FSDP2's reduce-scatter, once per step, each rank keeping its
   dp shard of every gradient: ``runtime.parallel.fsdp``, done first so that 1. and 2. sum shards);
4. fp16 only: gradients are unscaled; then a step whose loss or any rank's gradient is not
   finite (inf/nan) is skipped by every rank alike (one all-reduce of a flag over the world):
   parameters and optimizer state untouched, the LR schedule moving on (``train.on_nonfinite``:
   the run stops after ``train.max_nonfinite`` such steps in a row, or at the first with
   ``stop``);
5. gradients are clipped by the global norm over every rank, each parameter counted once;
6. the optimizer and the LR schedule step.

Dropout draws from torch's default generators, which the trainer seeds per (dp, pp) coordinate,
so every rank of a tensor-parallel group draws the same masks for replicated activations; the
tp-local part of attention and MLP modules (a rank's own heads) runs on that tp rank's own
stream (``runtime.parallel.rng``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ppdsl.lowering.plan import Plan

from ppdsl.runtime.data.batch import DataSource
from ppdsl.runtime.data.source import make_data
from ppdsl.runtime.pipeline.executor import PipelineExecutor
from ppdsl.runtime.parallel.expert import expert_parameters, sync_expert_gradients
from ppdsl.runtime.parallel.fsdp import WeightAccess, accumulate_without_sync, local, reduce_gradients, reshard
from ppdsl.runtime.parallel.grad_sync import BUCKET_BYTES, allreduce_average
from ppdsl.runtime.parallel.groups import ProcessGroups
from ppdsl.runtime.train.metrics import flops_per_token
from ppdsl.runtime.stage.params import is_tp_sharded, local_grads
from ppdsl.runtime.train.optim import LossScaler, autocast_factory, build_optimizer, lr_factor, param_groups, parameter_dtype
from ppdsl.runtime.parallel.parallelize import ParamFacts, parallelize
from ppdsl.runtime.parallel.rng import seed_replicated_stream
from ppdsl.runtime.stage.build import activation_shape, boundary_shapes, build_stages, tied_parameter_groups
from ppdsl.runtime.stage.tied import sum_tied_gradients, tied_groups
from ppdsl.runtime.train.trace import Recorder, span

# ---------------------------------------------------------------------------------------------
# The trainer
# ---------------------------------------------------------------------------------------------


class Trainer:
    """Everything one rank needs to train its part of the plan."""

    def __init__(
        self,
        plan: Plan,
        groups: ProcessGroups,
        device: torch.device,
        *,
        lookahead: int | None = None,
        bucket_bytes: int = BUCKET_BYTES,
    ) -> None:
        """`lookahead`: how many actions ahead the executor posts its receives. Default: 2 on
        CPU (gloo matches each message on its own, so an early receive lets the transfer
        overlap the current action), 1 on CUDA (NCCL serialises a pair's operations on one
        stream, where a receive posted ahead of a send the peer waits for can deadlock)."""
        self.plan, self.groups, self.device = plan, groups, device
        self.bucket_bytes = bucket_bytes
        train = plan.train
        if train.zero not in (0, 1, 3):
            raise ValueError(f"zero = {train.zero}: only ZeRO stage 0, 1 or 3 is supported with pipelines")
        if (plan.mesh.ep > 1 and not plan.experts) or (plan.mesh.cp > 1 and not plan.context_attention):
            raise ValueError("the plan divides experts or sequences (ep or cp > 1) but names no experts or attention "
                             "modules: it was lowered without the model (--no-model); lower it with the model")
        self.stages = build_stages(plan, groups.pp_rank, device, train.seed)
        self.tied_names = tied_parameter_groups(plan, self.stages)
        parallel = parallelize(self.stages, plan, groups, device)
        self.fsdp_roots = parallel.fsdp_roots
        self._stage_copies = parallel.stage_copies  # runtime.parallel.fsdp.StageCopy: a tie within this rank, split
        self.tp_rng, self.sp_rng = parallel.tp_rng, parallel.sp_rng
        self._index_params(parallel.facts)
        wire = self.params[0].dtype if self.params else parameter_dtype(train.precision)
        self.executor = PipelineExecutor(
            plan, self.stages, groups, device, self._boundary_shapes(plan), wire_dtype=wire,
            autocast=autocast_factory(train.precision, device),
            lookahead=(2 if device.type == "cpu" else 1) if lookahead is None else lookahead,
        )
        if self.fsdp_roots and train.reshard_after_forward:
            self.executor.weight_access = WeightAccess(self.fsdp_roots).access
        self.recorder: Recorder | None = None
        if train.trace:
            self.recorder = Recorder(groups.rank, groups.layout.coords(groups.rank), device)
            self.executor.recorder = self.recorder
        self.optimizer = self._optimizer()
        factor = lr_factor(train.lr_schedule, train.optimizer.lr, train.steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, factor)
        self.scaler = LossScaler() if train.precision == "fp16" else None
        # this rank's data: inputs only where the first stage is, labels where the last is
        self.data: DataSource = make_data(plan, pp_rank=groups.pp_rank, cp_rank=groups.cp_rank)
        self.feed: Any = None  # a runtime.data.prefetch.Prefetcher of self.data, while the training loop runs
        # dropout: one stream shared by the ranks of this tp group (replicated activations get
        # the same masks); the tp-local regions were installed by parallelize. Seeded last, so
        # building never shifts it; a checkpoint load restores it afterwards.
        seed_replicated_stream(train.seed, groups.dp_rank, groups.pp_rank)

    # -- setup -----------------------------------------------------------------------------

    def _index_params(self, facts: ParamFacts) -> None:
        """named_params, params, tied groups, norm membership, sequence-parallel and expert
        parameters, from the stages and what `parallelize` recorded of the plain parameters."""
        self.named_params = self._named_params()
        self.params = [p for _, p in self.named_params]
        copies = {c.name: self.stages[c.stage].get_parameter(c.name) for c in self._stage_copies}
        self.tied = tied_groups(self.plan, self.groups, self.tied_names,
                                dict(self.named_params), copies)
        self._copies = self._copy_pairs()
        self._counts_in_norm = self._norm_membership(facts)
        self._sp_params = [p for n, p in self.named_params if n in facts.sequence_parallel]
        experts = {id(p) for p in expert_parameters(self.stages)}
        self._expert_params = [p for p in self.params if id(p) in experts]
        self._dense_params = [p for p in self.params if id(p) not in experts]

    def _named_params(self) -> list[tuple[str, nn.Parameter]]:
        seen: set[int] = set()
        out = []
        copies = {(c.stage, c.name) for c in self._stage_copies}
        for i, stage in enumerate(self.stages):
            for name, p in stage.named_parameters():
                if p.requires_grad and id(p) not in seen and (i, name) not in copies:
                    seen.add(id(p))
                    out.append((name, p))
        return out

    def _copy_pairs(self) -> list[tuple[nn.Parameter, nn.Parameter]]:
        """(copy, original) of each parameter split from a tie within this rank (ZeRO-3)."""
        by_name = dict(self.named_params)
        return [(self.stages[c.stage].get_parameter(c.name), by_name[c.original]) for c in self._stage_copies]

    def _norm_membership(self, facts: ParamFacts) -> dict[int, bool]:
        """id(param) -> whether this rank adds it to the global gradient norm."""
        tp_rank = self.groups.tp_rank
        counts = {id(p): tp_rank == 0 or facts.tp_sharded[n] for n, p in self.named_params}
        for group in self.tied:
            for i, p in enumerate(group.local):
                counts[id(p)] = counts.get(id(p), False) and group.canonical and i == 0
        return counts

    def _boundary_shapes(self, plan: Plan) -> Any:
        """What each stage boundary carries (`runtime.stage.build.boundary_shapes`)."""
        return boundary_shapes(plan)

    def _optimizer(self) -> torch.optim.Optimizer:
        opt = self.plan.train.optimizer
        if self.plan.train.zero == 1 and self.groups.layout.dp > 1:
            from ppdsl.runtime.parallel.zero import ZeroOneOptimizer

            return ZeroOneOptimizer(
                self.params, param_groups(self.params, opt.weight_decay), lambda owned: build_optimizer(owned, opt),
                self.groups.dp, self.groups.layout.dp, self.groups.dp_rank, self.bucket_bytes, opt.lr,
            )
        return build_optimizer(self.params, opt)

    @property
    def zero(self) -> Any:
        """The ZeRO-1 optimizer (runtime.parallel.zero.ZeroOneOptimizer), or None without ZeRO."""
        from ppdsl.runtime.parallel.zero import ZeroOneOptimizer

        return self.optimizer if isinstance(self.optimizer, ZeroOneOptimizer) else None

    def optimizer_state(self, p: nn.Parameter) -> dict[str, Any]:
        """The optimizer state this rank holds for `p` (empty when a ZeRO peer owns it)."""
        zero = self.zero
        return zero.state_of(p) if zero is not None else self.optimizer.state.get(p, {})

    def optimizer_holding(self, p: nn.Parameter) -> torch.optim.Optimizer | None:
        """The torch optimizer that steps `p` on this rank (None: a ZeRO peer owns it)."""
        zero = self.zero
        if zero is None:
            return self.optimizer
        return zero.inner if zero.owns(p) else None

    # -- one step, in parts (verify inspects the gradients between them) ---------------------

    def forward_backward(self, step: int) -> float:
        """Zero the gradients and run the pipeline on step `step`'s data (0-based)."""
        for p in self.params:
            p.grad = None
        mbs = self.read_step(step) if self.feed is None else self.feed.take(step)
        scale = 1.0 if self.scaler is None else self.scaler.scale
        if self.fsdp_roots:
            accumulate_without_sync(self.fsdp_roots, self.plan.train.reshard_after_forward)
        self.refresh_stage_copies()
        return self.executor.train_step(mbs, loss_scale=scale)

    def read_step(self, step: int) -> list[Any]:
        """This rank's microbatches of step `step` (0-based)."""
        return self.data.microbatches(step, self.groups.dp_rank, self.device)

    @torch.no_grad()
    def refresh_stage_copies(self) -> None:
        """ZeRO-3: a stage's copy of a parameter tied within this rank (``runtime.parallel.fsdp``) takes
        the original's values (which the optimizer, or a checkpoint load, changed)."""
        for copy, original in self._copies:
            copy.grad = None
            local(copy).copy_(local(original))

    def sync_gradients(self) -> None:
        """Tied sum, sequence-parallel sum over tp, data-parallel average (ZeRO-3: the
        reduce-scatter comes first, the sums then work on the dp shards, sharded alike on
        every rank of a tie or tp group)."""
        if self.fsdp_roots:
            reduce_gradients(self.fsdp_roots)
        # A parameter without a gradient was not used by this rank's stages; the data-parallel
        # replicas run the same stages, so they skip the same ones (and so does the optimizer,
        # as in one process). Tied copies must all take part in their sum.
        sum_tied_gradients(self.tied)
        if self._sp_params and self.groups.layout.tp > 1:
            allreduce_average(local_grads(self._sp_params), self.groups.tp, 1, self.bucket_bytes)
        if self.zero is not None:  # ZeRO-1: each rank receives the averaged gradients it owns
            self.zero.reduce_scatter_gradients()
        elif self.groups.layout.replicas > 1 and not self.fsdp_roots:
            allreduce_average(local_grads(self._dense_params), self.groups.replicas, self.groups.layout.replicas,
                              self.bucket_bytes)
        if self._expert_params:
            sync_expert_gradients(self._expert_params, self.groups, self.bucket_bytes)

    def unscale_and_check(self, loss: float | None = None) -> bool:
        """fp16: divide the gradients by the loss scale. Every precision: True when the step's
        `loss` (the same on every rank) or a gradient on some rank is inf/nan - the same answer
        on every rank, by one all-reduce over the world (fp16: the scaler halves its scale)."""
        inv = None if self.scaler is None else 1.0 / self.scaler.scale
        bad = torch.zeros((), device=self.device)
        if loss is not None and not math.isfinite(loss):
            bad.fill_(1.0)
        for g in local_grads(self.params):
            if inv is not None:
                g.mul_(inv)
            bad = torch.maximum(bad, (~torch.isfinite(g)).any().float())
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        nonfinite = bool(bad.item())
        if self.scaler is not None:
            self.scaler.update(nonfinite)
        return nonfinite

    def grad_norm(self) -> torch.Tensor:
        """The global L2 norm of the gradients: pipeline and tensor-parallel parts summed, every
        replicated or tied tensor counted once."""
        sq = self._squared_norm(self._dense_params)
        if self._expert_params:  # each ep rank holds other experts
            experts = self._squared_norm(self._expert_params)
            dist.all_reduce(experts, group=self.groups.ep)
            sq = sq + experts
        if self.groups.layout.pp > 1:
            dist.all_reduce(sq, group=self.groups.pp)
        if self.groups.layout.tp > 1:
            dist.all_reduce(sq, group=self.groups.tp)
        if self.zero is not None or self.fsdp_roots:  # each gradient (element) lives on one dp rank
            dist.all_reduce(sq, group=self.groups.dp)
        return sq.sqrt()

    def _squared_norm(self, params: Sequence[nn.Parameter]) -> torch.Tensor:
        dtype = parameter_dtype(self.plan.train.precision)
        norms = [
            torch.linalg.vector_norm(local(p.grad), dtype=dtype)
            for p in params
            if p.grad is not None and self._counts_in_norm[id(p)]
        ]
        if not norms:
            return torch.zeros((), dtype=dtype, device=self.device)
        return torch.stack(norms).pow(2).sum()

    def clip(self) -> float | None:
        """Clip to the plan's max norm (torch.nn.utils.clip_grad_norm_'s rule); returns the norm."""
        max_norm = self.plan.train.grad_clip
        if max_norm is None:
            return None
        total = self.grad_norm()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in local_grads(self.params):
            g.mul_(coef)
        return float(total)

    def optimizer_step(self) -> None:
        self.optimizer.step()
        self.scheduler.step()
        self.refresh_stage_copies()

    def step(self, step: int) -> tuple[float, float | None, bool]:
        """One full training step; returns (loss, grad norm, skipped). A skipped step (its
        loss or a gradient not finite) leaves parameters and optimizer state as they were; the
        LR schedule moves on, so it stays a function of the step number (as the data does)."""
        from ppdsl.runtime.run.failure import test_fault_due

        loss = self.forward_backward(step)
        if test_fault_due("nan", step + 1, self.groups.rank):
            self._poison_gradient()
        rec, progress = self.recorder, self.executor.progress
        if progress is not None:
            progress.doing("gradient sync")
        with span(rec, "grad sync"):
            self.sync_gradients()
            nonfinite = self.unscale_and_check(loss)
        if nonfinite:
            self.scheduler.step()
            return loss, None, True
        with span(rec, "clip"):
            norm = self.clip()
        if progress is not None:
            progress.doing("optimizer step")
        with span(rec, "optimizer"):
            self.optimizer_step()
        return loss, norm, False

    @torch.no_grad()
    def _poison_gradient(self) -> None:
        """Test hook (``PPDSL_TEST_FAULT=nan:STEP:RANK``): one element of this rank's first
        gradient becomes NaN, before the gradients are synchronised."""
        grads = local_grads(self.params)
        if grads:
            grads[0].view(-1)[0] = float("nan")

    @torch.no_grad()
    def evaluate(self, step: int) -> float:
        """The forward-only loss of training step `step`'s data (held-out evaluation:
        ``runtime.train.evaluate.Evaluator``)."""
        mbs = self.data.microbatches(step, self.groups.dp_rank, self.device)
        self.refresh_stage_copies()
        loss = self.executor.eval_step(mbs)
        reshard(self.fsdp_roots)
        return loss

    def model_flops_per_token(self) -> float:
        """Training FLOPs per token of the whole model (``metrics.flops_per_token``): N counts
        the parameters of every module but the embeddings (a tied output head counts, as its
        matmul runs), each tensor-parallel shard once, summed over the pipeline. Collective."""
        from ppdsl.runtime.parallel.tp import VocabParallelEmbedding

        tp, tp_rank = self.groups.layout.tp, self.groups.tp_rank
        counted: dict[int, tuple[nn.Parameter, nn.Module, str]] = {}
        for stage in self.stages:
            for sub in stage.modules():
                if isinstance(sub, (nn.Embedding, VocabParallelEmbedding)):
                    continue
                for local, p in sub.named_parameters(recurse=False):
                    counted.setdefault(id(p), (p, sub, local))
        n = sum(p.numel() for p, sub, local in counted.values() if tp_rank == 0 or is_tp_sharded(p, sub, local, tp))
        total = torch.tensor(float(n), dtype=torch.float64, device=self.device)
        if self.groups.layout.pp > 1:
            dist.all_reduce(total, group=self.groups.pp)
        if tp > 1:
            dist.all_reduce(total, group=self.groups.tp)
        hidden = int(activation_shape(self.plan)[-1])
        return flops_per_token(int(total.item()), self.plan.num_blocks, hidden, self.plan.train.seq_len)
