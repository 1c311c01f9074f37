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


class _Carrying(nn.Module):
    """Block 0 computes ``extra`` with its own layer and every block returns it; the next reads it
    (T5's position bias, in small)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.extra = nn.Linear(width, width)

    def forward(self, hidden_states: torch.Tensor, extra: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if extra is None:
            extra = self.extra(hidden_states)
        return self.fc(hidden_states) + extra.mean(-1, keepdim=True), extra


def _carrying_model() -> nn.Module:
    from transformers import PretrainedConfig, PreTrainedModel
    from transformers.modeling_outputs import CausalLMOutput

    class ToyForCausalLM(PreTrainedModel):
        config_class = PretrainedConfig

        def __init__(self, config: PretrainedConfig) -> None:
            super().__init__(config)
            self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
            self.layers = nn.ModuleList(_Carrying(config.hidden_size) for _ in range(4))
            self.head = nn.Linear(config.hidden_size, config.vocab_size)

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> CausalLMOutput:
            hidden, extra = self.embed(input_ids), None
            for layer in self.layers:
                hidden, extra = layer(hidden, extra)
            return CausalLMOutput(logits=self.head(hidden))

    with torch.device("meta"):
        return ToyForCausalLM(PretrainedConfig(vocab_size=16, hidden_size=8))


def test_what_the_block_before_returns_and_the_next_reads_is_carried_and_its_share_under_tp_proven() -> None:
    pytest.importorskip("transformers")
    from ppdsl.dsl.own_layout import trace_layout
    from ppdsl.dsl.own_tp_proof import LayerSplit, prove_local_shapes

    model = _carrying_model()
    layout = trace_layout(model, model.config.to_dict())
    assert layout.ok and not layout.uncuttable, layout
    # each block after the first reads output 1 of the one before: (seq, width) per sample
    assert layout.carried == ((), ((1, (-1, 8)),), ((1, (-1, 8)),), ((1, (-1, 8)),))
    # a split of the layer it is computed from: each rank's share is narrower than the boundary the plan sizes
    found = prove_local_shapes(model, "layers", {"layers.0.extra": LayerSplit("column")}, 2, 6, "tokens",
                               layout.carried)
    assert found is not None and found.kind == "carried" and "(6, 8)" in found.problem and "(6, 4)" in found.problem
    # a split elsewhere leaves it whole: proven
    model = _carrying_model()
    assert prove_local_shapes(model, "layers", {f"layers.{i}.fc": LayerSplit("column", gather_output=True)
                                                for i in range(4)}, 2, 6, "tokens", layout.carried) is None


def test_the_stop_follows_every_forward_hook_registered_after_the_cut() -> None:
    """FSDP2 hooks a block after the cut; its post-forward (reshard, the backward's all-gather)
    must run before the stop ends the model's forward (else zero = 3 with reshard_after_forward
    fails in backward and evaluation leaves the block's weights gathered)."""
    from ppdsl.core.own_cut import classes, hook_stop

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    hook_stop(model[0])
    seen = []
    model[0].register_forward_hook(lambda m, a, out: seen.append(out.shape))  # like fully_shard's, later
    with pytest.raises(classes().StageOutput):
        model(torch.ones(2, 4))
    assert seen == [torch.Size([2, 4])]
