"""What check knows about model families without importing torch: module layout and the names
of the config values that the divisibility rules talk about."""

from __future__ import annotations

from typing import Any, Mapping

import attrs

# canonical dimension -> config key aliases, tried in order (for python factories and unknown HF classes)
DIM_ALIASES: dict[str, tuple[str, ...]] = {
    "layers": ("num_hidden_layers", "n_layer", "n_layers", "num_layers"),
    "hidden": ("hidden_size", "n_embd", "dim", "d_model"),
    "heads": ("num_attention_heads", "n_head", "n_heads", "num_heads"),
    "kv_heads": ("num_key_value_heads", "n_kv_heads", "num_kv_heads"),
    "ffn": ("intermediate_size", "n_inner", "ffn_dim", "d_ff"),
    "vocab": ("vocab_size", "n_vocab"),
    "labels": ("num_labels",),
    "positions": ("n_positions", "max_position_embeddings", "max_seq_len"),
}


@attrs.frozen
class Family:
    name: str  # "gpt2" | "bert" | "llama" | "generic"
    blocks: str
    first: tuple[str, ...]
    last: tuple[str, ...]
    defaults: Mapping[str, Any]  # the HF config defaults of the values the rules use
    causal_lm: bool = True

    def dims(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """Canonical dims (layers, hidden, heads, kv_heads, ffn, vocab, labels, positions) from a config."""
        merged = {**self.defaults, **config}
        out: dict[str, Any] = {}
        for dim, aliases in DIM_ALIASES.items():
            for key in aliases:
                if merged.get(key) is not None:
                    out[dim] = merged[key]
                    break
        if "ffn" not in out and "hidden" in out and self.name in ("gpt2", "generic"):
            out["ffn"] = 4 * out["hidden"]  # GPT-2's n_inner=None and the decoder's ffn_dim=None
        if "kv_heads" not in out and "heads" in out and self.name == "llama":
            out["kv_heads"] = out["heads"]
        return out


GPT2 = Family(
    "gpt2",
    blocks="transformer.h",
    first=("transformer.wte", "transformer.wpe"),
    last=("transformer.ln_f", "lm_head"),
    defaults={"n_layer": 12, "n_embd": 768, "n_head": 12, "n_inner": None, "vocab_size": 50257, "n_positions": 1024},
)
BERT = Family(
    "bert",
    blocks="bert.encoder.layer",
    first=("bert.embeddings",),
    last=("bert.pooler", "classifier"),
    defaults={"num_hidden_layers": 12, "hidden_size": 768, "num_attention_heads": 12, "intermediate_size": 3072,
              "vocab_size": 30522, "num_labels": 2, "max_position_embeddings": 512},
    causal_lm=False,
)
LLAMA = Family(
    "llama",
    blocks="model.layers",
    first=("model.embed_tokens",),
    last=("model.norm", "lm_head"),
    defaults={"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": None,
              "intermediate_size": 11008, "vocab_size": 32000, "max_position_embeddings": 2048},
)
GENERIC = Family(
    "generic",
    blocks="layers",
    first=("tok_embeddings", "pos_embeddings"),
    last=("norm", "output"),
    defaults={},
)

_HF_CLASS_FAMILY = {
    "GPT2LMHeadModel": GPT2,
    "BertForSequenceClassification": BERT,
    "LlamaForCausalLM": LLAMA,
    "MistralForCausalLM": LLAMA,
    "Qwen2ForCausalLM": LLAMA,
}


def family_of(source_kind: str, target: str, config: Mapping[str, Any]) -> Family:
    if source_kind == "hf":
        return _HF_CLASS_FAMILY.get(target, GENERIC)
    if source_kind == "hf_pretrained":
        archs = config.get("architectures") or []
        for a in archs:
            if a in _HF_CLASS_FAMILY:
                return _HF_CLASS_FAMILY[a]
        return GENERIC
    return GENERIC


def supported_hf_classes() -> tuple[str, ...]:
    return tuple(_HF_CLASS_FAMILY)


# The HF attention classes whose heads ppdsl's runtime can split (runtime/tp/attention.py keys
# its localisation on these names). Kept here, torch-free, so `check` can tell which modules of
# a block mix tokens: with sequence parallelism such a module must be split over tp.
HF_ATTENTION_CLASSES: tuple[str, ...] = (
    "BertAttention", "BertSelfAttention", "Gemma2Attention", "GemmaAttention", "GPT2Attention",
    "GraniteAttention", "LlamaAttention", "MistralAttention", "MixtralAttention", "Qwen2Attention",
    "Qwen3Attention", "RobertaAttention", "RobertaSelfAttention",
)


# Projections whose output the family's forward splits into equal parts (module path relative to
# a block -> number of parts): a column split of one needs `fused = k`. `ppdsl check` reads the
# parts from a traced forward (`ppdsl.dsl.tp_dataflow`) and falls back on this table when the
# forward cannot be traced.
FUSED_PROJECTIONS: dict[str, dict[str, int]] = {
    "gpt2": {"attn.c_attn": 3},
}


def fused_parts(family: str, block_relative_path: str) -> int:
    """The k of a family's known fused projection (1: not fused, or not known)."""
    return FUSED_PROJECTIONS.get(family, {}).get(block_relative_path, 1)
