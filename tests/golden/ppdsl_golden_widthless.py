"""A python-factory model whose hidden width nothing tells: no config hidden size, and a first
module that is a token table but not an nn.Embedding (golden E0481)."""

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        return x + torch.tanh(self.lin(x))


class Lookup(nn.Module):
    """A token table that is not an nn.Embedding."""

    def __init__(self, vocab: int, d: int) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(vocab, d) * 0.02)

    def forward(self, ids):
        return self.table[ids]


class Model(nn.Module):
    def __init__(self, d: int, n: int, vocab: int) -> None:
        super().__init__()
        self.proj = Lookup(vocab, d)
        self.layers = nn.ModuleList(Block(d) for _ in range(n))
        self.out = nn.Linear(d, vocab)

    def forward(self, x):
        x = self.proj(x)
        for b in self.layers:
            x = b(x)
        return self.out(x)


def build(width: int = 32, depth: int = 4, vocab_size: int = 64) -> nn.Module:
    return Model(width, depth, vocab_size)
