"""ppdsl's own GPT-style decoder (ppdsl.models.decoder)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from ppdsl.models.decoder import Decoder, build_decoder, init_decoder_parameters  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, DIM, LAYERS, HEADS, SEQ = 97, 32, 3, 4, 16


def _tiny(**kwargs: object) -> Decoder:
    args: dict[str, object] = dict(
        vocab_size=VOCAB, dim=DIM, n_layers=LAYERS, n_heads=HEADS, max_seq_len=SEQ
    )
    args.update(kwargs)
    return build_decoder(**args)  # type: ignore[arg-type]


def _tokens(batch: int = 2, seq: int = SEQ, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def test_module_layout() -> None:
    model = _tiny()
    assert isinstance(model.tok_embeddings, torch.nn.Embedding)
    assert isinstance(model.pos_embeddings, torch.nn.Embedding)
    assert isinstance(model.layers, torch.nn.ModuleList) and len(model.layers) == LAYERS
    assert isinstance(model.norm, torch.nn.LayerNorm)
    assert model.output.out_features == VOCAB
    block = model.layers[0]
    assert block.attention.head_dim == DIM // HEADS
    assert not hasattr(block.attention, "n_heads")
    assert block.feed_forward.w1.out_features == 4 * DIM
    assert _tiny(ffn_dim=48).layers[0].feed_forward.w2.in_features == 48


def test_forward_shapes() -> None:
    model = _tiny()
    assert model(_tokens(3, 5)).shape == (3, 5, VOCAB)
    assert model.layers[1](torch.randn(3, 5, DIM)).shape == (3, 5, DIM)
    with pytest.raises(ValueError, match="max_seq_len"):
        model(_tokens(1, SEQ + 1))


def test_invalid_heads() -> None:
    with pytest.raises(ValueError, match="multiple of n_heads"):
        build_decoder(dim=30, n_heads=4)


def test_causal() -> None:
    model = _tiny().eval()
    tokens = _tokens(1)
    changed = tokens.clone()
    changed[0, 10] = (changed[0, 10] + 1) % VOCAB
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10], rtol=0, atol=0)
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_stage_composition_equals_forward() -> None:
    model = _tiny().eval()
    tokens = _tokens()
    with torch.no_grad():
        positions = torch.arange(tokens.shape[1])
        h = model.tok_embeddings(tokens) + model.pos_embeddings(positions)
        for layer in model.layers:
            h = layer(h)
        logits = model.output(model.norm(h))
        torch.testing.assert_close(logits, model(tokens), rtol=0, atol=0)


def test_deterministic_init_and_dropout() -> None:
    torch.manual_seed(0)
    a = _tiny(dropout=0.1)
    torch.manual_seed(123)  # the init does not depend on the global RNG
    b = _tiny(dropout=0.1)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(pa, pb), name
    assert not torch.equal(_tiny(seed=1).output.weight, a.output.weight)

    tokens = _tokens()
    torch.manual_seed(7)
    out_a = a.train()(tokens)
    torch.manual_seed(7)
    out_b = b.train()(tokens)
    assert torch.equal(out_a, out_b)


def test_meta_then_materialise_matches_cpu() -> None:
    reference = _tiny(bias=True)
    with torch.device("meta"):
        model = _tiny(bias=True)
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    # A pipeline stage initialises only its own parameters, by their full path.
    stage = [(n, p) for n, p in model.named_parameters() if n.startswith("layers.1.")]
    init_decoder_parameters(stage, seed=0)
    assert torch.equal(model.layers[1].attention.wq.weight, reference.layers[1].attention.wq.weight)
    model.init_weights(seed=0)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_column_split_attention_needs_no_head_count() -> None:
    """wq/wk/wv split by columns and wo by rows over 2 ranks: partial outputs sum to the full."""
    attention = _tiny().layers[0].attention
    h = torch.randn(2, 8, DIM)
    half = DIM // 2
    with torch.no_grad():
        full = attention(h)
        partial = []
        for rank in range(2):
            cols = slice(rank * half, (rank + 1) * half)
            local = type(attention)(DIM, attention.head_dim)
            for name in ("wq", "wk", "wv"):
                getattr(local, name).weight = torch.nn.Parameter(
                    getattr(attention, name).weight[cols]
                )
            local.wo.weight = torch.nn.Parameter(attention.wo.weight[:, cols])
            partial.append(local(h))
    torch.testing.assert_close(partial[0] + partial[1], full)
