"""E0224: a column split must give each rank whole groups of the view its forward takes of the
layer's output (dsl/column_groups.py). tests/golden/E0224_* hold CodeGen, the model that does not."""

from __future__ import annotations

import pytest

from ppdsl.dsl.column_groups import misaligned


@pytest.mark.parametrize("whole, local, fused, ok", [
    ((4, 8), (2, 8), 1, True),            # heads x head_dim: each rank its heads
    ((4, 48), (4, 24), 1, False),         # CodeGen: mp_num = 4 groups, a constant of its forward
    ((3, 4, 8), (3, 2, 8), 3, True),      # ModernBERT's Wqkv, fused = 3: each part's heads
    ((3, 4, 8), (3, 4, 4), 3, False),     # ... with the head width halved instead
    ((3, 4, 8), (3, 4, 8), 1, False),     # plain column over fused parts: the local view is the whole one
    ((3, 32), (3, 16), 3, True),          # fused = 3 viewed as (3, width): each part halved
    ((2, 64), (2, 32), 2, True),          # a GLU's gate|up viewed as (2, ffn), fused = 2
])
def test_the_local_view_must_be_the_whole_one_divided_at_its_outer_group(whole, local, fused, ok) -> None:
    found = misaligned({"p": [whole]}, {"p": [local]}, {"p": fused}, 2)
    assert (found is None) is ok


def test_the_views_a_forward_takes_are_recorded_globally_and_locally() -> None:
    torch = pytest.importorskip("torch")
    from torch import nn

    from ppdsl.dsl.column_groups import recording_groups

    class Grouped(nn.Module):
        def __init__(self, groups_from_heads: bool) -> None:
            super().__init__()
            self.proj = nn.Linear(16, 32, bias=False, device="meta")
            self.heads, self.from_heads = 4, groups_from_heads

        def forward(self, x):
            groups = self.heads if self.from_heads else 4  # a constant, like CodeGen's mp_num
            return self.proj(x).reshape(*x.shape[:-1], groups, -1).sum(-1)

    for from_heads, ok in ((True, True), (False, False)):
        m = Grouped(from_heads)
        x = torch.empty(2, 3, 16, device="meta")
        with recording_groups(m, ["proj"]) as whole:
            m(x)
        m.proj.weight = nn.Parameter(torch.empty(16, 16, device="meta"))  # one rank's columns at tp 2
        m.heads = 2  # what the generic rule makes of a head count
        with recording_groups(m, ["proj"]) as local:
            m(x)
        assert whole == {"proj": [(4, 8)]}
        assert local == {"proj": [(2, 8) if from_heads else (4, 4)]}
        assert (misaligned(whole, local, {"proj": 1}, 2) is None) is ok
