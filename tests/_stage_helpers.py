"""Plans and small models for the stage-builder tests, lowered from spec text.

`make_plan(family, pp, chunks, ...)` lowers a spec of one of four tiny models (8 blocks, hidden
64, 4 heads; Llama with 2 kv heads), cut evenly into pp * chunks virtual stages placed in a loop
(stage s on rank s % pp) or a V (rank r holds r and 2pp-1-r). The stage builder reads the
stages, their placement and the splits, not the schedule's actions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from _front_end import config_entries, lower_text, pretrained_source
from ppdsl.lowering.plan import Plan
from ppdsl.runtime.stage.build import MicroBatch

FAMILIES = ("gpt2", "bert", "llama", "generic")
SEQ_LEN = 16
MICROBATCH = 2
MICROBATCHES = 4
N_BLOCKS = 8

# family -> its model source, config, and Megatron-style splits (the head vocab-parallel, no
# gather, unless noted); blocks, first and last are the family's (docs/language.md#families)
MODELS: dict[str, dict[str, Any]] = {
    "gpt2": dict(
        source='hf("GPT2LMHeadModel")',
        config=dict(n_layer=N_BLOCKS, n_embd=64, n_head=4, vocab_size=130, n_positions=32,
                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager"),
        splits=(
            "transformer.wte : vocab",
            "transformer.h[*].attn.c_attn : column(fused = 3)",
            "transformer.h[*].attn.c_proj : row",
            "transformer.h[*].mlp.c_fc : column",
            "transformer.h[*].mlp.c_proj : row",
            "lm_head : column",
        ),
    ),
    "bert": dict(
        source='hf("BertForSequenceClassification")',
        config=dict(num_hidden_layers=N_BLOCKS, hidden_size=64, num_attention_heads=4, intermediate_size=128,
                    vocab_size=130, max_position_embeddings=32, num_labels=4, hidden_dropout_prob=0.0,
                    attention_probs_dropout_prob=0.0, attn_implementation="eager"),
        splits=(
            "bert.embeddings.word_embeddings : vocab(pad_to = 4)",  # 130 -> 132: exercises padding
            "bert.encoder.layer[*].attention.self.query : column",
            "bert.encoder.layer[*].attention.self.key : column",
            "bert.encoder.layer[*].attention.self.value : column",
            "bert.encoder.layer[*].attention.output.dense : row",
            "bert.encoder.layer[*].intermediate.dense : column",
            "bert.encoder.layer[*].output.dense : row",
            "classifier : column",
        ),
    ),
    "llama": dict(
        source='hf("LlamaForCausalLM")',
        config=dict(num_hidden_layers=N_BLOCKS, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                    intermediate_size=128, vocab_size=128, max_position_embeddings=32, use_cache=False,
                    attn_implementation="eager"),
        splits=(
            "model.embed_tokens : vocab",
            "model.layers[*].self_attn.q_proj : column",
            "model.layers[*].self_attn.k_proj : column",
            "model.layers[*].self_attn.v_proj : column",
            "model.layers[*].self_attn.o_proj : row",
            "model.layers[*].mlp.gate_proj : column",
            "model.layers[*].mlp.up_proj : column",
            "model.layers[*].mlp.down_proj : row",
            "lm_head : column(gather_output = true)",
        ),
    ),
    "generic": dict(
        source='python("ppdsl.models.decoder:build_decoder")',
        config=dict(vocab_size=128, dim=64, n_layers=N_BLOCKS, n_heads=4, ffn_dim=128, max_seq_len=32),
        splits=(
            "tok_embeddings : vocab",
            "layers[*].attention.wq : column",
            "layers[*].attention.wk : column",
            "layers[*].attention.wv : column",
            "layers[*].attention.wo : row",
            "layers[*].feed_forward.w1 : column",
            "layers[*].feed_forward.w2 : row",
            "output : column",
        ),
    ),
}


def _style(chunks: int, placement: str) -> str:
    """A schedule style with this placement: each style has one (docs/schedules.md)."""
    if placement == "v":
        assert chunks == 2, "a V holds two chunks per rank"
        return "zbv"
    return "gpipe" if chunks == 1 else "interleaved"


def make_plan(
    family: str,
    pp: int,
    chunks: int = 1,
    *,
    tp: int = 1,
    placement: str = "loop",
    config: Mapping[str, Any] | None = None,
    pretrained: str | Path | None = None,
) -> Plan:
    """`config`: model config values over the family's; `pretrained`: a checkpoint directory the
    weights are read from (``hf_pretrained``), instead of the family's class built afresh."""
    m = MODELS[family]
    source = m["source"] if pretrained is None else pretrained_source(pretrained)
    splits = "\n".join(f"  {rule}" for rule in m["splits"])
    text = f"""ppspec 1
model {family} {{
  source = {source}
  config {{ {config_entries({**m["config"], **(config or {})})} }}
}}
mesh {{ tp = {tp}, pp = {pp}, dp = 1 }}
tensor_parallel {{
{splits}
}}
pipeline {{ style = {_style(chunks, placement)}, chunks = {chunks}, microbatches = {MICROBATCHES} }}
train {{
  global_batch = {MICROBATCH * MICROBATCHES}
  seq_len = {SEQ_LEN}
  steps = 1
  optimizer = adamw(lr = 1e-3, weight_decay = 0.0)
}}
"""
    return lower_text(text, pp * tp)


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
        from ppdsl.runtime.stage.adapters.base import causal_lm_loss

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
