"""The tests' tiny models and the one factory of their plans.

`TINY`: name -> a tiny random config of an HF class (or of the python-factory decoder), the
config key that counts its blocks, its tensor_parallel rules (`blocks`: the Megatron splits
inside a block; `ends`: the embedding's and the head's, kept apart so a caller can take the
block rules only), and its task. One value per config key for every test: hidden 32, vocabulary
128, 8 blocks, 4 heads (2 kv heads where a model has them), 32 positions (a seq_len of 16, with
room for RoBERTa's and OPT's position offsets), dropout 0. A test that needs another value says
so where it passes `config=`.

`tiny_spec(...)` writes the spec text of one of them (`tiny_plan` lowers it through the real
front end, _front_end.lower_text), so every plan a test runs is one a user could write.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import transformers

from _front_end import lower_text, pretrained_source, spec_value
from ppdsl.core.schedules import STYLES
from ppdsl.lowering.plan import Plan

SEQ = 16  # every tiny plan's seq_len unless the call gives one
VOCAB = 128
HIDDEN = 32
LAYERS = 8  # blocks unless the call gives num_layers
POSITIONS = 32


@attrs.frozen
class TinyModel:
    source: str  # the spec's model source
    config: Mapping[str, Any]
    layers: str  # the config key of the block count
    blocks: tuple[str, ...]  # tensor_parallel rules inside the blocks
    ends: tuple[str, ...] = ()  # tensor_parallel rules of the embedding and the head
    task: str = "causal_lm"  # or "classify": labels per sequence, config num_labels of them

    @property
    def hf_class(self) -> str | None:
        """The HF class of an hf("...") source."""
        return self.source[4:-2] if self.source.startswith('hf("') else None


def _rules(prefix: str, *rules: str) -> tuple[str, ...]:
    return tuple(f"{prefix}[*].{rule}" for rule in rules)


_ROTARY = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=POSITIONS, attention_dropout=0.0)
_LLAMA_ATTENTION = _rules("model.layers", "self_attn.q_proj : column", "self_attn.k_proj : column",
                          "self_attn.v_proj : column", "self_attn.o_proj : row")
_LLAMA_BLOCKS = _LLAMA_ATTENTION + _rules("model.layers", "mlp.gate_proj : column", "mlp.up_proj : column",
                                          "mlp.down_proj : row")
_LLAMA_ENDS = ("model.embed_tokens : vocab", "lm_head : column")
_BERT_BLOCK = ("attention.self.query : column", "attention.self.key : column", "attention.self.value : column",
               "attention.output.dense : row", "intermediate.dense : column", "output.dense : row")
_BERT = dict(vocab_size=130,  # not a multiple of tp: the embedding's pad_to = 4 pads it to 132
             hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=4, intermediate_size=2 * HIDDEN,
             max_position_embeddings=POSITIONS, num_labels=4, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
# GPTNeoXForCausalLM's head: `embed_out` until transformers 5, `lm_head` since
_NEOX_HEAD = "lm_head" if int(transformers.__version__.split(".")[0]) >= 5 else "embed_out"


def _llama_like(cls: str, **config: Any) -> TinyModel:
    return TinyModel(f'hf("{cls}")', {**_ROTARY, **config}, "num_hidden_layers", _LLAMA_BLOCKS, _LLAMA_ENDS)


TINY: dict[str, TinyModel] = {
    "generic": TinyModel(
        'python("ppdsl.models.decoder:build_decoder")',
        dict(vocab_size=VOCAB, dim=HIDDEN, n_layers=LAYERS, n_heads=4, max_seq_len=POSITIONS),  # ffn_dim: 4 * dim
        "n_layers",
        _rules("layers", "attention.wq : column", "attention.wk : column", "attention.wv : column",
               "attention.wo : row", "feed_forward.w1 : column", "feed_forward.w2 : row"),
        ("tok_embeddings : vocab", "output : column"),
    ),
    "gpt2": TinyModel(
        'hf("GPT2LMHeadModel")',
        dict(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=4, n_positions=POSITIONS,
             resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
        "n_layer",
        _rules("transformer.h", "attn.c_attn : column(fused = 3)", "attn.c_proj : row", "mlp.c_fc : column",
               "mlp.c_proj : row"),
        ("transformer.wte : vocab", "lm_head : column"),
    ),
    "bert": TinyModel(
        'hf("BertForSequenceClassification")', _BERT, "num_hidden_layers", _rules("bert.encoder.layer", *_BERT_BLOCK),
        ("bert.embeddings.word_embeddings : vocab(pad_to = 4)", "classifier : column"), task="classify",
    ),
    "roberta": TinyModel(
        'hf("RobertaForSequenceClassification")', {**_BERT, "pad_token_id": 1}, "num_hidden_layers",
        _rules("roberta.encoder.layer", *_BERT_BLOCK), task="classify",
    ),
    "llama": _llama_like("LlamaForCausalLM", tie_word_embeddings=False),
    # seq_len 16 > sliding_window 6: the sliding-window mask decides the numbers
    "mistral": _llama_like("MistralForCausalLM", sliding_window=6),
    "qwen2": _llama_like("Qwen2ForCausalLM", use_sliding_window=True, sliding_window=6, max_window_layers=2),
    "qwen3": _llama_like("Qwen3ForCausalLM", head_dim=8, use_sliding_window=True, sliding_window=6,
                         max_window_layers=2),
    "gemma": _llama_like("GemmaForCausalLM", head_dim=8),
    "gemma2": _llama_like("Gemma2ForCausalLM", head_dim=8, query_pre_attn_scalar=8, sliding_window=6),
    "phi3": TinyModel(
        'hf("Phi3ForCausalLM")',
        {**_ROTARY, "num_key_value_heads": 4, "sliding_window": 6, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
         "pad_token_id": 0, "tie_word_embeddings": False},
        "num_hidden_layers",
        _rules("model.layers", "self_attn.qkv_proj : column(fused = 3)", "self_attn.o_proj : row",
               "mlp.gate_up_proj : column(fused = 2)", "mlp.down_proj : row"),
        _LLAMA_ENDS,
    ),
    # experts are 3-d parameters: replicated over tp, only the attention is split
    "mixtral": TinyModel(
        'hf("MixtralForCausalLM")', {**_ROTARY, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 6},
        "num_hidden_layers", _LLAMA_ATTENTION, _LLAMA_ENDS,
    ),
    # query_key_value is interleaved per head: a plain column split gives each rank whole heads
    "gpt_neox": TinyModel(
        'hf("GPTNeoXForCausalLM")',
        dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
             num_attention_heads=4, max_position_embeddings=POSITIONS, hidden_dropout=0.0, attention_dropout=0.0),
        "num_hidden_layers",
        _rules("gpt_neox.layers", "attention.query_key_value : column", "attention.dense : row",
               "mlp.dense_h_to_4h : column", "mlp.dense_4h_to_h : row"),
        ("gpt_neox.embed_in : vocab", f"{_NEOX_HEAD} : column"),
    ),
    "distilbert": TinyModel(
        'hf("DistilBertForSequenceClassification")',
        dict(vocab_size=VOCAB, dim=HIDDEN, hidden_dim=2 * HIDDEN, n_layers=LAYERS, n_heads=4,
             max_position_embeddings=POSITIONS, num_labels=4, dropout=0.0, attention_dropout=0.0,
             seq_classif_dropout=0.0),
        "n_layers",
        _rules("distilbert.transformer.layer", "attention.q_lin : column", "attention.k_lin : column",
               "attention.v_lin : column", "attention.out_lin : row", "ffn.lin1 : column", "ffn.lin2 : row"),
        task="classify",
    ),
    "gptj": TinyModel(
        'hf("GPTJForCausalLM")',
        dict(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=4, n_positions=POSITIONS, rotary_dim=4,
             resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
        "n_layer",
        _rules("transformer.h", "attn.q_proj : column", "attn.k_proj : column", "attn.v_proj : column",
               "attn.out_proj : row", "mlp.fc_in : column", "mlp.fc_out : row"),
        ("transformer.wte : vocab", "lm_head : column"),
    ),
    "opt": TinyModel(
        'hf("OPTForCausalLM")',
        dict(vocab_size=VOCAB, hidden_size=HIDDEN, ffn_dim=2 * HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=4,
             max_position_embeddings=POSITIONS, word_embed_proj_dim=HIDDEN, dropout=0.0, attention_dropout=0.0,
             pad_token_id=1),
        "num_hidden_layers",
        _rules("model.decoder.layers", "self_attn.q_proj : column", "self_attn.k_proj : column",
               "self_attn.v_proj : column", "self_attn.out_proj : row", "fc1 : column", "fc2 : row"),
        ("model.decoder.embed_tokens : vocab", "lm_head : column"),
    ),
    # run whole (context parallelism's cases): no tensor_parallel rules
    "olmo2": TinyModel('hf("Olmo2ForCausalLM")', dict(_ROTARY), "num_hidden_layers", ()),
    "bloom": TinyModel('hf("BloomForCausalLM")',
                       dict(vocab_size=VOCAB, hidden_size=HIDDEN, n_layer=LAYERS, n_head=4, hidden_dropout=0.0,
                            attention_dropout=0.0), "n_layer", ()),
    # multi_query = false: query_key_value grouped per head, split by whole heads
    "falcon": TinyModel(
        'hf("FalconForCausalLM")',
        dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=4,
             max_position_embeddings=POSITIONS, multi_query=False, new_decoder_architecture=False,
             hidden_dropout=0.0, attention_dropout=0.0),
        "num_hidden_layers",
        _rules("transformer.h", "self_attention.query_key_value : column", "self_attention.dense : row",
               "mlp.dense_h_to_4h : column", "mlp.dense_4h_to_h : row"),
        ("transformer.word_embeddings : vocab", "lm_head : column"),
    ),
}

_OPTIMIZERS = {  # the optimizer's call, given lr
    "adamw": "adamw(lr = {lr!r}, weight_decay = 0.01)",
    "adam": "adam(lr = {lr!r}, weight_decay = 0.01)",
    "sgd": "sgd(lr = {lr!r}, momentum = 0.9)",
}


def chunks_for(style: str) -> int:
    """The chunks per pipeline rank of a style: 1 where it takes one, else 2."""
    return 1 if STYLES[style].chunks == "== 1" else 2


def _split_rules(model: TinyModel, splits: str, extra: Sequence[str]) -> list[str]:
    """The tensor_parallel rules: the model's (`splits`: "blocks", "all" = blocks and ends, or
    "none"), then `extra`, a rule of `extra` replacing the model's rule of the same path."""
    own = {"none": (), "blocks": model.blocks, "all": (*model.blocks, *model.ends)}[splits]
    path = lambda rule: rule.split(" : ")[0].strip()  # noqa: E731
    replaced = {path(rule) for rule in extra if " : " in rule}
    return [rule for rule in own if path(rule) not in replaced] + list(extra)


def tiny_spec(
    family: str,
    style: str = "1f1b",
    *,
    pp: int = 1,
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
    seq_len: int = SEQ,
    num_layers: int | None = None,
    zero: int = 0,
    activation_checkpointing: bool = False,
    sequence_parallel: bool = False,
    reshard_after_forward: bool = False,
    config: Mapping[str, Any] | None = None,
    splits: str = "blocks",
    tensor_parallel: Sequence[str] = (),
    train_entries: Sequence[str] = (),
    pretrained: str | Path | None = None,
) -> str:
    """The spec text of the tiny model `family` (TINY): num_layers blocks (the table's 8 unless
    given) cut evenly into pp * chunks stages (the style's chunks), world = dp * pp * tp.

    `config`: config values over the table's; `splits`: which of the model's split rules (the
    blocks' by default); `tensor_parallel`: more rules (`hf_plan = true`, say), one of a path the
    model has replacing its rule; `optimizer`: a name of _OPTIMIZERS (given `lr`) or a whole
    call; `train_entries`: more train entries (an eval block, say); `pretrained`: a checkpoint
    directory the weights are read from (``hf_pretrained``), instead of the class built afresh."""
    model = TINY[family]
    source = model.source if pretrained is None else pretrained_source(pretrained)
    model_config = {**model.config, model.layers: LAYERS if num_layers is None else num_layers, **(config or {})}
    entries = "\n    ".join(f"{k} = {spec_value(v)}" for k, v in model_config.items())
    schedule = "constant" if lr_schedule == "constant" else f"{lr_schedule}(warmup = 1)"
    call = optimizer if "(" in optimizer else _OPTIMIZERS[optimizer].format(lr=lr)
    rules = "\n".join(f"  {rule}" for rule in _split_rules(model, splits, tensor_parallel))
    train = "".join(f"  {entry}\n" for entry in train_entries)
    return f"""ppspec 1
model {family} {{
  source = {source}
  config {{
    {entries}
  }}
}}
mesh {{ tp = {tp}, pp = {pp}, dp = {dp} }}
tensor_parallel {{
{rules}
  sequence_parallel = {str(sequence_parallel).lower()}
}}
pipeline {{ style = {style}, chunks = {chunks_for(style)}, microbatches = {microbatches}, microbatch_size = {microbatch_size} }}
train {{
  global_batch = {microbatch_size * microbatches * dp}
  seq_len = {seq_len}
  steps = {steps}
  seed = {seed}
  optimizer = {call}
  lr_schedule = {schedule}
  precision = {precision}
  grad_clip = {"none" if grad_clip is None else repr(grad_clip)}
  zero = {zero}
  reshard_after_forward = {str(reshard_after_forward).lower()}
  activation_checkpointing = {str(activation_checkpointing).lower()}
  data = synthetic(seed = {seed})
{train}}}
"""


def tiny_plan(family: str, style: str = "1f1b", **kw: Any) -> Plan:
    """The plan of `tiny_spec(family, style, **kw)`, lowered as `ppdsl run` lowers a spec."""
    world = kw.get("dp", 1) * kw.get("pp", 1) * kw.get("tp", 1)
    return lower_text(tiny_spec(family, style, **kw), world)


__all__ = ["HIDDEN", "LAYERS", "POSITIONS", "SEQ", "TINY", "VOCAB", "TinyModel", "chunks_for", "tiny_plan",
           "tiny_spec"]
