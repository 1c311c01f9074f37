"""What check knows about model families comes from the family registry (ppdsl/families/): this
module only re-exports its torch-free lookups under the names dsl/ has always used."""

from __future__ import annotations

from ppdsl.families import (
    DIM_ALIASES, Family, by_name, family_of, hf_attention_classes, hf_class_of, run_refusal, supported_hf_classes,
)

__all__ = [
    "DIM_ALIASES", "HF_ATTENTION_CLASSES", "Family", "by_name", "family_of", "hf_class_of", "run_refusal",
    "fused_parts", "supported_hf_classes",
]

# The HF attention classes the runtime can split (runtime/tp/attention.py localises them through
# their family): with sequence parallelism such a module must be split over tp.
HF_ATTENTION_CLASSES: tuple[str, ...] = hf_attention_classes()


def fused_parts(family: str, block_relative_path: str) -> int:
    """The k of a family's known fused projection (1: not fused, or not known). `ppdsl check`
    reads the parts from a traced forward (`ppdsl.dsl.tp_dataflow`) and falls back on the
    family descriptor's `fused` table when the forward cannot be traced."""
    try:
        fused = by_name(family).fused.get(block_relative_path)
    except ValueError:  # no such family
        return 1
    return 1 if fused is None else fused.parts
