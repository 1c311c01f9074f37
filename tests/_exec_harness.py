"""Helpers for the executor / training equivalence tests: hand-built Plans for tiny models and
the worker that runs them against the single-process reference."""

from __future__ import annotations

from typing import Any

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
from ppdsl.core.schedules import STYLES, generate

SEQ, VOCAB, LAYERS = 16, 128, 8

# family -> (ModelRef kind, target, config, blocks, first, last, tp replacements per block)
_MODELS: dict[str, tuple[str, str, dict[str, Any], str, tuple[str, ...], tuple[str, ...], tuple[tuple[str, str, int], ...]]] = {
    "generic": (
        "python",
        "ppdsl.models.decoder:build_decoder",
        dict(vocab_size=VOCAB, dim=32, n_layers=LAYERS, n_heads=4, max_seq_len=SEQ),
        "layers",
        ("tok_embeddings", "pos_embeddings"),
        ("norm", "output"),
        (
            ("attention.wq", "column", 1),
            ("attention.wk", "column", 1),
            ("attention.wv", "column", 1),
            ("attention.wo", "row", 1),
            ("feed_forward.w1", "column", 1),
            ("feed_forward.w2", "row", 1),
        ),
    ),
    "gpt2": (
        "hf",
        "GPT2LMHeadModel",
        dict(vocab_size=VOCAB, n_embd=32, n_layer=LAYERS, n_head=4, n_positions=SEQ,
             resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
        "transformer.h",
        ("transformer.wte", "transformer.wpe"),
        ("transformer.ln_f", "lm_head"),
        (
            ("attn.c_attn", "column", 3),
            ("attn.c_proj", "row", 1),
            ("mlp.c_fc", "column", 1),
            ("mlp.c_proj", "row", 1),
        ),
    ),
    "llama": (
        "hf",
        "LlamaForCausalLM",
        dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
             tie_word_embeddings=False),
        "model.layers",
        ("model.embed_tokens",),
        ("model.norm", "lm_head"),
        (
            ("self_attn.q_proj", "column", 1),
            ("self_attn.k_proj", "column", 1),
            ("self_attn.v_proj", "column", 1),
            ("self_attn.o_proj", "row", 1),
            ("mlp.gate_proj", "column", 1),
            ("mlp.up_proj", "column", 1),
            ("mlp.down_proj", "row", 1),
        ),
    ),
    "bert": (
        "hf",
        "BertForSequenceClassification",
        dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=4,
             intermediate_size=64, max_position_embeddings=SEQ, num_labels=4,
             hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
        "bert.encoder.layer",
        ("bert.embeddings",),
        ("bert.pooler", "classifier"),
        (
            ("attention.self.query", "column", 1),
            ("attention.self.key", "column", 1),
            ("attention.self.value", "column", 1),
            ("attention.output.dense", "row", 1),
            ("intermediate.dense", "column", 1),
            ("output.dense", "row", 1),
        ),
    ),
}

FAMILIES = tuple(_MODELS)


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
) -> Plan:
    kind, target, config, blocks, first, last, per_block = _MODELS[family]
    config = dict(config)
    for key in ("n_layers", "n_layer", "num_hidden_layers"):
        if key in config:
            config[key] = num_layers
    chunks = chunks_for(style)
    schedule = generate(style, pp, microbatches, chunks)
    n_stages = pp * chunks
    assert num_layers % n_stages == 0, (num_layers, n_stages)
    per = num_layers // n_stages
    stages = tuple(
        StageAssignment(
            stage=s,
            rank=schedule.stage_ranks[s],
            chunk=schedule.stages_of(schedule.stage_ranks[s]).index(s),
            block_start=s * per,
            block_stop=(s + 1) * per,
            first=first if s == 0 else (),
            last=last if s == n_stages - 1 else (),
        )
        for s in range(n_stages)
    )
    tp_repl = tuple(
        TpReplacement(path=f"{blocks}.{i}.{sub}", style=st, fused=fused)
        for i in range(num_layers)
        for sub, st, fused in per_block
    )
    world = dp * pp * tp
    train = TrainPlan(
        global_batch=microbatch_size * microbatches * dp,
        microbatches=microbatches,
        microbatch_size=microbatch_size,
        seq_len=SEQ,
        steps=steps,
        seed=seed,
        optimizer=OptimizerPlan(name=optimizer, lr=lr, weight_decay=0.01 if optimizer != "sgd" else 0.0,
                                momentum=0.9 if optimizer == "sgd" else 0.0),
        lr_schedule=LrSchedulePlan(name=lr_schedule, warmup=1 if lr_schedule != "constant" else 0),
        precision=precision,
        grad_clip=grad_clip,
        zero=zero,
        data=DataPlan(kind="synthetic", options=(("seed", seed),)),
        checkpoint=None,
    )
    return Plan(
        spec_file="<test>",
        model=ModelRef(kind=kind, target=target, config=tuple(sorted(config.items())), family=family),
        mesh=MeshLayout(world=world, dp=dp, pp=pp, tp=tp),
        blocks=blocks,
        num_blocks=num_layers,
        stages=stages,
        tp=tp_repl,
        sequence_parallel=False,
        schedule=schedule,
        train=train,
    )


def equivalence_worker(rank: int, world: int, cases: list[dict[str, Any]]) -> list[Any]:
    """Run each case (make_plan keyword arguments) in this world for plan.train.steps steps;
    rank 0 returns the VerifyReports (with the seconds each case took), the others Nones."""
    import time

    from ppdsl.runtime.groups import build_process_groups, tie_pp_ranks_of
    from ppdsl.runtime.train import default_stage_api
    from ppdsl.runtime.verify import verify_in_process

    api = default_stage_api()
    reports = []
    for case in cases:
        start = time.perf_counter()
        plan = make_plan(**case)
        assert plan.mesh.world == world, (case, world)
        groups = build_process_groups(plan.mesh, "cpu", tie_pp_ranks_of(plan.schedule.stage_ranks))
        report = verify_in_process(plan, groups, torch.device("cpu"), api, plan.train.steps)
        reports.append((report, time.perf_counter() - start))
    return reports


def case_id(case: dict[str, Any]) -> str:
    keys = ("family", "style", "dp", "pp", "tp", "optimizer", "precision", "zero", "grad_clip", "steps")
    named = ("dp", "pp", "tp", "zero", "grad_clip")
    return "-".join(f"{k}{case[k]}" if k in named else str(case[k]) for k in keys if k in case)


def executor_checks_worker(rank: int, world: int) -> dict[str, Any]:
    """Executor behaviour beyond equivalence, on world 2 (pp = 2). Returns named results."""
    import torch.distributed as dist

    from ppdsl.runtime.executor import sum_losses
    from ppdsl.runtime.groups import build_process_groups, tie_pp_ranks_of
    from ppdsl.runtime.train import Trainer, default_stage_api
    from ppdsl.runtime.verify import _gather_to_rank0, reference_run, verify_in_process

    api = default_stage_api()
    out: dict[str, Any] = {}

    # groups: coordinates, peers and the tie group of a pp = 2 mesh
    plan = make_plan("gpt2", "1f1b", pp=2, microbatches=4, num_layers=4, steps=1)
    groups = build_process_groups(plan.mesh, "cpu", tie_pp_ranks_of(plan.schedule.stage_ranks))
    out["coords"] = groups.coords
    out["peers"] = [groups.pp_peer(p) for p in range(2)]
    out["tie_size"] = None if groups.tie is None else dist.get_world_size(groups.tie)

    # evaluation: forward only, equals the reference's mean loss bit for bit
    trainer = Trainer(plan, groups, torch.device("cpu"), api)
    out["eval"] = trainer.evaluate(0)
    # the executor refuses a wrong number of microbatches
    try:
        trainer.executor.train_step(trainer.data.microbatches(0, 0, "cpu", api.microbatch)[:3])
        out["wrong_count"] = "accepted"
    except ValueError as exc:
        out["wrong_count"] = str(exc)
    # the same step with receives posted 1 or 3 actions ahead: identical losses and gradients
    for style in ("interleaved", "zbv"):
        p = make_plan("generic", style, pp=2, microbatches=4, num_layers=4, steps=1)
        g = build_process_groups(p.mesh, "cpu", tie_pp_ranks_of(p.schedule.stage_ranks))
        runs = []
        for lookahead in (1, 3):
            t = Trainer(p, g, torch.device("cpu"), api, lookahead=lookahead)
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
        out["untied"] = verify_in_process(plan, groups, torch.device("cpu"), api, 1)
    finally:
        Trainer.sync_gradients = original  # type: ignore[method-assign]
    if rank == 0:
        from ppdsl.runtime.data import make_data

        model = api.build_reference_model(plan.model, torch.device("cpu"), plan.train.seed)
        with torch.no_grad():
            losses = [api.reference_loss(model, mb) for mb in make_data(plan).microbatches(0, 0, "cpu", api.microbatch)]
        out["eval_reference"] = float(sum_losses(losses) / plan.train.microbatches)
        out["reference_first_loss"] = reference_run(plan, api, 1).losses[0]
    return out


def plan_equivalence_worker(rank: int, world: int, plans: list[Plan]) -> list[Any]:
    """`equivalence_worker` for ready plans (lowered from spec text by the caller)."""
    import time

    from ppdsl.runtime.groups import build_process_groups, tie_pp_ranks_of
    from ppdsl.runtime.train import default_stage_api
    from ppdsl.runtime.verify import verify_in_process

    api = default_stage_api()
    reports = []
    for plan in plans:
        start = time.perf_counter()
        assert plan.mesh.world == world, (plan.mesh, world)
        groups = build_process_groups(plan.mesh, "cpu", tie_pp_ranks_of(plan.schedule.stage_ranks))
        report = verify_in_process(plan, groups, torch.device("cpu"), api, plan.train.steps)
        reports.append((report, time.perf_counter() - start))
    return reports
