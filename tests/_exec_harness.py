"""Helpers for the executor / training equivalence tests: plans of tiny models, lowered from
spec text (make_plan), and the workers that run them against the single-process reference."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from _front_end import config_entries, lower_text, pretrained_source
from ppdsl.lowering.plan import Plan
from ppdsl.core.schedules import STYLES

SEQ, VOCAB, LAYERS = 16, 128, 8

# family -> (model source, config, its layer-count key, the Megatron splits inside a block);
# blocks, first and last are the family's (docs/language.md#families); embeddings and head
# stay whole on every tp rank
_MODELS: dict[str, tuple[str, dict[str, Any], str, tuple[str, ...]]] = {
    "generic": (
        'python("ppdsl.models.decoder:build_decoder")',
        dict(vocab_size=VOCAB, dim=32, n_layers=LAYERS, n_heads=4, max_seq_len=SEQ),
        "n_layers",
        (
            "layers[*].attention.wq : column",
            "layers[*].attention.wk : column",
            "layers[*].attention.wv : column",
            "layers[*].attention.wo : row",
            "layers[*].feed_forward.w1 : column",
            "layers[*].feed_forward.w2 : row",
        ),
    ),
    "gpt2": (
        'hf("GPT2LMHeadModel")',
        dict(vocab_size=VOCAB, n_embd=32, n_layer=LAYERS, n_head=4, n_positions=SEQ,
             resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
        "n_layer",
        (
            "transformer.h[*].attn.c_attn : column(fused = 3)",
            "transformer.h[*].attn.c_proj : row",
            "transformer.h[*].mlp.c_fc : column",
            "transformer.h[*].mlp.c_proj : row",
        ),
    ),
    "llama": (
        'hf("LlamaForCausalLM")',
        dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
             tie_word_embeddings=False),
        "num_hidden_layers",
        (
            "model.layers[*].self_attn.q_proj : column",
            "model.layers[*].self_attn.k_proj : column",
            "model.layers[*].self_attn.v_proj : column",
            "model.layers[*].self_attn.o_proj : row",
            "model.layers[*].mlp.gate_proj : column",
            "model.layers[*].mlp.up_proj : column",
            "model.layers[*].mlp.down_proj : row",
        ),
    ),
    "bert": (
        'hf("BertForSequenceClassification")',
        dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=4,
             intermediate_size=64, max_position_embeddings=SEQ, num_labels=4,
             hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
        "num_hidden_layers",
        (
            "bert.encoder.layer[*].attention.self.query : column",
            "bert.encoder.layer[*].attention.self.key : column",
            "bert.encoder.layer[*].attention.self.value : column",
            "bert.encoder.layer[*].attention.output.dense : row",
            "bert.encoder.layer[*].intermediate.dense : column",
            "bert.encoder.layer[*].output.dense : row",
        ),
    ),
}

FAMILIES = tuple(_MODELS)

_OPTIMIZERS = {  # the optimizer's call, given lr
    "adamw": "adamw(lr = {lr!r}, weight_decay = 0.01)",
    "adam": "adam(lr = {lr!r}, weight_decay = 0.01)",
    "sgd": "sgd(lr = {lr!r}, momentum = 0.9)",
}


def chunks_for(style: str) -> int:
    return 1 if STYLES[style].chunks == "== 1" else 2


def make_plan(
    family: str,
    style: str,
    pp: int,
    tp: int = 1,
    dp: int = 1,
    microbatches: int = 8,
    microbatch_size: int = 1,
    steps: int = 2,
    optimizer: str = "adamw",
    lr: float = 1e-3,
    grad_clip: float | None = 1.0,
    precision: str = "fp32",
    lr_schedule: str = "constant",
    seed: int = 0,
    num_layers: int = LAYERS,
    zero: int = 0,
    *,
    activation_checkpointing: bool = False,
    sequence_parallel: bool = False,
    reshard_after_forward: bool = False,
    config: Mapping[str, Any] | None = None,
    tensor_parallel: Sequence[str] = (),
    train_entries: Sequence[str] = (),
    pretrained: str | Path | None = None,
) -> Plan:
    """The plan of a spec for `family` (num_layers blocks cut evenly into pp * chunks stages, the
    style's chunks, world = dp * pp * tp). `config`: model config values over the family's;
    `tensor_parallel`: split rules after the block splits; `train_entries`: more train entries
    (an eval block, say); `pretrained`: a checkpoint directory the weights are read from
    (``hf_pretrained``), instead of the family's class built afresh."""
    source, family_config, layers_key, block_splits = _MODELS[family]
    if pretrained is not None:
        source = pretrained_source(pretrained)
    model_config = {**family_config, layers_key: num_layers, **(config or {})}
    schedule = "constant" if lr_schedule == "constant" else f"{lr_schedule}(warmup = 1)"
    splits = "\n".join(f"  {rule}" for rule in (*block_splits, *tensor_parallel))
    train = "\n".join(f"  {entry}" for entry in train_entries)
    text = f"""ppspec 1
model {family} {{
  source = {source}
  config {{ {config_entries(model_config)} }}
}}
mesh {{ tp = {tp}, pp = {pp}, dp = {dp} }}
tensor_parallel {{
{splits}
  sequence_parallel = {str(sequence_parallel).lower()}
}}
pipeline {{ style = {style}, chunks = {chunks_for(style)}, microbatches = {microbatches}, microbatch_size = {microbatch_size} }}
train {{
  global_batch = {microbatch_size * microbatches * dp}
  seq_len = {SEQ}
  steps = {steps}
  seed = {seed}
  optimizer = {_OPTIMIZERS[optimizer].format(lr=lr)}
  lr_schedule = {schedule}
  precision = {precision}
  grad_clip = {"none" if grad_clip is None else repr(grad_clip)}
  zero = {zero}
  reshard_after_forward = {str(reshard_after_forward).lower()}
  activation_checkpointing = {str(activation_checkpointing).lower()}
  data = synthetic(seed = {seed})
{train}
}}
"""
    return lower_text(text, dp * pp * tp)


def case_id(case: dict[str, Any]) -> str:
    keys = ("family", "style", "dp", "pp", "tp", "optimizer", "precision", "zero", "grad_clip", "steps")
    named = ("dp", "pp", "tp", "zero", "grad_clip")
    return "-".join(f"{k}{case[k]}" if k in named else str(case[k]) for k in keys if k in case)


def executor_checks_worker(rank: int, world: int) -> dict[str, Any]:
    """Executor behaviour beyond equivalence, on world 2 (pp = 2). Returns named results."""
    import torch.distributed as dist

    from ppdsl.runtime.pipeline.step_loss import sum_losses
    from ppdsl.runtime.parallel.groups import build_process_groups, tie_pp_ranks_of
    from ppdsl.runtime.stage.build import build_reference_model
    from ppdsl.runtime.verify.reference_loss import reference_loss
    from ppdsl.runtime.train.trainer import Trainer
    from ppdsl.runtime.verify.gather import _gather_to_rank0
    from ppdsl.runtime.verify.reference import reference_run
    from ppdsl.runtime.verify.world import verify_in_process

    out: dict[str, Any] = {}

    # groups: coordinates, peers and the tie group of a pp = 2 mesh
    plan = make_plan("gpt2", "1f1b", pp=2, microbatches=4, num_layers=4, steps=1)
    groups = build_process_groups(plan.mesh, "cpu", tie_pp_ranks_of(plan.schedule.stage_ranks))
    out["coords"] = groups.coords
    out["peers"] = [groups.pp_peer(p) for p in range(2)]
    out["tie_size"] = None if groups.tie is None else dist.get_world_size(groups.tie)

    # evaluation: forward only, equals the reference's mean loss bit for bit
    trainer = Trainer(plan, groups, torch.device("cpu"))
    out["eval"] = trainer.evaluate(0)
    # the executor refuses a wrong number of microbatches
    try:
        trainer.executor.train_step(trainer.data.microbatches(0, 0, "cpu")[:3])
        out["wrong_count"] = "accepted"
    except ValueError as exc:
        out["wrong_count"] = str(exc)
    # the same step with receives posted 1 or 3 actions ahead: identical losses and gradients
    for style in ("interleaved", "zbv"):
        p = make_plan("generic", style, pp=2, microbatches=4, num_layers=4, steps=1)
        g = build_process_groups(p.mesh, "cpu", tie_pp_ranks_of(p.schedule.stage_ranks))
        runs = []
        for lookahead in (1, 3):
            t = Trainer(p, g, torch.device("cpu"), lookahead=lookahead)
            reserved = t.executor._pool.allocated
            runs.append((t.forward_backward(0), _gather_to_rank0(t, "grad")))
            t.evaluate(0)
            out[f"buffers-{style}-{lookahead}"] = (reserved, t.executor._pool.allocated)
        if rank == 0:
            (loss1, grads1), (loss3, grads3) = runs
            out[f"lookahead-{style}"] = (
                loss1 == loss3 and grads1.keys() == grads3.keys() and all(torch.equal(grads1[n], grads3[n]) for n in grads1)
            )
    # without the tied-gradient sum GPT-2's wte / lm_head gradients are wrong: verify must say so
    original = Trainer.sync_gradients
    Trainer.sync_gradients = lambda self: None  # type: ignore[method-assign]
    try:
        out["untied"] = verify_in_process(plan, groups, torch.device("cpu"), 1)
    finally:
        Trainer.sync_gradients = original  # type: ignore[method-assign]
    if rank == 0:
        from ppdsl.runtime.data.source import make_data

        model = build_reference_model(plan.model, torch.device("cpu"), plan.train.seed)
        with torch.no_grad():
            losses = [reference_loss(plan, model, mb) for mb in make_data(plan).microbatches(0, 0, "cpu")]
        out["eval_reference"] = float(sum_losses(losses) / plan.schedule.microbatches)
        out["reference_first_loss"] = reference_run(plan, 1).losses[0]
    return out


def equivalence_worker(rank: int, world: int, plans: list[Plan]) -> list[Any]:
    """Run each plan (lowered by the caller: once, not on every rank) in this world for
    plan.train.steps steps; rank 0 returns the VerifyReports (with the seconds each case took),
    the others Nones."""
    import time

    from ppdsl.runtime.parallel.groups import build_process_groups, tie_pp_ranks_of
    from ppdsl.runtime.verify.world import verify_in_process

    reports = []
    for plan in plans:
        start = time.perf_counter()
        assert plan.mesh.world == world, (plan.mesh, world)
        groups = build_process_groups(plan.mesh, "cpu", tie_pp_ranks_of(plan.schedule.stage_ranks))
        report = verify_in_process(plan, groups, torch.device("cpu"), plan.train.steps)
        reports.append((report, time.perf_counter() - start))
    return reports
