"""Megatron-style 1D tensor parallelism: f/g collectives, parallel layers, HF attention fixes.

Every entry point takes the tensor-parallel process group explicitly; nothing is global.
"""

from ppdsl.runtime.parallel.tp.attention import SUPPORTED_ATTENTION, AttentionLocalization, localize_attention
from ppdsl.runtime.parallel.tp.comm import (
    all_reduce_grads,
    copy_to_tp,
    gather_from_tp,
    gather_seq,
    gather_seq_replicated,
    reduce_from_tp,
    reduce_scatter_seq,
    scatter_seq,
    scatter_to_tp,
    tp_rank,
    tp_size,
)
from ppdsl.runtime.parallel.tp.layers import ColumnParallelLinear, RowParallelLinear, replace_module, shard_column, shard_lm_head, shard_row
from ppdsl.runtime.parallel.tp.partition import Layout, Partition, padded_size
from ppdsl.runtime.parallel.tp.vocab import VocabParallelEmbedding, shard_vocab_embedding, vocab_parallel_cross_entropy

__all__ = [
    "SUPPORTED_ATTENTION",
    "AttentionLocalization",
    "ColumnParallelLinear",
    "Layout",
    "Partition",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "all_reduce_grads",
    "copy_to_tp",
    "gather_from_tp",
    "gather_seq",
    "gather_seq_replicated",
    "localize_attention",
    "padded_size",
    "reduce_from_tp",
    "reduce_scatter_seq",
    "replace_module",
    "scatter_seq",
    "scatter_to_tp",
    "shard_column",
    "shard_lm_head",
    "shard_row",
    "shard_vocab_embedding",
    "tp_rank",
    "tp_size",
    "vocab_parallel_cross_entropy",
]
