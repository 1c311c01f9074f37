"""Block-diagonal document masks for models whose mask builders do not read packed documents from
the position ids (``train.packing = documents``; docs/language.md, "Packing documents").

transformers' own mechanism keeps packed documents apart when a model passes its position ids to
``create_causal_mask``: ``find_packed_sequence_indices`` turns restarting positions into document
ids and the mask builder ands ``packed_sequence_mask_function`` into the causal mask. A model whose
forward takes position ids (so its positions restart) but builds its masks without them (OPT,
BioGPT) gets the same document mask here, through transformers' own
extension point: the model's attention implementation is registered under a second name
(`document_masks_implementation`) whose mask builder is the original one with the document mask
anded into its ``mask_function``. The document ids come from the position ids of the microbatch
the forward runs on (`documents`), set around each forward by the stages and the single-process
reference alike. Masks built from them are the ones HF builds for a model that reads them.

torch and transformers are imported inside the functions only (check's probe uses this module).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

__all__ = ["MASKED_IMPLEMENTATIONS", "document_masks_implementation", "documents", "use_document_masks"]

PREFIX = "ppdsl_documents_"
# the implementations whose mask builders build from a mask_function (flash attention's takes none)
MASKED_IMPLEMENTATIONS = ("eager", "sdpa", "flex_attention")

_POSITIONS: ContextVar[Any] = ContextVar("ppdsl_document_positions", default=None)


@contextlib.contextmanager
def documents(position_ids: Any) -> Iterator[None]:
    """The forward run inside builds its masks for these packed documents ((batch, seq) positions
    restarting at each document; None: no documents)."""
    token = _POSITIONS.set(position_ids)
    try:
        yield
    finally:
        _POSITIONS.reset(token)


def _with_documents(build: Callable[..., Any]) -> Callable[..., Any]:
    def build_with_documents(*args: Any, **kwargs: Any) -> Any:
        positions = _POSITIONS.get()
        if positions is not None:
            from transformers.masking_utils import and_masks, find_packed_sequence_indices, packed_sequence_mask_function

            ids = find_packed_sequence_indices(positions.view(-1, positions.shape[-1]))
            if ids is not None:
                kwargs["mask_function"] = and_masks(kwargs["mask_function"], packed_sequence_mask_function(ids))
                kwargs["allow_is_causal_skip"] = False  # a mask is needed: not sdpa's is_causal
        return build(*args, **kwargs)

    return build_with_documents


def document_masks_implementation(implementation: str, mask_builder: Callable[..., Any] | None = None,
                                  attention: Callable[..., Any] | None = None) -> str:
    """Register (once) and return the name of `implementation` with document masks: its attention,
    and its mask builder with the document mask anded in. `mask_builder` / `attention`: other
    functions to wrap and run (check's probe records through its own)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if implementation not in MASKED_IMPLEMENTATIONS and mask_builder is None:
        raise ValueError(f"attention implementation {implementation!r} builds no masks from a mask function; "
                         f"document masks need one of {', '.join(MASKED_IMPLEMENTATIONS)}")
    name = PREFIX + implementation
    if mask_builder is None and name in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        return name
    AttentionMaskInterface.register(name, _with_documents(mask_builder or ALL_MASK_ATTENTION_FUNCTIONS[implementation]))
    AttentionInterface.register(name, attention or (_eager if implementation == "eager"
                                                    else ALL_ATTENTION_FUNCTIONS[implementation]))
    return name


def _eager(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, **kwargs: Any) -> Any:
    """Eager attention under another name: the module's own ``eager_attention_forward`` (each
    model file has its own), which transformers runs for ``"eager"``; sdpa where it has none."""
    import sys

    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is not None:
        return eager(module, query, key, value, attention_mask, **kwargs)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def use_document_masks(model: Any) -> None:
    """Build `model`'s masks with document masks: each config its modules hold (a multimodal
    model's sub-configs too) names its own implementation so registered."""
    configs = {id(m.config): m.config for m in model.modules()
               if hasattr(getattr(m, "config", None), "_attn_implementation")}
    # read first: transformers 5 pushes a config's implementation into its sub-configs when set
    before = {k: c._attn_implementation or "eager" for k, c in configs.items()}
    for k, config in configs.items():  # the root first, then each sub-config its own again
        if not before[k].startswith(PREFIX):
            config._attn_implementation = document_masks_implementation(before[k])
