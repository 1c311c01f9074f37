"""The mechanics of a cut own forward (core/own_cut.py), on plain torch modules: a pass-through
answers for the block it stands for, and the received activation reaches every argument that is
the hidden state."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.layer_idx = 3
        self.mode = "sparse"

    def set_mode(self, mode: str) -> None:  # BigBird's encoder calls set_attention_type on every layer
        self.mode = mode

    def width(self) -> int:
        return self.proj.out_features

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        return self.proj(query) + key + value


def test_a_pass_through_answers_for_its_block_without_holding_it() -> None:
    from ppdsl.core.own_cut import classes

    like = Layer()
    skipped = classes().Skipped(0, like)
    assert skipped.layer_idx == 3 and not list(skipped.parameters())
    skipped.set_mode("full")  # on the skeleton's block: the stage holds nothing of it
    assert like.mode == "full"
    assert skipped.proj is not None  # it has one (Swin asks `downsample is not None`), held elsewhere:
    with pytest.raises(AttributeError, match="another stage holds"):
        skipped.proj(torch.ones(1, 4))  # its modules and tensors are another stage's
    with pytest.raises(AttributeError, match="another stage holds"):
        skipped.proj.weight
    with pytest.raises(AttributeError, match="another stage holds"):
        skipped.width()  # a method's result too
    x = torch.ones(1, 2, 4)
    assert skipped(x) is x and classes().Skipped(2, like)(x) == (x, None)


def test_the_received_activation_replaces_every_alias_of_the_hidden_state() -> None:
    """Funnel calls its layers as layer(hidden, hidden, hidden, ...): query, key and value."""
    from ppdsl.core.own_cut import hook_receive

    layer = Layer()
    received = torch.randn(1, 2, 4)
    hook_receive(layer, lambda: received)
    stand_in, other = torch.zeros(1, 2, 4), torch.full((1, 2, 4), 5.0)
    with torch.no_grad():
        assert torch.allclose(layer(stand_in, stand_in, value=stand_in), layer.proj(received) + received + received)
        assert torch.allclose(layer(stand_in, other, value=stand_in), layer.proj(received) + other + received)


def test_dropped_modules_are_gone_then_back_in_their_order() -> None:
    """A non-last stage does not hold the modules after its blocks: check's cut drops them (a forward
    reading one fails as on the stage), and puts them back in their order (Funnel's groups of blocks
    are entries of one ModuleList: 0, 1, 2 must not come back as 0, 2, 1)."""
    from ppdsl.core.own_cut import drop_modules, undo

    root = nn.Module()
    root.groups = nn.ModuleList([Layer(), Layer(), Layer()])
    root.head = nn.Linear(4, 2)
    before = list(root.groups)
    steps = drop_modules(root, ["groups.1", "groups.2", "head"])
    assert list(root.groups) == before[:1] and not hasattr(root, "head")
    undo(steps)
    assert list(root.groups) == before and isinstance(root.head, nn.Linear)
