"""Deterministic, placement-independent parameter initialisation.

Every parameter is filled from its own ``torch.Generator``, seeded from a stable hash of
``(seed, full parameter name)``. The values of ``transformer.h.3.attn.c_attn.weight`` therefore
do not depend on which rank builds it, which other modules that rank holds, or the order in
which modules are initialised: the union of all ranks' parts equals a single-process model
initialised the same way, bit for bit. Values are drawn on the CPU and copied to the target
device, so a CUDA run starts from exactly the same weights as a CPU reference.

A rule (:class:`InitRule`) decides how one parameter is filled, given the module that owns it:
:class:`HFInitRule` follows transformers' ``PreTrainedModel._init_weights`` (normal(0,
initializer_range) for Linear / Conv1D / Embedding weights, zero biases, ones / zeros for norms,
zeroed padding row), with optional per-parameter std overrides (GPT-2's scaled residual
projections). :class:`TorchDefaultInitRule` follows the torch layers' own ``reset_parameters``
(Kaiming-uniform Linear, N(0, 1) Embedding), but generator-driven.
"""

from __future__ import annotations

import hashlib
import math
from typing import Callable, Mapping

import attrs
import torch
from torch import nn

__all__ = [
    "InitRule",
    "HFInitRule",
    "TorchDefaultInitRule",
    "param_seed",
    "param_generator",
    "init_module_params",
]


def param_seed(seed: int, name: str) -> int:
    """A stable 63-bit seed for one parameter (unlike ``hash()``, the same in every process)."""
    digest = hashlib.blake2b(f"{seed}\x00{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def param_generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(param_seed(seed, name))


def _is_norm(module: nn.Module) -> bool:
    # HF norms are custom classes (LlamaRMSNorm, T5LayerNorm, ...): match by name as HF does.
    name = type(module).__name__
    return isinstance(module, (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)) or "LayerNorm" in name or "RMSNorm" in name


def _is_conv1d(module: nn.Module) -> bool:
    # transformers.pytorch_utils.Conv1D (GPT-2): a linear layer with the weight stored [in, out].
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx")


def _fill_norm(local: str, out: torch.Tensor, weight: float = 1.0) -> None:
    if local == "bias":
        out.zero_()
    else:
        out.fill_(weight)


def _zero_padding_row(module: nn.Module, local: str, out: torch.Tensor) -> None:
    padding_idx = getattr(module, "padding_idx", None)
    if local == "weight" and padding_idx is not None and 0 <= padding_idx < out.shape[0]:
        out[padding_idx].zero_()


class InitRule:
    """How one parameter is filled. ``name`` is the full (canonical) parameter name, ``module``
    the module that owns it (for a tied parameter: the canonical owner), ``local`` the
    parameter's attribute name on that module; ``out`` is a CPU tensor to fill in place."""

    def fill(self, name: str, module: nn.Module, local: str, out: torch.Tensor, gen: torch.Generator) -> None:
        raise NotImplementedError


@attrs.frozen
class HFInitRule(InitRule):
    """transformers' ``_init_weights`` semantics with a fixed std (the config's initializer_range).

    ``std_overrides`` maps a predicate on the full parameter name to the std that replaces
    ``std`` for it (GPT-2: ``*.c_proj.weight`` -> initializer_range / sqrt(2 * n_layer)).
    """

    std: float = 0.02
    std_overrides: tuple[tuple[Callable[[str], bool], float], ...] = ()
    norm_weight: float = 1.0  # Gemma's RMSNorm scales by (1 + weight): its weight starts at 0

    def _std(self, name: str) -> float:
        for matches, std in self.std_overrides:
            if matches(name):
                return std
        return self.std

    def fill(self, name: str, module: nn.Module, local: str, out: torch.Tensor, gen: torch.Generator) -> None:
        if _is_norm(module):
            _fill_norm(local, out, self.norm_weight)
        elif local == "bias" or (out.dim() == 1 and local.endswith("bias")):
            out.zero_()
        elif isinstance(module, nn.Embedding):
            out.normal_(0.0, self._std(name), generator=gen)
            _zero_padding_row(module, local, out)
        elif isinstance(module, nn.Linear) or _is_conv1d(module) or out.dim() >= 2:
            out.normal_(0.0, self._std(name), generator=gen)
        else:
            # A bare 1-d parameter of an unknown module (a scale, a gate): identity-like.
            out.fill_(1.0)


@attrs.frozen
class TorchDefaultInitRule(InitRule):
    """torch's own layer defaults, generator-driven: Linear weight Kaiming-uniform(a=sqrt(5)) and
    bias U(-1/sqrt(fan_in), 1/sqrt(fan_in)); Embedding N(0, 1) with a zeroed padding row; norms
    ones / zeros. Unknown >=2-d parameters get N(0, fallback_std), 1-d ones ('weight') or zeros."""

    fallback_std: float = 0.02

    def fill(self, name: str, module: nn.Module, local: str, out: torch.Tensor, gen: torch.Generator) -> None:
        if _is_norm(module):
            _fill_norm(local, out)
        elif isinstance(module, nn.Linear):
            if local == "weight":
                nn.init.kaiming_uniform_(out, a=math.sqrt(5), generator=gen)
            else:
                bound = 1.0 / math.sqrt(module.in_features) if module.in_features > 0 else 0.0
                nn.init.uniform_(out, -bound, bound, generator=gen)
        elif isinstance(module, nn.Embedding):
            out.normal_(0.0, 1.0, generator=gen)
            _zero_padding_row(module, local, out)
        elif out.dim() >= 2:
            out.normal_(0.0, self.fallback_std, generator=gen)
        elif local.endswith("bias"):
            out.zero_()
        else:
            out.fill_(1.0)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


@torch.no_grad()
def init_module_params(
    module_path: str,
    module: nn.Module,
    seed: int,
    rule: InitRule | None = None,
    tied: Mapping[str, tuple[str, nn.Module]] | None = None,
) -> None:
    """Fill every parameter of ``module`` (which sits at ``module_path`` in the full model).

    ``tied`` maps a full parameter name to ``(canonical name, canonical owner module)``: such a
    parameter is filled exactly as its canonical twin would be (same seed, same rule), so tied
    weights agree on every rank that holds one of them. The owner module is only inspected
    (type, padding_idx), never written, so a meta-device module from the skeleton is fine.
    """
    rule = rule if rule is not None else TorchDefaultInitRule()
    tied = tied or {}
    done: set[int] = set()
    for sub_path, sub in module.named_modules(prefix=module_path, remove_duplicate=False):
        for local, param in sub.named_parameters(recurse=False):
            if id(param) in done:  # a parameter shared inside this module (kept tie)
                continue
            done.add(id(param))
            assert param.device.type != "meta", f"{_join(sub_path, local)} is not materialised"
            full = _join(sub_path, local)
            name, owner = tied.get(full, (full, sub))
            owner_local = name.rsplit(".", 1)[-1]
            out = torch.empty(param.shape, dtype=torch.float32)
            rule.fill(name, owner, owner_local, out, param_generator(seed, name))
            param.copy_(out.to(dtype=param.dtype))
