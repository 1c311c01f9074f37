"""A model whose layers share weights in pairs: `n_layers` layers, n_layers // 2 blocks (for the
E0308 golden: the stages are cut from the model's blocks, not the config's layer count)."""
import torch


class Block(torch.nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.proj = torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(x)


class PairedLayers(torch.nn.Module):
    def __init__(self, n_layers: int = 8, dim: int = 8, vocab: int = 16):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.layers = torch.nn.ModuleList(Block(dim) for _ in range(n_layers // 2))
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(layer(x))  # each block runs two of the n_layers layers
        return self.head(x)
