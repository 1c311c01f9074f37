"""Whether a model's forward keeps attention inside each packed document when it is given
position ids that restart at each document and no attention mask (``packing = "documents"``).

transformers' mask builders (masking_utils.create_causal_mask and its sliding-window sibling)
read such position ids with ``find_packed_sequence_indices`` and build a block-diagonal causal
mask; with a flash-attention implementation the same position ids select its varlen path. So
the proof, on one meta forward through a recording attention (as dsl/attention_probe.py runs
it): the forward takes ``position_ids``, its mask builders looked for packed sequences in them,
and every attention call of every block received the mask so built. A model that builds its
masks by other means (or none: attention that is always causal over the whole window) would let
a token see the documents before it: check refuses it (E0472).

torch is imported inside the function only.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

__all__ = ["probe_documents"]

PROBE = "ppdsl_documents_probe"


def probe_documents(model: nn.Module, config: Mapping[str, object], seq_len: int, blocks: str | None) -> str | None:
    """None when ``model`` keeps attention inside documents given restarting position ids, else
    why not (a sentence). ``blocks``: the path of the block list (None: not known)."""
    import torch
    from transformers import AttentionInterface, masking_utils
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from ppdsl.core.meta_values import meta_values
    from ppdsl.core.model_inputs import meta_inputs

    if "position_ids" not in inspect.signature(model.forward).parameters:
        return "its forward takes no position_ids, so it cannot be told where each document starts"
    paths = {id(m): p for p, m in model.named_modules()}
    masked: dict[str, bool] = {}
    looked: list[bool] = []

    def probe(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, **kwargs: Any) -> Any:
        masked.setdefault(paths.get(id(module), type(module).__name__), attention_mask is not None)
        kwargs.pop("is_causal", None)
        eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if eager is not None:
            return eager(module, query, key, value, None, **kwargs)
        return sdpa_attention_forward(module, query, key, value, None, is_causal=False, **kwargs)

    find = masking_utils.find_packed_sequence_indices

    def finding(position_ids: Any) -> Any:
        looked.append(True)
        return find(position_ids)

    AttentionInterface.register(PROBE, probe)
    # the mask builders build for an implementation they know (else they build none): sdpa's mask
    masking_utils.AttentionMaskInterface.register(PROBE, masking_utils.sdpa_mask)
    hf_config = model.config
    before = hf_config._attn_implementation
    was_training = model.training
    model.eval()
    try:
        hf_config._attn_implementation = PROBE
        masking_utils.find_packed_sequence_indices = finding
        inputs = meta_inputs(model, 1, seq_len, config)
        inputs["position_ids"] = torch.zeros((1, seq_len), dtype=torch.long, device="meta")
        if "use_cache" in hf_config.to_dict():
            inputs["use_cache"] = False
        with torch.no_grad(), meta_values():
            model(**inputs)
    finally:
        masking_utils.find_packed_sequence_indices = find
        hf_config._attn_implementation = before
        model.train(was_training)
    if not masked:
        return "its attention does not go through transformers' attention interface, so ppdsl cannot prove its masks"
    if not looked:
        return "its forward builds its attention masks without reading packed sequences from the position ids"
    unmasked = sorted(p for p, m in masked.items() if not m and (blocks is None or p.startswith(f"{blocks}.")))
    if unmasked:
        return f"{unmasked[0]} attends without the mask built from the position ids"
    return None
