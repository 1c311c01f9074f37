"""Which attention a model's forward really runs: one meta forward through a probe attention.

Context parallelism (runtime/parallel/context.py) replaces the attention that transformers'
attention interface dispatches to (``config._attn_implementation``): every module that calls
it sees the whole sequence's keys and values. `probe_attention` registers a recording function
under that interface, points the model's config at it, runs the forward once on meta tensors and
records each call: the calling module, whether it is causal, and any sliding window it asks for.
`ppdsl check` then knows, before launch, whether every block's attention goes through the
interface (a block that computes attention by itself would see only its rank's tokens), and
refuses what the context-parallel attention cannot do (E0246).

torch is imported inside the function only, like `ppdsl.dsl.introspect`.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    from torch import nn

__all__ = ["AttentionCall", "AttentionProbe", "probe_attention"]

PROBE = "ppdsl_attention_probe"


@attrs.frozen
class AttentionCall:
    module: str  # the calling module's path, e.g. "model.layers.0.self_attn"
    causal: bool  # the module's is_causal (True when it does not say)
    sliding_window: int | None  # what it passed as sliding_window (None: full attention)
    same_length: bool  # keys as long as the queries (self-attention without a cache)


@attrs.frozen
class AttentionProbe:
    calls: tuple[AttentionCall, ...]  # in call order, each module once
    takes_position_ids: bool  # the model's forward has a position_ids argument


def probe_attention(model: nn.Module, config: Mapping[str, object], seq_len: int) -> AttentionProbe:
    """Run ``model`` (on meta) once through the probe attention; raises what the forward raises."""
    import torch
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from ppdsl.core.meta_values import meta_values

    paths = {id(m): p for p, m in model.named_modules()}
    calls: dict[str, AttentionCall] = {}

    def probe(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, **kwargs: Any) -> Any:
        path = paths.get(id(module), type(module).__name__)
        window = kwargs.get("sliding_window")
        calls.setdefault(path, AttentionCall(path, bool(getattr(module, "is_causal", True)),
                                             int(window) if isinstance(window, int) else None,
                                             key.shape[-2] == query.shape[-2]))
        kwargs.pop("is_causal", None)
        eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if eager is not None:  # the model's own (softcapping, sinks, ... as it computes them)
            return eager(module, query, key, value, None, **kwargs)
        return sdpa_attention_forward(module, query, key, value, None, is_causal=False, **kwargs)

    AttentionInterface.register(PROBE, probe)
    hf_config = getattr(model, "config", None)
    before = getattr(hf_config, "_attn_implementation", None)
    was_training = model.training
    model.eval()
    try:
        hf_config._attn_implementation = PROBE  # type: ignore[union-attr]
        from .tp_dataflow import _call

        with torch.no_grad(), meta_values():
            _call(model, seq_len, config)
    finally:
        if hf_config is not None:
            hf_config._attn_implementation = before
        model.train(was_training)
    takes = "position_ids" in inspect.signature(model.forward).parameters
    return AttentionProbe(tuple(calls.values()), takes)
