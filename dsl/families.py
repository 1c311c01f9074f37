"""What check knows about model families comes from the family registry (core/families/): this
module only re-exports its torch-free lookups under the names dsl/ has always used."""

from __future__ import annotations

from ppdsl.core.families import (
    DIM_ALIASES, Family, by_name, family_of, hf_attention_classes, hf_class_of, run_refusal, supported_hf_classes,
)

__all__ = [
    "DIM_ALIASES", "HF_ATTENTION_CLASSES", "Family", "by_name", "family_of", "hf_class_of", "run_refusal",
    "fused_parts", "supported_hf_classes",
]

# The HF attention classes the runtime can split (runtime/parallel/tp/attention.py localises them through
# their family): with sequence parallelism such a module must be split over tp.
HF_ATTENTION_CLASSES: tuple[str, ...] = hf_attention_classes()


def fused_parts(family: str, block_relative_path: str) -> int:
    """The k of `column(fused = k)` that a family's known fused projection needs (1: not fused,
    not known, or interleaved per head, where a plain column split gives each rank whole
    heads). `ppdsl check` reads the parts from a traced forward (`ppdsl.dsl.tp_dataflow`) and
    takes them from here where the trace cannot see them (the forward slices the output, as
    Phi-3's ``qkv[..., :q]``, or cannot be traced at all)."""
    try:
        fused = by_name(family).fused.get(block_relative_path)
    except ValueError:  # no such family
        return 1
    return 1 if fused is None or fused.per_head else fused.parts
