"""The resolved spec: names bound, values typed, defaults filled. Still symbolic in `world`.

Numeric keys that may depend on the world size are exact expressions (ppdsl.dsl.exact.Expr, in
the one unknown `world`); everything else is plain
Python data. Every value keeps the span it came from in `Spec.spans` (dotted key -> Span).
"""

from __future__ import annotations

from typing import Any, Mapping

import attrs

from .exact import WORLD, Cond, Expr  # noqa: F401  (WORLD: the world size, imported from here)
from .span import Span


@attrs.frozen
class ModelSource:
    kind: str  # "hf" | "hf_pretrained" | "python"
    target: str


@attrs.frozen
class ModelSpec:
    name: str
    source: ModelSource
    config: Mapping[str, Any]  # the values given in the spec (plain JSON values), over the family's build_config
    family: str  # a registered family's name (core/families/)
    dims: Mapping[str, int]  # canonical dims known without torch: layers, hidden, heads, kv_heads, ffn, vocab, labels
    # the config the model is built with, as far as check knows it: the HF config class's defaults,
    # then config.json (hf_pretrained), then the spec's config
    resolved_config: Mapping[str, Any] = attrs.field(factory=dict)


@attrs.frozen
class MeshSpec:
    tp: Expr
    pp: Expr
    dp: Expr
    # expert parallelism borrows from dp: ep consecutive dp ranks hold one copy of the experts
    ep: Expr = attrs.field(factory=lambda: Expr.const(1))
    # context parallelism: a world factor (world = dp * cp * pp * tp), each sequence split over cp
    cp: Expr = attrs.field(factory=lambda: Expr.const(1))


@attrs.frozen
class PatternIndex:
    kind: str  # "all" | "one" | "range"
    start: int | None = None
    stop: int | None = None


@attrs.frozen
class PatternSegment:
    name: str
    index: PatternIndex | None = None


@attrs.frozen
class TpRule:
    pattern: tuple[PatternSegment, ...]
    text: str
    style: str  # column | row | vocab | replicate
    fused: int = 1
    gather_output: bool = False
    pad_to: int | None = None
    span: Span | None = attrs.field(default=None, eq=False)


@attrs.frozen
class TensorParallelSpec:
    rules: tuple[TpRule, ...]
    sequence_parallel: bool
    # where `hf_plan = true` is written (None: not asked); the own forward's plan is read from the
    # built model (dsl/own_check.py), the families' from their sources when the spec resolves
    hf_plan: Span | None = attrs.field(default=None, eq=False)


@attrs.frozen
class PipelineSpec:
    style: str
    chunks: Expr
    microbatches: Expr  # derived from microbatch_size when only that is given
    microbatch_size: Expr  # per data-parallel replica
    blocks: str
    first: tuple[str, ...]
    last: tuple[str, ...]
    split: tuple[tuple[int, int], ...] | None  # explicit [start, stop) ranges, or None for auto
    balance: str  # "even" | "cost" | "measured"
    profile: str | None = None  # absolute path of a measured cost profile (lowering/costs.py), or None
    # modules every stage holds: not written, inferred for the own forward (dsl/own_layout.py)
    shared: tuple[str, ...] = ()


@attrs.frozen
class OptimizerSpec:
    name: str
    lr: float
    weight_decay: float
    betas: tuple[float, float]
    eps: float
    momentum: float


@attrs.frozen
class LrScheduleSpec:
    name: str
    warmup: int
    min_lr: float


@attrs.frozen
class DataSpec:
    kind: str
    options: Mapping[str, Any]


@attrs.frozen
class CheckpointSpec:
    dir: str
    every: int


@attrs.frozen
class EvalSpec:
    data: DataSpec
    every: int  # steps between evaluations; 0 = only at the end
    batches: int  # global batches per evaluation


@attrs.frozen
class TrainSpec:
    global_batch: Expr
    # tokens per sample; None where not written: a model fed images (its blocks' positions, which
    # check's trace measures, fill it in: dsl/input_check.py), or unknown without the model
    seq_len: int | None
    steps: int
    seed: int
    optimizer: OptimizerSpec
    lr_schedule: LrScheduleSpec
    precision: str
    grad_clip: float | None
    zero: int
    data: DataSpec
    checkpoint: CheckpointSpec | None
    activation_checkpointing: bool
    log_every: int
    save_final: bool = True
    eval: EvalSpec | None = None
    metrics: str = "jsonl"
    peak_tflops: float | None = None
    trace: bool = False
    reshard_after_forward: bool = False  # zero = 3: blocks free their gathered weights after F and B
    hang_timeout: float | None = 60.0  # the hang watchdog's seconds; None: off
    on_nonfinite: str = "skip"  # a step with an inf/nan loss or gradient: "skip" its update or "stop"
    max_nonfinite: int = 10  # skip: stop after this many such steps in a row
    device_memory: int | None = None  # bytes of one accelerator's memory; None: not stated (dsl/sizes.py)
    compile: bool = False  # each block through torch.compile
    # train.packing as written ("windows" | "documents" | "none"), folded into each hf_dataset
    # source's packing option (dsl/resolve/packing.py); None: not written
    packing: str | None = None


@attrs.frozen
class Requirement:
    condition: Cond
    text: str
    message: str | None
    span: Span


@attrs.frozen
class Spec:
    file: str
    model: ModelSpec
    mesh: MeshSpec
    tensor_parallel: TensorParallelSpec
    pipeline: PipelineSpec
    train: TrainSpec
    requires: tuple[Requirement, ...]
    # implicit rules from the spec's own arithmetic: `a / b` must be exact
    exact_divisions: tuple[tuple[Expr, Expr, Span], ...]
    spans: Mapping[str, Span] = attrs.field(eq=False)

    def span(self, key: str) -> Span | None:
        """The span of a dotted key ("mesh.tp"), falling back to its block, then to None."""
        while key:
            if key in self.spans:
                return self.spans[key]
            key = key.rpartition(".")[0]
        return None
