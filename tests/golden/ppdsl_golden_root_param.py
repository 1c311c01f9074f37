"""A model whose root holds a parameter itself (for the E0404 golden)."""
import torch


class RootParam(torch.nn.Module):
    def __init__(self, n_layers: int = 2, dim: int = 8):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(dim))
        self.layers = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(n_layers))
