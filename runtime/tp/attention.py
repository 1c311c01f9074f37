"""Make HF attention modules work on local heads once their projections are column-split.

What each family needs, read from transformers 5.24's forward methods:

* GPT-2 (`GPT2Attention`): `forward` splits the fused c_attn output with
  `split(self.split_size, dim=2)`; split_size must become embed_dim / tp or the local
  [q_i | k_i | v_i] output cannot be unpacked. `num_heads` and `embed_dim` are not read by the
  5.24 forward, but transformers 4.x read them in `_split_heads` / `_merge_heads` and the SDPA
  variant's final `view(bsz, q_len, self.embed_dim)`, so they are rewritten too (as
  ColossalAI's Shardformer does) and the module describes its local shape.
* BERT (`BertSelfAttention`, `RobertaSelfAttention`; `BertAttention` delegates to `.self`):
  reshapes with -1 heads, so 5.24 needs nothing; `num_attention_heads` and `all_head_size`
  (4.x reshaped the context layer to `all_head_size`; head pruning reads both) become local.
* Llama-like (Llama, Mistral, Mixtral, Qwen2, Qwen3, Gemma, Gemma2, Granite): reshape with -1
  heads and read only `head_dim`, `scaling` and `num_key_value_groups` (by the attention
  interface). With q and kv projections both split by tp the ratio q/kv heads is unchanged, so
  nothing is rewritten; head counts held by older versions (`num_heads`,
  `num_key_value_heads`, `hidden_size`) are made local where present. The shared config is
  never touched (all layers share it).

Every family checks that its head counts divide by tp.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import attrs
from torch import nn

from ppdsl.dsl.families import HF_ATTENTION_CLASSES

__all__ = ["SUPPORTED_ATTENTION", "AttentionLocalization", "localize_attention"]

_MARK = "_ppdsl_tp_size"


@attrs.frozen
class AttentionLocalization:
    """What `localize_attention` changed: (attribute, global value, local value) triples."""

    family: str
    tp_size: int
    changes: tuple[tuple[str, int, int], ...]


def _divide(module: nn.Module, names: tuple[str, ...], tp: int, what: str,
            required: tuple[str, ...] = ()) -> list[tuple[str, int, int]]:
    """Divide each present attribute in `names` by tp (those in `required` must exist)."""
    changes = []
    for name in names:
        if not hasattr(module, name):
            if name in required:
                raise ValueError(f"{type(module).__name__} has no attribute {name!r}; "
                                 "unsupported transformers version?")
            continue
        value = int(getattr(module, name))
        if value % tp != 0:
            raise ValueError(
                f"{type(module).__name__}.{name} = {value} ({what}) is not divisible by tp = {tp}"
            )
        changes.append((name, value, value // tp))
    return changes


def _gpt2(module: nn.Module, tp: int) -> list[tuple[str, int, int]]:
    return _divide(module, ("num_heads", "split_size", "embed_dim"), tp, "attention heads/width",
                   required=("num_heads", "split_size"))


def _bert(module: nn.Module, tp: int) -> list[tuple[str, int, int]]:
    return _divide(module, ("num_attention_heads", "all_head_size"), tp,
                   "attention heads/width", required=("num_attention_heads",))


def _llama(module: nn.Module, tp: int) -> list[tuple[str, int, int]]:
    config = cast(Any, module).config
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    if heads % tp != 0 or kv_heads % tp != 0:
        raise ValueError(
            f"{type(module).__name__}: {heads} attention heads and {kv_heads} key/value heads "
            f"must both be divisible by tp = {tp}"
        )
    groups = getattr(module, "num_key_value_groups", heads // kv_heads)
    assert groups == (heads // tp) // (kv_heads // tp), (groups, heads, kv_heads, tp)
    return _divide(module, ("num_heads", "num_key_value_heads", "hidden_size"), tp,
                   "attention heads/width")


_FAMILIES: dict[str, tuple[str, Callable[[nn.Module, int], list[tuple[str, int, int]]]]] = {
    "GPT2Attention": ("gpt2", _gpt2),
    "BertSelfAttention": ("bert", _bert),
    "RobertaSelfAttention": ("bert", _bert),
    **{
        name: ("llama", _llama)
        for name in (
            "LlamaAttention", "MistralAttention", "MixtralAttention", "Qwen2Attention",
            "Qwen3Attention", "GemmaAttention", "Gemma2Attention", "GraniteAttention",
        )
    },
}
_WRAPPERS = {"BertAttention": "self", "RobertaAttention": "self"}

SUPPORTED_ATTENTION: tuple[str, ...] = tuple(sorted([*_FAMILIES, *_WRAPPERS]))
assert set(SUPPORTED_ATTENTION) == set(HF_ATTENTION_CLASSES), "dsl.families.HF_ATTENTION_CLASSES is out of date"


def localize_attention(module: nn.Module, tp_size: int) -> AttentionLocalization:
    """Rewrite the head-count / width attributes of an HF attention module whose projections
    are (or will be) column-split over `tp_size` ranks, in place. Raises ValueError for an
    unknown attention class, indivisible head counts, or a module already localized."""
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    cls = type(module).__name__
    if cls in _WRAPPERS:
        return localize_attention(getattr(module, _WRAPPERS[cls]), tp_size)
    if cls not in _FAMILIES:
        raise ValueError(
            f"no tensor-parallel rule for attention class {type(module).__module__}.{cls}; "
            f"supported: {', '.join(SUPPORTED_ATTENTION)}"
        )
    if hasattr(module, _MARK):
        raise ValueError(
            f"{cls} was already localized for tp = {getattr(module, _MARK)}; "
            "localizing twice would divide its head counts again"
        )
    family, rule = _FAMILIES[cls]
    changes = rule(module, tp_size)
    for name, _, local in changes:
        setattr(module, name, local)
    setattr(module, _MARK, tp_size)
    return AttentionLocalization(family=family, tp_size=tp_size, changes=tuple(changes))
