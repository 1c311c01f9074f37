"""The plan: plain, frozen, printable data that the runtime executes. No torch here.

A Plan is what `lowering.lower(spec, world)` returns and what `ppdsl plan --format json` prints;
`Plan.from_json(plan.to_json())` gives the same plan back.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

import attrs

from ppdsl.core.config_tree import frozen
from ppdsl.core.schedules.ir import Action, Op, Schedule

MESH_DIMS = ("dp", "cp", "pp", "tp")  # outermost first: tp ranks are neighbours (same node), dp is outermost


@attrs.frozen
class MeshLayout:
    world: int
    dp: int
    pp: int
    tp: int
    # expert parallelism borrows from dp: the dp ranks [k * ep, (k + 1) * ep) (same pp, tp) hold one
    # copy of the experts, expert rank dp % ep holding the experts [i * E / ep, (i + 1) * E / ep)
    ep: int = 1
    # context parallelism is a world factor (world = dp * cp * pp * tp): the cp ranks with the same
    # dp, pp, tp split each sequence of one replica's batch, cp rank i holding the chunks i and
    # 2 * cp - 1 - i of 2 * cp (head-tail balancing of causal attention)
    cp: int = 1

    def __attrs_post_init__(self) -> None:
        assert self.dp * self.cp * self.pp * self.tp == self.world, (self.dp, self.cp, self.pp, self.tp, self.world)
        assert self.ep >= 1 and self.dp % self.ep == 0, (self.dp, self.ep)

    @property
    def replicas(self) -> int:
        """The ranks whose gradients are averaged (those with the same pp, tp): dp * cp."""
        return self.dp * self.cp

    def replica_group(self, rank: int) -> tuple[int, ...]:
        """The ranks with `rank`'s pp and tp coordinates (every dp, cp), ascending."""
        c = self.coords(rank)
        return tuple(sorted(self.rank_of(d, c["pp"], c["tp"], k) for d in range(self.dp) for k in range(self.cp)))

    def ep_rank(self, rank: int) -> int:
        return self.coords(rank)["dp"] % self.ep

    def ep_group(self, rank: int) -> tuple[int, ...]:
        """The ranks that exchange tokens with `rank` (its all-to-all group), by expert rank."""
        c = self.coords(rank)
        base = c["dp"] - c["dp"] % self.ep
        return tuple(self.rank_of(base + i, c["pp"], c["tp"], c["cp"]) for i in range(self.ep))

    def expert_replicas(self, rank: int) -> tuple[int, ...]:
        """The ranks holding the same experts as `rank` (its expert-gradient sum), by dp."""
        c = self.coords(rank)
        return tuple(self.rank_of(d, c["pp"], c["tp"], c["cp"]) for d in range(c["dp"] % self.ep, self.dp, self.ep))

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.dp, self.cp, self.pp, self.tp)

    def coords(self, rank: int) -> dict[str, int]:
        """rank -> {"dp": i, "cp": c, "pp": j, "tp": k} for the (dp, cp, pp, tp) row-major layout."""
        assert 0 <= rank < self.world
        return {"dp": rank // (self.cp * self.pp * self.tp), "cp": (rank // (self.pp * self.tp)) % self.cp,
                "pp": (rank // self.tp) % self.pp, "tp": rank % self.tp}

    def rank_of(self, dp: int, pp: int, tp: int, cp: int = 0) -> int:
        return ((dp * self.cp + cp) * self.pp + pp) * self.tp + tp

    def group(self, dim: str, rank: int) -> tuple[int, ...]:
        """The ranks that share every coordinate of `rank` except `dim`, ordered by that dim."""
        c = self.coords(rank)
        size = {"dp": self.dp, "cp": self.cp, "pp": self.pp, "tp": self.tp}[dim]
        return tuple(self.rank_of(**{**c, dim: i}) for i in range(size))

    def groups(self, dim: str) -> tuple[tuple[int, ...], ...]:
        seen: dict[tuple[int, ...], None] = {}
        for r in range(self.world):
            seen.setdefault(self.group(dim, r), None)
        return tuple(seen)


@attrs.frozen
class StageAssignment:
    stage: int  # virtual stage in model order
    rank: int  # pipeline rank that holds it
    chunk: int  # which of the rank's model chunks (0-based, in model order)
    block_start: int
    block_stop: int  # exclusive
    first: tuple[str, ...]  # modules before the blocks (non-empty on stage 0 only)
    last: tuple[str, ...]  # modules after the blocks (non-empty on the last stage only)
    # modules every stage holds (the own forward's, dsl/own_layout.py: DeBERTa-v2's rel_embeddings),
    # their gradients summed over the pipeline ranks like a tied embedding's
    shared: tuple[str, ...] = ()

    @property
    def num_blocks(self) -> int:
        return self.block_stop - self.block_start


@attrs.frozen
class TpReplacement:
    path: str  # concrete module path, e.g. "transformer.h.3.attn.c_attn"
    style: str  # "column" | "row" | "vocab" | "replicate"
    fused: int = 1  # column: number of fused parts along the output (3 for q|k|v)
    gather_output: bool = False  # column: all-gather the output
    pad_to: int | None = None  # vocab / column head: pad rows to a multiple of this
    # column divided part by part (dsl/kv_parts.py: the own forward's, Falcon's multi-query): (width,
    # heads) per part of its output, heads 0 where the part divides over tp, else its kv heads, replicated
    kv_parts: tuple[tuple[int, int], ...] = ()


@attrs.frozen
class ModelRef:
    kind: str  # "hf" | "hf_pretrained" | "python"
    target: str  # HF class name, local directory, or "pkg.module:callable"
    config: tuple[tuple[str, Any], ...]  # sorted (key, value) pairs of plain JSON values (lists as tuples)
    family: str  # a registered family's name (core/families/): which torch half runs it
    # canonical dims resolved by check (config.json, then the spec's config, over the HF class's
    # defaults): vocab, labels, hidden, ... as sorted (name, int) pairs
    dims: tuple[tuple[str, int], ...] = ()
    # train.packing = documents on a model whose mask builders do not read the position ids (check's
    # probe, dsl/packing_probe.py): its masks are built with ppdsl's document masks
    # (core/document_masks.py), on the stages and in the single-process reference alike
    document_masks: bool = False
    # what check learned of the built model, so that a worker never builds one to learn it (None:
    # lowered without the model, a plan the runtime refuses): the width of the hidden state the
    # blocks pass on, and the names of each tensor the model holds under several names (canonical
    # first, in the model's parameter order)
    hidden: int | None = None
    tied: tuple[tuple[str, ...], ...] | None = None
    # what the labels are and the loss on the last stage's output, one of ppdsl.core.task_loss.TASKS:
    # causal_lm, seq2seq_lm, sequence_classification, image_classification
    task: str = "causal_lm"

    @property
    def config_dict(self) -> dict[str, Any]:
        return dict(self.config)

    @property
    def dims_dict(self) -> dict[str, int]:
        return dict(self.dims)


@attrs.frozen
class OwnForward:
    """How the stages run the model's own forward (family "own", core/families/own/): what the
    meta trace of check found (dsl/own_layout.py), for the runtime, which never traces."""

    block_output: str = "tensor"  # "tensor" | "tuple": what a block returns (the hidden state first)
    tuple_len: int = 1  # a tuple's length (DeBERTa's blocks return (hidden, attention weights))
    # what the forward takes (ppdsl.core.model_inputs): "tokens" (input_ids of train.seq_len) or
    # "pixels" (pixel_values of input_shape = (C, H, W) per sample; train.seq_len is then the
    # positions the blocks see, as check's trace measured them: the activation's length)
    inputs: str = "tokens"
    input_shape: tuple[int, ...] = ()
    width: int = 0  # the hidden state's features entering the first block, as traced (0: the config's hidden size)
    # a model fed images: per block, the plain values it returns, (index, value), as traced (Swinv2's
    # output dimensions): what a block another stage holds returns in their place
    block_plain: tuple[tuple[tuple[int, Any], ...], ...] = ()

    @property
    def block_outputs(self) -> int:
        """0: a block returns a tensor; n: a tuple of n."""
        return self.tuple_len if self.block_output == "tuple" else 0


@attrs.frozen
class LocalHeads:
    """A module of the blocks whose heads become local under tp (the own forward's generic rule,
    `ppdsl.core.own_tp.localize_generic`), as check's proof at one rank's local shapes set it:
    each attribute the forward reads (head count, width) with its whole and its local value, and
    whether the module takes per-head inputs built before the blocks, which each rank slices to
    its heads (`slice_per_head_inputs`)."""

    path: str  # the module's whole-model path
    attributes: tuple[tuple[str, int, int], ...]  # (name, whole, local)
    per_head_inputs: bool = False


@attrs.frozen
class BoundaryTensor:
    """One tensor a stage sends to the next, per microbatch (its gradient comes back the same shape)."""

    name: str  # "hidden": the hidden state the blocks pass on; "carried": another entry of the last block's output
    shape: tuple[int, ...]  # as this rank sends it: (microbatch, ...), sequence parallelism's share of the sequence
    output: int = 0  # its index in the sending stage's last block's output (0: the hidden state)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@attrs.frozen
class Boundary:
    """What crosses the boundary between virtual stage ``stage`` and ``stage + 1``, as check's meta
    trace measured it (dsl/own_layout.py): the runtime's send and receive buffers take these
    shapes, never re-deriving them. A tuple, so that a boundary can carry more than one tensor."""

    stage: int  # the sending virtual stage
    tensors: tuple[BoundaryTensor, ...]

    @property
    def numel(self) -> int:
        return sum(t.numel for t in self.tensors)


@attrs.frozen
class ExpertModule:
    path: str  # a MoE layer's experts module (ppdsl.core.experts), e.g. "model.layers.3.mlp.experts"
    experts: int  # experts it holds in the whole model; each ep rank holds experts / ep of them


@attrs.frozen
class OptimizerPlan:
    name: str  # "adamw" | "adam" | "sgd"
    lr: float
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    momentum: float = 0.0


@attrs.frozen
class LrSchedulePlan:
    name: str  # "constant" | "cosine" | "linear"
    warmup: int = 0
    min_lr: float = 0.0


@attrs.frozen
class DataPlan:
    kind: str  # "synthetic" | ...
    options: tuple[tuple[str, Any], ...] = ()

    @property
    def options_dict(self) -> dict[str, Any]:
        return dict(self.options)


@attrs.frozen
class CheckpointPlan:
    dir: str
    every: int  # steps; 0 = only at the end


@attrs.frozen
class EvalPlan:
    data: DataPlan  # the held-out data (the same global batch and microbatches as training)
    every: int  # steps between evaluations; 0 = only at the end (there is always one at the end)
    batches: int  # global batches per evaluation


@attrs.frozen
class TrainPlan:
    global_batch: int
    # the count of microbatches is the schedule's (Plan.schedule.microbatches), held there only
    microbatch_size: int  # per data-parallel replica
    seq_len: int  # tokens per sample; a model fed images: the positions its blocks see (OwnForward.inputs)
    steps: int
    seed: int
    optimizer: OptimizerPlan
    lr_schedule: LrSchedulePlan
    precision: str  # "fp32" | "bf16" | "fp16" (autocast over fp32 weights) | "fp64" (float64 weights)
    grad_clip: float | None
    zero: int
    data: DataPlan
    checkpoint: CheckpointPlan | None
    activation_checkpointing: bool = False
    log_every: int = 1
    save_final: bool = True  # write the trained model to RUN_DIR/final (gathered on rank 0)
    eval: EvalPlan | None = None
    metrics: str = "jsonl"  # "jsonl" | "tensorboard" (event files as well)
    peak_tflops: float | None = None  # one device's peak, for MFU; None: no MFU
    trace: bool = False  # record each rank's actions: RUN_DIR/trace.json, bubbles in metrics.jsonl
    # zero = 3: each block frees its all-gathered weights after its forward and again after its
    # backward, every microbatch (FSDP2's reshard_after_forward); False: whole from the first forward
    # until the once-per-step gradient reduce-scatter
    reshard_after_forward: bool = False
    hang_timeout: float | None = 60.0  # seconds without progress before the watchdog (runtime.run.watchdog) ends the job; None: off
    # a step whose loss or some gradient is inf/nan (every rank decides alike): "skip" its update
    # (parameters, optimizer state untouched; the LR schedule moves on) and stop after
    # `max_nonfinite` such steps in a row, or "stop" at the first
    on_nonfinite: str = "skip"
    max_nonfinite: int = 10
    compile: bool = False  # each block of each stage through torch.compile (runtime.parallel.parallelize.apply_compile)


@attrs.frozen
class PredictedStep:
    """What the measured cost profile (`pipeline.profile`) predicts for this plan (lowering/costs.py):
    for the reader (ppdsl plan, ppdsl schedule); the runtime does not use it."""

    profile: str  # the profile's path
    step_s: float  # pipeline + data-parallel gradient sync + optimizer step (+ calibrated overhead)
    pipeline_s: float  # the simulated schedule's makespan under the measured F / B / W costs
    bubble: float  # of that simulation
    stage_s: tuple[float, ...]  # F + B + W seconds per virtual stage and microbatch
    # the zero-bubble order was built on the measured costs (it simulated faster than the unit-cost one)
    cost_ordered: bool = False

    def lines(self) -> list[str]:
        """As ppdsl plan and ppdsl schedule print it."""
        stages = ", ".join(f"{s}: {sec * 1e3:.2f} ms" for s, sec in enumerate(self.stage_s))
        order = "; actions ordered on the measured costs" if self.cost_ordered else ""
        return [f"predicted step {self.step_s * 1e3:.1f} ms from the measured profile {self.profile} "
                f"(pipeline {self.pipeline_s * 1e3:.1f} ms, bubble {self.bubble:.4f} under the measured costs{order})",
                f"F + B + W per microbatch and virtual stage: {stages}"]

    def to_json(self) -> dict[str, Any]:
        return _to_jsonable(self)


@attrs.frozen
class PredictedMemory:
    """Each pipeline rank's memory at the step's peak as lowering predicts it
    (`lowering.rank_memory`, the figures `ppdsl plan` prints and check proves): carried by the
    plan so that `ppdsl run --memory-trace` holds the measurement against it without the spec or
    the model. Bytes, by pipeline coordinate (the ranks of one pipeline coordinate hold the same)."""

    peak: tuple[int, ...]  # weights + gradients + optimizer state + activations
    activations: tuple[int, ...]
    traced: bool  # the activations from check's meta trace (else the 34 * b * s * h formula)

    def of_rank(self, mesh: "MeshLayout", rank: int) -> int:
        """The predicted peak of global rank `rank`."""
        return self.peak[mesh.coords(rank)["pp"]]

    @property
    def largest(self) -> int:
        return max(self.peak)


@attrs.frozen
class Plan:
    spec_file: str
    model: ModelRef
    mesh: MeshLayout
    blocks: str  # module path of the repeated block list, e.g. "transformer.h"
    num_blocks: int
    stages: tuple[StageAssignment, ...]  # one per virtual stage, in model order
    tp: tuple[TpReplacement, ...]
    sequence_parallel: bool
    schedule: Schedule
    train: TrainPlan
    predicted: PredictedStep | None = None  # with pipeline.profile
    own_forward: OwnForward | None = None  # family "own": the stages run the model's own forward
    # mesh.ep > 1: the experts modules divided over the ep ranks (dropless: every routed token
    # reaches its expert, there is no capacity factor)
    experts: tuple[ExpertModule, ...] = ()
    # mesh.cp > 1: the attention modules (their path in the whole model) whose attention sees the
    # whole sequence's keys and values (all-gathered over cp), as check's meta probe found them
    context_attention: tuple[str, ...] = ()
    # tp > 1 under the own forward: the modules (whole-model paths) whose own parameters see only
    # this rank's share of a split column's output (Qwen3's per-head q / k norms), as check's
    # dataflow found them: their gradients are partial sums over tp (lowering/tp_partial.py)
    tp_partial: tuple[str, ...] = ()
    # tp > 1 under the own forward: the modules whose heads become local, and how (check's proof
    # at local shapes); None elsewhere, and in a plan from before ppdsl recorded them (the runtime
    # refuses that one)
    tp_local_heads: tuple[LocalHeads, ...] | None = None
    # each pipeline rank's predicted peak (lowering.rank_memory); None without the model
    memory: PredictedMemory | None = None
    # one per virtual stage but the last (lowering/boundaries.py): the own forward's, as traced;
    # empty for a family's model, whose every boundary is (microbatch, seq, hidden)
    boundaries: tuple[Boundary, ...] = ()

    def boundary(self, stage: int) -> Boundary | None:
        """What stage ``stage`` sends to stage ``stage + 1``; None where the plan records none."""
        return self.boundaries[stage] if stage < len(self.boundaries) else None

    def stages_of(self, pp_rank: int) -> tuple[StageAssignment, ...]:
        return tuple(s for s in self.stages if s.rank == pp_rank)

    @property
    def replica_batch(self) -> int:
        """Samples per data-parallel replica and step: microbatch_size x the schedule's microbatches."""
        return self.train.microbatch_size * self.schedule.microbatches

    def to_json(self) -> dict[str, Any]:
        return _to_jsonable(self)

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2, sort_keys=False)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "Plan":
        return _from_jsonable(cls, data)


def _to_jsonable(obj: Any) -> Any:
    if attrs.has(type(obj)):
        return {f.name: _to_jsonable(getattr(obj, f.name)) for f in attrs.fields(type(obj))}
    if isinstance(obj, Op):
        return obj.value
    if isinstance(obj, (tuple, list)):
        return [_to_jsonable(x) for x in obj]
    return obj


def _from_jsonable(cls: Any, data: Any) -> Any:
    import typing

    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in attrs.fields(cls):
        if f.name not in data:
            continue
        kwargs[f.name] = _convert(hints[f.name], data[f.name])
    return cls(**kwargs)


def _convert(tp: Any, value: Any) -> Any:
    import typing

    if value is None:
        return None
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Union or (origin is not None and str(origin) == "<class 'types.UnionType'>"):
        non_none = [a for a in args if a is not type(None)]
        return _convert(non_none[0], value) if len(non_none) == 1 else value
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(args[0], v) for v in value)
        if args:
            return tuple(_convert(a, v) for a, v in zip(args, value))
        return tuple(value)
    if tp is Op:
        return Op(value)
    if isinstance(tp, type) and attrs.has(tp):
        return _from_jsonable(tp, value)
    if tp is Any:
        return _frozen(value)
    return value


def _frozen(value: Any) -> Any:
    """A plain JSON value as the plan holds it: lists (JSON arrays, at any depth) as tuples, the
    way lowering stores list-valued config entries (``architectures = [...]``), so the loaded
    plan equals the lowered one and stays hashable; a nested config block (a JSON object) as a
    FrozenDict."""
    return frozen(value)


assert Action  # re-exported for the runtime: plan.schedule.ranks hold Actions
