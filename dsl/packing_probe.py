"""Whether a model's forward keeps attention inside each packed document when it is given
position ids that restart at each document and no attention mask (``packing = "documents"``).

transformers' mask builders (masking_utils.create_causal_mask and its sliding-window sibling)
read such position ids with ``find_packed_sequence_indices`` and build a block-diagonal causal
mask; with a flash-attention implementation the same position ids select its varlen path. So
the proof, on one meta forward through a recording attention (as dsl/attention_probe.py runs
it): the forward takes ``position_ids``, its mask builders looked for packed sequences in them,
and every attention call of every block received the mask so built.

A forward that takes position ids (its positions restart) but builds its masks without them
(OPT, BioGPT) gets ppdsl's document masks
(`ppdsl.core.document_masks`: the same document mask, anded into its own mask builder through
transformers' mask interface); the proof is a second forward with them: the mask builder ran and
every block's attention received its mask. A model with no position ids, or attention outside
transformers' attention interface, would let a token see the documents before it, or cannot be
proven not to: check refuses it (E0472).

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


def probe_documents(model: nn.Module, config: Mapping[str, object], seq_len: int,
                    blocks: str | None) -> tuple[str | None, bool]:
    """``(None, False)`` when ``model`` keeps attention inside documents given restarting position
    ids by its own mask builders; ``(None, True)`` when it does with ppdsl's document masks
    (`ppdsl.core.document_masks`: a forward that takes position ids but builds its masks without
    them); else ``(why not, False)``. ``blocks``: the path of the block list (None: not known)."""
    if "position_ids" not in inspect.signature(model.forward).parameters:
        return "its forward takes no position_ids, so it cannot be told where each document starts", False
    offset = _offset_positions(model)
    if offset is not None:
        return offset, False
    why = _attempt(model, config, seq_len, blocks, document_masks=False)
    if why is None:
        return None, False
    if why == NO_INTERFACE or _attempt(model, config, seq_len, blocks, document_masks=True) is not None:
        return why, False
    return None, True


def _offset_positions(model: nn.Module) -> str | None:
    """Why position ids from 0 are not this model's, or None: a position embedding with a
    padding row (RoBERTa's convention) counts positions from ``padding_idx + 1``, so position
    ``padding_idx`` of every document would read the padding row (zero, and never trained)."""
    from torch import nn as torch_nn

    for path, module in model.named_modules():
        if isinstance(module, torch_nn.Embedding) and "position" in path.rsplit(".", 1)[-1] \
                and module.padding_idx is not None:
            return (f"its position embeddings ({path}) count positions from padding_idx + 1 = "
                    f"{module.padding_idx + 1}, not from 0 as each packed document's do")
    return None


NO_INTERFACE = "its attention does not go through transformers' attention interface, so ppdsl cannot prove its masks"


def _attempt(model: nn.Module, config: Mapping[str, object], seq_len: int, blocks: str | None,
             document_masks: bool) -> str | None:
    """One meta forward given restarting position ids: None when every block's attention got a mask
    built from them (by HF's packed-sequence detection, or with `document_masks` by ppdsl's
    document masks), else why not."""
    import torch
    from transformers import AttentionInterface, masking_utils
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from ppdsl.core.document_masks import document_masks_implementation, documents
    from ppdsl.core.meta_values import meta_values
    from ppdsl.core.model_inputs import meta_inputs

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

    def building(*args: Any, **kwargs: Any) -> Any:  # with document masks: called with them anded in
        looked.append(True)
        kwargs["allow_is_causal_skip"] = False
        return masking_utils.sdpa_mask(*args, **kwargs)

    if document_masks:
        name = document_masks_implementation(PROBE, mask_builder=building, attention=probe)
    else:
        name = PROBE
        AttentionInterface.register(PROBE, probe)
        # the mask builders build for an implementation they know (else they build none): sdpa's mask
        masking_utils.AttentionMaskInterface.register(PROBE, masking_utils.sdpa_mask)
    configs = {id(m.config): m.config for m in model.modules() if hasattr(getattr(m, "config", None),
                                                                             "_attn_implementation")}
    before = {k: c._attn_implementation for k, c in configs.items()}
    was_training = model.training
    model.eval()
    positions = torch.zeros((1, seq_len), dtype=torch.long, device="meta")
    try:
        for c in configs.values():
            c._attn_implementation = name
        if not document_masks:
            masking_utils.find_packed_sequence_indices = finding
        inputs = meta_inputs(model, 1, seq_len, config)
        inputs["position_ids"] = positions
        if "use_cache" in model.config.to_dict():
            inputs["use_cache"] = False
        with torch.no_grad(), meta_values(), documents(positions if document_masks else None):
            model(**inputs)
    finally:
        masking_utils.find_packed_sequence_indices = find
        for k, c in configs.items():
            c._attn_implementation = before[k]
        model.train(was_training)
    if not masked:
        return NO_INTERFACE
    if not looked:
        return "its forward builds its attention masks without reading packed sequences from the position ids"
    unmasked = sorted(p for p, m in masked.items() if not m and (blocks is None or p.startswith(f"{blocks}.")))
    if unmasked:
        return f"{unmasked[0]} attends without the mask built from the position ids"
    return None
