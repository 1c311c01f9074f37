"""Hand-built plans and small models for the stage-builder tests (no lowering needed).

`make_plan(family, pp, chunks, ...)` builds a Plan for one of four tiny models (8 blocks,
hidden 64, 4 heads; Llama with 2 kv heads), cut evenly into pp * chunks virtual stages placed
in a loop (stage s on rank s % pp) or a V (rank r holds r and 2pp-1-r).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ppdsl.lowering.plan import (
    DataPlan,
    LrSchedulePlan,
    MeshLayout,
    ModelRef,
    OptimizerPlan,
    Plan,
    StageAssignment,
    TpReplacement,
    TrainPlan,
)
from ppdsl.core.schedules.ir import Schedule
from ppdsl.runtime.stage import MicroBatch

FAMILIES = ("gpt2", "bert", "llama", "generic")
SEQ_LEN = 16
MICROBATCH = 2
N_BLOCKS = 8

MODELS: dict[str, dict[str, Any]] = {
    "gpt2": dict(
        kind="hf",
        target="GPT2LMHeadModel",
        config=dict(n_layer=N_BLOCKS, n_embd=64, n_head=4, vocab_size=130, n_positions=32,
                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager"),
        blocks="transformer.h",
        first=("transformer.wte", "transformer.wpe"),
        last=("transformer.ln_f", "lm_head"),
    ),
    "bert": dict(
        kind="hf",
        target="BertForSequenceClassification",
        config=dict(num_hidden_layers=N_BLOCKS, hidden_size=64, num_attention_heads=4, intermediate_size=128,
                    vocab_size=130, max_position_embeddings=32, num_labels=4, hidden_dropout_prob=0.0,
                    attention_probs_dropout_prob=0.0, attn_implementation="eager"),
        blocks="bert.encoder.layer",
        first=("bert.embeddings",),
        last=("bert.pooler", "classifier"),
    ),
    "llama": dict(
        kind="hf",
        target="LlamaForCausalLM",
        config=dict(num_hidden_layers=N_BLOCKS, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                    intermediate_size=128, vocab_size=128, max_position_embeddings=32, use_cache=False,
                    attn_implementation="eager"),
        blocks="model.layers",
        first=("model.embed_tokens",),
        last=("model.norm", "lm_head"),
    ),
    "generic": dict(
        kind="python",
        target="ppdsl.models.decoder:build_decoder",
        config=dict(vocab_size=128, dim=64, n_layers=N_BLOCKS, n_heads=4, ffn_dim=128, max_seq_len=32),
        blocks="layers",
        first=("tok_embeddings", "pos_embeddings"),
        last=("norm", "output"),
    ),
}

# Megatron-style splits, with the head vocab-parallel (no gather) unless noted.
TP_RULES: dict[str, tuple[tuple[str, str, dict[str, Any]], ...]] = {
    "gpt2": (
        ("transformer.wte", "vocab", dict(pad_to=4)),  # 130 -> 132: exercises padding
        ("transformer.h.{i}.attn.c_attn", "column", dict(fused=3)),
        ("transformer.h.{i}.attn.c_proj", "row", {}),
        ("transformer.h.{i}.mlp.c_fc", "column", {}),
        ("transformer.h.{i}.mlp.c_proj", "row", {}),
        ("lm_head", "column", dict(pad_to=4)),
    ),
    "bert": (
        ("bert.embeddings.word_embeddings", "vocab", {}),
        ("bert.encoder.layer.{i}.attention.self.query", "column", {}),
        ("bert.encoder.layer.{i}.attention.self.key", "column", {}),
        ("bert.encoder.layer.{i}.attention.self.value", "column", {}),
        ("bert.encoder.layer.{i}.attention.output.dense", "row", {}),
        ("bert.encoder.layer.{i}.intermediate.dense", "column", {}),
        ("bert.encoder.layer.{i}.output.dense", "row", {}),
        ("classifier", "column", {}),
    ),
    "llama": (
        ("model.embed_tokens", "vocab", {}),
        ("model.layers.{i}.self_attn.q_proj", "column", {}),
        ("model.layers.{i}.self_attn.k_proj", "column", {}),
        ("model.layers.{i}.self_attn.v_proj", "column", {}),
        ("model.layers.{i}.self_attn.o_proj", "row", {}),
        ("model.layers.{i}.mlp.gate_proj", "column", {}),
        ("model.layers.{i}.mlp.up_proj", "column", {}),
        ("model.layers.{i}.mlp.down_proj", "row", {}),
        ("lm_head", "column", dict(gather_output=True)),
    ),
    "generic": (
        ("tok_embeddings", "vocab", {}),
        ("layers.{i}.attention.wq", "column", {}),
        ("layers.{i}.attention.wk", "column", {}),
        ("layers.{i}.attention.wv", "column", {}),
        ("layers.{i}.attention.wo", "row", {}),
        ("layers.{i}.feed_forward.w1", "column", {}),
        ("layers.{i}.feed_forward.w2", "row", {}),
        ("output", "column", {}),
    ),
}


def model_ref(family: str, **overrides: Any) -> ModelRef:
    m = MODELS[family]
    config = {**m["config"], **overrides}
    return ModelRef(kind=m["kind"], target=m["target"], config=tuple(sorted(config.items())), family=family)


def even_split(n_blocks: int, n_stages: int) -> list[tuple[int, int]]:
    base, extra = divmod(n_blocks, n_stages)
    bounds, start = [], 0
    for s in range(n_stages):
        stop = start + base + (1 if s < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def stage_ranks(pp: int, chunks: int, placement: str) -> list[int]:
    if placement == "v":
        assert chunks == 2
        return [s if s < pp else 2 * pp - 1 - s for s in range(2 * pp)]
    return [s % pp for s in range(pp * chunks)]


def tp_replacements(family: str, n_blocks: int = N_BLOCKS) -> tuple[TpReplacement, ...]:
    out = []
    for pattern, style, kw in TP_RULES[family]:
        paths = [pattern.format(i=i) for i in range(n_blocks)] if "{i}" in pattern else [pattern]
        out.extend(TpReplacement(path=p, style=style, **kw) for p in paths)
    return tuple(out)


def make_plan(
    family: str,
    pp: int,
    chunks: int = 1,
    *,
    tp: int = 1,
    placement: str = "loop",
    ref: ModelRef | None = None,
    tp_rules: Sequence[TpReplacement] | None = None,
    splits: Sequence[tuple[int, int]] | None = None,
) -> Plan:
    m = MODELS[family]
    n_stages = pp * chunks
    ranks = stage_ranks(pp, chunks, placement)
    bounds = list(splits) if splits is not None else even_split(N_BLOCKS, n_stages)
    seen: dict[int, int] = {}
    stages = []
    for s, ((start, stop), rank) in enumerate(zip(bounds, ranks)):
        chunk = seen.get(rank, 0)
        seen[rank] = chunk + 1
        stages.append(StageAssignment(
            stage=s, rank=rank, chunk=chunk, block_start=start, block_stop=stop,
            first=m["first"] if s == 0 else (), last=m["last"] if s == n_stages - 1 else (),
        ))
    microbatches = 4
    schedule = Schedule(style="gpipe", pp=pp, microbatches=microbatches, chunks=chunks, split_backward=False,
                        stage_ranks=tuple(ranks), ranks=tuple(() for _ in range(pp)))
    train = TrainPlan(
        global_batch=MICROBATCH * microbatches, microbatches=microbatches, microbatch_size=MICROBATCH,
        seq_len=SEQ_LEN, steps=1, seed=0, optimizer=OptimizerPlan(name="adamw", lr=1e-3),
        lr_schedule=LrSchedulePlan(name="constant"), precision="fp32", grad_clip=None, zero=0,
        data=DataPlan(kind="synthetic"), checkpoint=None,
    )
    return Plan(
        spec_file="<test>", model=ref or model_ref(family), mesh=MeshLayout(world=pp * tp, dp=1, pp=pp, tp=tp),
        blocks=m["blocks"], num_blocks=N_BLOCKS, stages=tuple(stages),
        tp=tuple(tp_rules) if tp_rules is not None else (tp_replacements(family) if tp > 1 else ()),
        sequence_parallel=False, schedule=schedule, train=train,
    )


def make_microbatch(family: str, seed: int = 0, *, padded: bool = False) -> MicroBatch:
    g = torch.Generator().manual_seed(seed)
    vocab = dict(MODELS[family]["config"]).get("vocab_size", 128)
    ids = torch.randint(0, vocab, (MICROBATCH, SEQ_LEN), generator=g)
    mask = None
    if padded:  # left-pad the second sequence by 3 tokens
        mask = torch.ones(MICROBATCH, SEQ_LEN, dtype=torch.long)
        mask[1, :3] = 0
    if family == "bert":
        labels = torch.randint(0, 4, (MICROBATCH,), generator=g)
        token_types = torch.randint(0, 2, (MICROBATCH, SEQ_LEN), generator=g)
        return MicroBatch(input_ids=ids, labels=labels, attention_mask=mask, token_type_ids=token_types)
    labels = ids.clone()
    labels[0, :2] = -100
    return MicroBatch(input_ids=ids, labels=labels, attention_mask=mask)


def reference_forward(family: str, model: torch.nn.Module, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, loss) of the single-process reference model."""
    if family == "generic":
        from ppdsl.core.families.stage_base import causal_lm_loss

        class _NoTP:
            head_partition = None
            tp_group = None

        logits = model(mb.input_ids)
        return logits, causal_lm_loss(_NoTP(), logits, mb.labels)  # type: ignore[arg-type]
    kwargs: dict[str, Any] = dict(input_ids=mb.input_ids, labels=mb.labels, attention_mask=mb.attention_mask)
    if family == "bert":
        kwargs["token_type_ids"] = mb.token_type_ids
    else:
        kwargs["use_cache"] = False
    out = model(**kwargs)
    return out.logits, out.loss


def chain(stages: Sequence[Any], mb: MicroBatch) -> torch.Tensor:
    """Run stages in model order, passing each output (still attached to the graph) on."""
    x = None
    for stage in sorted(stages, key=lambda s: s.stage):
        x = stage(x, mb)
    return x
