"""A model with a 0-dim parameter (for the E0409 golden: FSDP2 cannot shard it)."""
import torch


class Block(torch.nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.proj = torch.nn.Linear(dim, dim)
        self.gate = torch.nn.Parameter(torch.tensor(0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.gate * self.proj(x)


class ScalarGate(torch.nn.Module):
    def __init__(self, n_layers: int = 2, dim: int = 8, vocab: int = 16):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.layers = torch.nn.ModuleList(Block(dim) for _ in range(n_layers))
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)
