"""The generic rule for local heads of the own forward (core/own_tp.py): which attributes of an
attention module change once its projections are split over tp, and which keep their value."""

from __future__ import annotations

from types import SimpleNamespace

from ppdsl.core.own_tp import localize_generic, split_width


def _attention(**attrs: object) -> SimpleNamespace:
    return SimpleNamespace(**attrs)


def test_head_counts_and_widths_of_split_projections_become_local() -> None:
    # q: 4 heads x 8, k / v: 2 heads x 8, split by column; o: 32 inputs, split by row
    m = _attention(num_heads=4, num_key_value_heads=2, head_dim=8, hidden_size=32, num_key_value_groups=2,
                   layer_idx=3, scaling=0.35)
    changes = localize_generic(m, [32, 16, 16, 32], 2)
    assert sorted(changes) == [("hidden_size", 32, 16), ("num_heads", 4, 2), ("num_key_value_heads", 2, 1)]
    # a ratio, the head width and unrelated attributes keep their values
    assert (m.num_key_value_groups, m.head_dim, m.layer_idx, m.scaling) == (2, 8, 3, 0.35)


def test_a_module_is_changed_once_and_an_mlp_not_at_all() -> None:
    m = _attention(num_heads=4, head_dim=8, embed_dim=32)
    assert localize_generic(m, [32], 2) == [("num_heads", 4, 2), ("embed_dim", 32, 16)]
    assert localize_generic(m, [32], 2) == [] and (m.num_heads, m.embed_dim) == (2, 16)
    mlp = _attention(hidden_size=32, intermediate_size=64)
    assert localize_generic(mlp, [64, 64], 2) == [] and mlp.hidden_size == 32


def test_whole_projections_leave_their_heads_alone() -> None:
    """k / v not split (replicated): the key/value head count stays global."""
    m = _attention(num_heads=4, num_key_value_heads=1, head_dim=8, hidden_size=32)
    assert sorted(localize_generic(m, [32, 32], 2)) == [("hidden_size", 32, 16), ("num_heads", 4, 2)]
    assert m.num_key_value_heads == 1


def test_split_width_reads_linear_and_conv1d_layouts() -> None:
    linear = SimpleNamespace(weight=SimpleNamespace(shape=(48, 32)))  # nn.Linear: [out, in]
    assert (split_width(linear, "column"), split_width(linear, "row")) == (48, 32)

    class Conv1D(SimpleNamespace):  # transformers' GPT-2 layer: [in, out]
        pass

    conv = Conv1D(weight=SimpleNamespace(shape=(32, 96)))
    assert (split_width(conv, "column"), split_width(conv, "row")) == (96, 32)


def test_per_head_inputs_are_sliced_to_the_ranks_heads() -> None:
    """BLOOM's ALiBi (batch * heads, 1, keys) and MPT's (heads, 1, keys), built for every head:
    rank r's attention takes heads [r * h, (r + 1) * h), the heads a column split gives it."""
    import torch
    from torch import nn

    from ppdsl.core.own_tp import slice_per_head_inputs

    seen: dict[str, torch.Tensor] = {}

    class BloomAttention(nn.Module):
        def forward(self, hidden_states: torch.Tensor, alibi: torch.Tensor | None = None) -> torch.Tensor:
            seen["alibi"] = alibi
            return hidden_states

    class MptAttention(nn.Module):
        def forward(self, hidden_states: torch.Tensor, position_bias: torch.Tensor | None = None) -> torch.Tensor:
            seen["bias"] = position_bias
            return hidden_states

    batch, heads, keys = 2, 4, 3
    alibi = torch.arange(batch * heads * keys, dtype=torch.float32).reshape(batch * heads, 1, keys)
    bloom = BloomAttention()
    assert slice_per_head_inputs(bloom, 2, 1)
    bloom(torch.zeros(batch, keys, 8), alibi=alibi)
    want = alibi.reshape(batch, heads, 1, keys)[:, 2:4].reshape(batch * 2, 1, keys)
    assert torch.equal(seen["alibi"], want)
    mpt = MptAttention()
    assert slice_per_head_inputs(mpt, 2, 0)
    bias = torch.arange(heads * keys, dtype=torch.float32).reshape(heads, 1, keys)
    mpt(torch.zeros(batch, keys, 8), position_bias=bias)
    assert torch.equal(seen["bias"], bias[:2])
    assert not slice_per_head_inputs(nn.Linear(2, 2), 2, 0) and not slice_per_head_inputs(BloomAttention(), 1, 0)


def test_column_parts_divide_each_part_or_replicate_few_kv_heads() -> None:
    """GPTBigCode's multi-query c_attn (q | k | v = 32, 8, 8, heads of 8): q divides over tp, the
    one k and v head is replicated; a kv projection of 2 heads at tp 4 gives each head to 2 ranks."""
    from ppdsl.core.own_tp import column_parts, part_rows, replicated_heads

    parts = column_parts((32, 8, 8), 8, 2)
    assert parts == ((32, 0), (8, 1), (8, 1)) and replicated_heads(parts) == 1
    assert part_rows(parts, 2, 0) == ((0, 16), (32, 40), (40, 48))
    assert part_rows(parts, 2, 1) == ((16, 32), (32, 40), (40, 48))
    kv = column_parts((16,), 8, 4)  # 2 kv heads over 4 ranks: ranks 0, 1 head 0; ranks 2, 3 head 1
    assert kv == ((16, 2),) and [part_rows(kv, 4, r) for r in range(4)] == [((0, 8),)] * 2 + [((8, 16),)] * 2
    # a plain split needs no parts; unequal parts without heads divide evenly; neither: ()
    assert column_parts((32,), 8, 2) == () and column_parts((32,), None, 2) == ()
    assert column_parts((32, 16), None, 2) == ((32, 0), (16, 0))
    assert column_parts((24,), 8, 2) == ()  # 3 heads over 2 ranks: check's divisibility rules judge it


def test_replicated_kv_heads_make_the_groups_local() -> None:
    """Each rank holds heads / tp query heads over one kv head: num_key_value_groups follows, the
    kv head count stays (a modern attention holds no head count at all, only the ratio)."""
    m = _attention(num_heads=4, num_key_value_heads=1, head_dim=8, num_key_value_groups=4)
    assert sorted(localize_generic(m, [32, 32], 2, kv_heads=1)) == [("num_heads", 4, 2), ("num_key_value_groups", 4, 2)]
    modern = _attention(head_dim=8, num_key_value_groups=8)  # 8 query heads over 2 kv heads at tp 4
    assert localize_generic(modern, [64, 64], 4, kv_heads=2) == [("num_key_value_groups", 8, 4)]


def test_a_head_count_without_a_head_width_is_refused() -> None:
    """BERT-like attention names its head width attention_head_size: the count becomes local.
    A module counting heads with no head width named is refused: viewing its local width as
    (4, -1) would give heads of half the width, with no shape error to show it."""
    from ppdsl.core.own_tp import unknown_head_count

    bert = _attention(num_attention_heads=4, attention_head_size=8, all_head_size=32)
    assert unknown_head_count(bert, [32, 32], 2) is None
    assert sorted(localize_generic(bert, [32, 32], 2)) == [("all_head_size", 32, 16), ("num_attention_heads", 4, 2)]
    bare = _attention(num_heads=4, hidden_size=32)
    assert "names no head width" in (unknown_head_count(bare, [32, 32], 2) or "")
    assert unknown_head_count(_attention(hidden_size=32), [32], 2) is None  # an MLP counts no heads
