"""ppdsl's own generic GPT-style decoder, built by `build_decoder`.

A small pre-norm transformer decoder in the spirit of the model in PyTorch's pipelining
tutorial: learned token and position embeddings, ``n_layers`` blocks, a final LayerNorm and an
output projection. Module paths (what a ``.ppspec`` names)::

    tok_embeddings                      nn.Embedding(vocab_size, dim)
    pos_embeddings                      nn.Embedding(max_seq_len, dim)
    layers.N.attention_norm             nn.LayerNorm(dim)
    layers.N.attention.{wq,wk,wv}       nn.Linear(dim, dim)        column-split for TP
    layers.N.attention.wo               nn.Linear(dim, dim)        row-split for TP
    layers.N.ffn_norm                   nn.LayerNorm(dim)
    layers.N.feed_forward.w1            nn.Linear(dim, ffn_dim)    up, column-split for TP
    layers.N.feed_forward.w2            nn.Linear(ffn_dim, dim)    down, row-split for TP
    norm                                nn.LayerNorm(dim)
    output                              nn.Linear(dim, vocab_size)

Pipeline stages (``first -> blocks -> last``). Every block maps one hidden-state tensor ``h`` of
shape (batch, seq, dim) to another of the same shape, so a stage is a chain of plain calls:

- first stage, before its blocks (``first = tok_embeddings, pos_embeddings``)::

      positions = torch.arange(tokens.shape[1], device=tokens.device)
      h = tok_embeddings(tokens) + pos_embeddings(positions)      # == Decoder.embed(tokens)

- blocks (``blocks = layers``): ``for layer in stage_layers: h = layer(h)``
- last stage, after its blocks (``last = norm, output``)::

      logits = output(norm(h))                                    # == Decoder.head(h)

``Decoder.forward(tokens)`` is exactly ``head(blocks(embed(tokens)))``: the single-process
reference.

Tensor parallelism: attention derives the local number of heads from the tensor shape
(``view(b, s, -1, head_dim)``); only ``head_dim`` is stored, so splitting ``wq``/``wk``/``wv`` by
columns (whole heads per rank: ``dim / head_dim`` heads % tp == 0) and ``wo`` by rows works
without rewriting any head count.

Initialisation: every parameter is drawn from its own generator, seeded by ``(seed, parameter
path)``. The values therefore do not depend on the global RNG nor on which other modules exist,
so a rank that materialises only its own stage (``to_empty`` then `init_decoder_parameters`)
gets bit-identical weights to the single-process model.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "Attention",
    "Decoder",
    "DecoderBlock",
    "FeedForward",
    "build_decoder",
    "init_decoder_parameters",
]

INIT_STD = 0.02


class Attention(nn.Module):
    """Causal multi-head self-attention; heads = (projection width) / head_dim at run time."""

    def __init__(self, dim: int, head_dim: int, dropout: float = 0.0, bias: bool = False) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.dropout = dropout
        self.wq = nn.Linear(dim, dim, bias=bias)
        self.wk = nn.Linear(dim, dim, bias=bias)
        self.wv = nn.Linear(dim, dim, bias=bias)
        self.wo = nn.Linear(dim, dim, bias=bias)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        return x.view(b, s, -1, self.head_dim).transpose(1, 2)  # (b, heads, s, head_dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, s, _ = h.shape
        q, k, v = self._heads(self.wq(h)), self._heads(self.wk(h)), self._heads(self.wv(h))
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    """w2(gelu(w1(x))): w1 up to ffn_dim, w2 back down to dim."""

    def __init__(self, dim: int, ffn_dim: int, bias: bool = False) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, ffn_dim, bias=bias)
        self.w2 = nn.Linear(ffn_dim, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class DecoderBlock(nn.Module):
    """Pre-norm block: h + attention(norm(h)), then + feed_forward(norm(h)). (B, S, D) -> same."""

    def __init__(
        self, dim: int, head_dim: int, ffn_dim: int, dropout: float = 0.0, bias: bool = False
    ) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(dim)
        self.attention = Attention(dim, head_dim, dropout=dropout, bias=bias)
        self.ffn_norm = nn.LayerNorm(dim)
        self.feed_forward = FeedForward(dim, ffn_dim, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.dropout(self.attention(self.attention_norm(h)))
        return h + self.dropout(self.feed_forward(self.ffn_norm(h)))


class Decoder(nn.Module):
    """tokens (B, S) int64 -> logits (B, S, vocab_size). See the module docstring for stages."""

    def __init__(
        self,
        vocab_size: int,
        dim: int,
        n_layers: int,
        head_dim: int,
        ffn_dim: int,
        max_seq_len: int,
        dropout: float = 0.0,
        bias: bool = False,
    ) -> None:
        super().__init__()
        self.max_seq_len = max_seq_len
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.pos_embeddings = nn.Embedding(max_seq_len, dim)
        self.dropout = nn.Dropout(dropout)
        self.layers = nn.ModuleList(
            DecoderBlock(dim, head_dim, ffn_dim, dropout=dropout, bias=bias)
            for _ in range(n_layers)
        )
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab_size, bias=bias)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The first-stage modules: token + position embeddings, (B, S) -> (B, S, D)."""
        seq_len = tokens.shape[1]
        if seq_len > self.max_seq_len:
            raise ValueError(f"sequence length {seq_len} exceeds max_seq_len {self.max_seq_len}")
        positions = torch.arange(seq_len, device=tokens.device)
        return self.dropout(self.tok_embeddings(tokens) + self.pos_embeddings(positions))

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """The last-stage modules: final norm and output projection, (B, S, D) -> logits."""
        return self.output(self.norm(h))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)

    def init_weights(self, seed: int = 0) -> None:
        """(Re)initialise every parameter deterministically; see `init_decoder_parameters`."""
        init_decoder_parameters(self.named_parameters(), seed)


def build_decoder(
    vocab_size: int = 512,
    dim: int = 64,
    n_layers: int = 4,
    n_heads: int = 4,
    ffn_dim: int | None = None,
    max_seq_len: int = 128,
    dropout: float = 0.0,
    bias: bool = False,
    seed: int = 0,
) -> Decoder:
    """Build a `Decoder`; ``ffn_dim`` defaults to 4 * dim.

    Under ``torch.device("meta")`` nothing is allocated and nothing initialised; otherwise the
    parameters are initialised from ``seed`` (independently of ``torch.manual_seed``).
    """
    if n_heads <= 0 or dim % n_heads != 0:
        raise ValueError(f"dim = {dim} must be a positive multiple of n_heads = {n_heads}")
    model = Decoder(
        vocab_size=vocab_size,
        dim=dim,
        n_layers=n_layers,
        head_dim=dim // n_heads,
        ffn_dim=4 * dim if ffn_dim is None else ffn_dim,
        max_seq_len=max_seq_len,
        dropout=dropout,
        bias=bias,
    )
    model.init_weights(seed)
    return model


def init_decoder_parameters(
    named_parameters: Iterable[tuple[str, torch.Tensor]], seed: int = 0
) -> None:
    """Initialise parameters by their full path in the `Decoder` (meta tensors are skipped).

    Matrices and embeddings ~ N(0, 0.02), LayerNorm weights 1, biases 0. Each matrix has its
    own generator seeded by ``(seed, name)`` and is drawn on the CPU in float32, then copied:
    the values are the same on every device and for every subset of modules. Names must be
    the full paths in the `Decoder` (``layers.3.attention.wq.weight``), also for a stage.
    """
    with torch.no_grad():
        for name, param in named_parameters:
            if param.is_meta:
                continue
            param.copy_(_initial_value(name, tuple(param.shape), seed))


def _initial_value(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "bias":
        return torch.zeros(shape)
    if len(shape) == 1:  # LayerNorm weight
        return torch.ones(shape)
    generator = torch.Generator().manual_seed(_param_seed(name, seed))
    return torch.empty(shape).normal_(0.0, INIT_STD, generator=generator)


def _param_seed(name: str, seed: int) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)

