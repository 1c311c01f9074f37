"""Tensor-parallel layers: sharded == unsharded (outputs, input and weight gradients).

Distributed checks run in two spawned suites (cost of a spawn is mostly importing torch and
transformers in each child): 2 ranks for layers on nn.Linear and GPT-2 Conv1D, the vocab
embedding and cross entropy, sequence parallelism and whole HF GPT-2 / Llama / BERT blocks;
4 ranks for tp=4 and for two tp=2 groups side by side. Each check is its own pytest test,
reading the suite's per-check result; a hang fails the suite at its hard timeout.
"""

from __future__ import annotations

import copy
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dist_harness import DistributedFailure, run_distributed

from ppdsl.core.own_tp import localize_generic
from ppdsl.runtime.parallel.tp import (
    ColumnParallelLinear,
    Partition,
    RowParallelLinear,
    VocabParallelEmbedding,
    all_reduce_grads,
    copy_to_tp,
    gather_from_tp,
    gather_seq,
    localize_attention,
    padded_size,
    reduce_from_tp,
    reduce_scatter_seq,
    replace_module,
    scatter_seq,
    scatter_to_tp,
    shard_column,
    shard_lm_head,
    shard_row,
    shard_vocab_embedding,
    vocab_parallel_cross_entropy,
)

ATOL = 1e-6
RTOL = 1e-6
# Hard limit per suite. Start-up dominates (each rank imports torch, the 2-rank suite also
# transformers) and stretches several-fold when the machine is shared; a real hang in a
# collective is cut at the harness's 60 s collective timeout instead.
SUITE_TIMEOUT_S = 300.0

Check = Callable[[dist.ProcessGroup], None]


# =============================================================================================
# Helpers used inside the ranks
# =============================================================================================


def close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """|actual - expected| <= ATOL * scale + RTOL * |expected| elementwise, scale = max(1,
    max |expected|): an element near zero of a tensor of magnitude-10 gradients carries the fp32
    rounding of magnitude-10 sums, whatever its own size. (Not torch.testing's assert_close: its
    first call imports torch.distributed.tensor, ~2 s per process.)"""
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    actual, expected = actual.detach(), expected.detach()
    diff = (actual - expected).abs()
    scale = max(1.0, float(expected.abs().max())) if expected.numel() else 1.0
    bad = ~(diff <= ATOL * scale + RTOL * expected.abs())  # NaN counts as bad
    if bad.any():
        flat = int(torch.nan_to_num(torch.where(bad, diff, 0.0), nan=float("inf")).argmax())  # a failing one
        index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), diff.shape))
        raise AssertionError(
            f"{what}: {int(bad.sum())}/{diff.numel()} elements differ; max |diff| "
            f"{diff.view(-1)[flat].item():.3g} at {index} (actual "
            f"{actual.reshape(-1)[flat].item():.8g}, expected {expected.reshape(-1)[flat].item():.8g})"
        )


def grad(t: torch.Tensor) -> torch.Tensor:
    assert t.grad is not None, "no gradient"
    return t.grad


def all_gather(t: torch.Tensor, group: dist.ProcessGroup) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


def merge_last(layer: ColumnParallelLinear, local: torch.Tensor,
               group: dist.ProcessGroup) -> torch.Tensor:
    """Full output of a column layer from the local outputs (last dim in q|k|v order)."""
    shards = [s.movedim(-1, 0) for s in all_gather(local, group)]
    return layer.merge_shards("bias", shards).movedim(0, -1)


def local_last(layer: ColumnParallelLinear, full: torch.Tensor) -> torch.Tensor:
    """This rank's slice of a full column-layer output (or its gradient)."""
    return layer.local_shard("bias", full.movedim(-1, 0)).movedim(0, -1)


def assert_grads_match(ref: nn.Module, tp: nn.Module, group: dist.ProcessGroup) -> None:
    """Every parameter gradient of `tp` (gathered where sharded) equals `ref`'s."""
    seen = 0
    for path, module in tp.named_modules():
        for name, param in module.named_parameters(recurse=False):
            ref_grad = ref.get_submodule(path).get_parameter(name).grad
            assert param.grad is not None and ref_grad is not None, f"{path}.{name}: no grad"
            got = param.grad
            if hasattr(module, "merge_shards"):
                got = module.merge_shards(name, all_gather(got, group))
            close(got, ref_grad, f"grad of {path}.{name}")
            seen += 1
    assert seen > 0


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape: int, seed: int, scale: float = 1.0, grad: bool = False) -> torch.Tensor:
    t = torch.randn(*shape, generator=seeded(seed)) * scale
    return t.requires_grad_(grad)


def make_linear(kind: str, n_in: int, n_out: int, seed: int, bias: bool = True) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "linear":
        return nn.Linear(n_in, n_out, bias=bias)
    from transformers.pytorch_utils import Conv1D

    m = Conv1D(n_out, n_in)
    nn.init.normal_(m.bias)  # Conv1D initialises its bias to zero; a zero bias proves nothing
    return m


# =============================================================================================
# Checks (each runs on every rank of the group)
# =============================================================================================


def check_column(group: dist.ProcessGroup, kind: str, fused: int, gather: bool) -> None:
    full = make_linear(kind, 16, 24, seed=1)
    layer = shard_column(full, group, fused=fused, gather_output=gather)
    assert isinstance(layer, ColumnParallelLinear)
    local = 24 // dist.get_world_size(group)
    assert layer.weight.shape == ((local, 16) if kind == "linear" else (16, local)), layer.weight.shape
    assert set(dict(layer.named_parameters())) == {"weight", "bias"}
    x_ref, x = randn(3, 5, 16, seed=2, grad=True), randn(3, 5, 16, seed=2, grad=True)
    gy = randn(3, 5, 24, seed=3)
    y_ref = full(x_ref)
    (y_ref * gy).sum().backward()
    y = layer(x)
    if gather:
        close(y, y_ref, "gathered output")
        (y * gy).sum().backward()
    else:
        assert y.shape[-1] == 24 // dist.get_world_size(group)
        close(y, local_last(layer, y_ref), "local output")
        close(merge_last(layer, y.detach(), group), y_ref, "merged local outputs")
        (y * local_last(layer, gy)).sum().backward()
    close(grad(x), grad(x_ref), "input grad")
    assert_grads_match(full, layer, group)


def check_fused_local_order(group: dist.ProcessGroup) -> None:
    """Local c_attn output is [q_i | k_i | v_i], each part split separately."""
    rank, tp = dist.get_rank(group), dist.get_world_size(group)
    full = make_linear("conv1d", 8, 3 * 8, seed=4)
    layer = shard_column(full, group, fused=3)
    x = randn(2, 8, seed=5)
    q, k, v = full(x).split(8, dim=-1)
    w = 8 // tp
    expected = torch.cat([t[..., rank * w:(rank + 1) * w] for t in (q, k, v)], dim=-1)
    close(layer(x), expected, "local fused output")


def check_row(group: dist.ProcessGroup, kind: str, input_is_parallel: bool) -> None:
    rank, tp = dist.get_rank(group), dist.get_world_size(group)
    full = make_linear(kind, 24, 12, seed=6)
    with torch.no_grad():
        full.bias.add_(3.0)  # a bias added on every rank would be visible
    layer = shard_row(full, group, input_is_parallel=input_is_parallel)
    assert isinstance(layer, RowParallelLinear)
    assert layer.bias.shape == (12,)
    x_ref = randn(3, 5, 24, seed=7, grad=True)
    gy = randn(3, 5, 12, seed=8)
    y_ref = full(x_ref)
    (y_ref * gy).sum().backward()
    w = 24 // tp
    if input_is_parallel:
        x = x_ref.detach()[..., rank * w:(rank + 1) * w].clone().requires_grad_(True)
        expected_grad = grad(x_ref)[..., rank * w:(rank + 1) * w]
    else:
        x = x_ref.detach().clone().requires_grad_(True)
        expected_grad = grad(x_ref)
    y = layer(x)
    close(y, y_ref, "output")
    (y * gy).sum().backward()
    close(grad(x), expected_grad, "input grad")
    assert_grads_match(full, layer, group)


def _mlp(seq_parallel: bool, group: dist.ProcessGroup | None = None,
         full: nn.Sequential | None = None) -> nn.Sequential:
    if group is None:
        torch.manual_seed(9)
        mlp = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        with torch.no_grad():
            mlp[0].weight.normal_()
            mlp[0].bias.normal_()
        return mlp
    assert full is not None
    tp_mlp = copy.deepcopy(full)
    replace_module(tp_mlp, "1", shard_column(full[1], group, sequence_parallel=seq_parallel))
    replace_module(tp_mlp, "3", shard_row(full[3], group, sequence_parallel=seq_parallel))
    return tp_mlp


def check_mlp(group: dist.ProcessGroup, seq_parallel: bool, seed: int = 10) -> None:
    """LayerNorm -> column -> row MLP, optionally sequence parallel (input and output split on
    dim 1; the layer norm then sees only this rank's tokens and its grads need a sum)."""
    rank, tp = dist.get_rank(group), dist.get_world_size(group)
    full = _mlp(False)
    tp_mlp = _mlp(seq_parallel, group, full)
    x_ref = randn(2, 8, 16, seed=seed, grad=True)
    gy = randn(2, 8, 16, seed=seed + 1)
    y_ref = full(x_ref)
    (y_ref * gy).sum().backward()
    s = 8 // tp
    here = slice(rank * s, (rank + 1) * s)
    if seq_parallel:
        x = x_ref.detach()[:, here].clone().requires_grad_(True)
        y = tp_mlp(x)
        close(y, y_ref[:, here], "sequence-parallel output")
        (y * gy[:, here]).sum().backward()
        close(grad(x), grad(x_ref)[:, here], "sequence-parallel input grad")
        all_reduce_grads(tp_mlp[0].parameters(), group)
    else:
        x = x_ref.detach().clone().requires_grad_(True)
        y = tp_mlp(x)
        close(y, y_ref, "output")
        (y * gy).sum().backward()
        close(grad(x), grad(x_ref), "input grad")
    assert_grads_match(full, tp_mlp, group)


def check_comm(group: dist.ProcessGroup) -> None:
    rank, tp = dist.get_rank(group), dist.get_world_size(group)
    # Size-1 groups: every function is the identity (same object, no communication).
    singles = [dist.new_group([r]) for r in range(dist.get_world_size())]
    single = singles[dist.get_rank()]
    t = randn(2, 4, 12, seed=11)
    for f in (copy_to_tp, reduce_from_tp, gather_from_tp, scatter_to_tp, gather_seq,
              reduce_scatter_seq, scatter_seq):
        assert f(t, single) is t, f.__name__
    # gather / scatter round trips and their gradients over the real group.
    full = randn(2, 4, 12, seed=12, grad=True)
    part = scatter_to_tp(full, group)
    close(part, full.detach().chunk(tp, dim=-1)[rank], "scatter_to_tp")
    back = gather_from_tp(part, group)
    close(back, full.detach(), "gather_from_tp")
    (back * (rank + 1)).sum().backward()
    # back's gradient is rank+1 everywhere; each rank keeps its slice, scatter gathers them.
    expected = torch.cat([torch.full((2, 4, 12 // tp), r + 1.0) for r in range(tp)], dim=-1)
    close(grad(full), expected, "scatter/gather backward")
    # reduce_scatter_seq: sum over ranks, then this rank's sequence block; backward gathers.
    x = (randn(2, 4, 6, seed=13) * (rank + 1)).requires_grad_(True)
    y = reduce_scatter_seq(x, group)
    total = sum(randn(2, 4, 6, seed=13) * (r + 1) for r in range(tp))
    close(y, total.chunk(tp, dim=1)[rank], "reduce_scatter_seq")
    gy = randn(*y.shape, seed=14 + rank)
    (y * gy).sum().backward()
    close(grad(x), torch.cat([randn(*y.shape, seed=14 + r) for r in range(tp)], dim=1),
          "reduce_scatter_seq backward")
    # gather_seq backward reduce-scatters.
    z = randn(2, 4 // tp, 6, seed=20 + rank, grad=True)
    g = gather_seq(z, group)
    close(g, torch.cat([randn(2, 4 // tp, 6, seed=20 + r) for r in range(tp)], dim=1),
          "gather_seq")
    (g * (rank + 1)).sum().backward()
    close(grad(z), torch.full_like(z, sum(range(1, tp + 1))), "gather_seq backward")


def check_embedding(group: dist.ProcessGroup, vocab: int, pad_to: int | None,
                    padding_idx: int | None = None) -> None:
    tp = dist.get_world_size(group)
    torch.manual_seed(15)
    full = nn.Embedding(vocab, 8, padding_idx=padding_idx)
    emb = shard_vocab_embedding(full, group, pad_to=pad_to)
    assert isinstance(emb, VocabParallelEmbedding)
    p = emb.partition
    assert p.padded == padded_size(vocab, tp, pad_to) and emb.weight.shape == (p.local, 8)
    n_real = p.end - p.start
    assert torch.count_nonzero(emb.weight[n_real:]) == 0, "padding rows must be zero"
    edges = [0, vocab - 1] + [r * p.local + d for r in range(1, tp) for d in (-1, 0)]
    edges = [e for e in edges if 0 <= e < vocab]
    ids = torch.cat([torch.tensor(edges), torch.randint(0, vocab, (40,), generator=seeded(16))])
    if padding_idx is not None:
        ids = torch.cat([ids, torch.tensor([padding_idx] * 3)])
    ids = ids.view(1, -1).repeat(2, 1)
    gy = randn(*ids.shape, 8, seed=17)
    y_ref = full(ids)
    (y_ref * gy).sum().backward()
    y = emb(ids)
    close(y, y_ref, "embedding output")
    (y * gy).sum().backward()
    assert torch.count_nonzero(grad(emb.weight)[n_real:]) == 0, "padding rows got a gradient"
    assert_grads_match(full, emb, group)


def check_cross_entropy(group: dist.ProcessGroup, vocab: int, pad_to: int | None) -> None:
    tp = dist.get_world_size(group)
    p = Partition.build(vocab, dist.get_rank(group), tp, pad_to)
    logits_ref = randn(2, 7, vocab, seed=18, scale=3.0, grad=True)
    labels = torch.randint(0, vocab, (2, 7), generator=seeded(19))
    labels[0, 0], labels[0, 1], labels[1, 6] = -100, vocab - 1, 0
    labels[1, 2] = min(p.padded // tp, vocab - 1)  # first entry of rank 1
    local = p.shard(logits_ref.detach(), -1).clone()
    local[..., p.end - p.start:] = 1e4  # padding columns must not count, whatever they hold
    for reduction in ("mean", "sum", "none"):
        ref = F.cross_entropy(logits_ref.view(-1, vocab), labels.view(-1), ignore_index=-100,
                              reduction=reduction)
        ref_grad, = torch.autograd.grad(ref.sum() if reduction == "none" else ref, logits_ref)
        x = local.clone().requires_grad_(True)
        loss = vocab_parallel_cross_entropy(x, labels, group, p.start, p.end,
                                            reduction=reduction)
        close(loss, ref.view_as(loss), f"loss ({reduction})")
        (loss.sum() if reduction == "none" else loss).backward()
        close(grad(x)[..., : p.end - p.start],
              ref_grad[..., p.start:p.end], f"logit grad ({reduction})")
        assert torch.count_nonzero(grad(x)[..., p.end - p.start:]) == 0, "grad in padding"


def check_embedding_sequence_parallel(group: dist.ProcessGroup) -> None:
    rank, tp = dist.get_rank(group), dist.get_world_size(group)
    torch.manual_seed(23)
    full = nn.Embedding(1001, 8)
    emb = shard_vocab_embedding(full, group, pad_to=8, sequence_parallel=True)
    ids = torch.randint(0, 1001, (2, 8), generator=seeded(24))
    gy = randn(2, 8, 8, seed=25)
    y_ref = full(ids)
    (y_ref * gy).sum().backward()
    here = slice(rank * 8 // tp, (rank + 1) * 8 // tp)
    y = emb(ids)
    close(y, y_ref[:, here], "sequence-parallel embedding output")
    (y * gy[:, here]).sum().backward()
    assert_grads_match(full, emb, group)


def check_deepcopy(group: dist.ProcessGroup) -> None:
    """A model holding parallel layers can be deep-copied (the group is shared, not copied)."""
    model = nn.Sequential(shard_column(nn.Linear(4, 8), group),
                          shard_row(nn.Linear(8, 4), group),
                          shard_vocab_embedding(nn.Embedding(16, 4), group))
    twin = copy.deepcopy(model)
    for a, b in zip(model, twin, strict=True):
        assert b.group is a.group and b.partition == a.partition
        assert b.weight is not a.weight and torch.equal(b.weight, a.weight)
    x = randn(3, 4, seed=26)
    close(twin[1](twin[0](x)), model[1](model[0](x)), "deep-copied layers")


def check_tied_head(group: dist.ProcessGroup) -> None:
    """Embedding and LM head sharded with the same pad_to hold identical shards (re-tieable)."""
    torch.manual_seed(21)
    emb = nn.Embedding(1001, 8)
    head = nn.Linear(8, 1001, bias=False)
    head.weight = emb.weight
    e = shard_vocab_embedding(emb, group, pad_to=8)
    h = shard_lm_head(head, group, pad_to=8, gather_output=True)
    assert torch.equal(e.weight, h.weight) and e.partition == h.partition
    x = randn(2, 3, 8, seed=22)
    close(h(x), head(x), "gathered padded LM head output (padding removed)")


def check_errors(group: dist.ProcessGroup) -> None:
    tp = dist.get_world_size(group)
    cases: list[tuple[Callable[[], Any], str]] = [
        (lambda: shard_column(nn.Linear(4, 2 * tp + 1), group), "not divisible"),
        (lambda: shard_column(nn.Linear(4, 3 * (2 * tp + 1)), group, fused=3), "not divisible"),
        (lambda: shard_column(nn.Linear(4, 10), group, fused=3), "fused"),
        (lambda: shard_row(nn.Linear(2 * tp + 1, 4), group), "not divisible"),
        (lambda: shard_vocab_embedding(nn.Embedding(50257, 4), group), "pad_to"),
        (lambda: shard_vocab_embedding(nn.Embedding(50257, 4), group, pad_to=tp + 1),
         "multiple of"),
        (lambda: shard_column(nn.Conv2d(2, 2, 1), group), "nn.Linear or"),
        (lambda: vocab_parallel_cross_entropy(torch.zeros(2, 3), torch.zeros(2, 1).long(),
                                              group, 0, 3), "disagree"),
    ]
    for fn, words in cases:
        with pytest.raises(ValueError, match=words):
            fn()


# ---------------------------------------------------------------- HF blocks (transformers)


def _shard_gpt2_block(block: nn.Module, group: dist.ProcessGroup) -> None:
    replace_module(block, "attn.c_attn", shard_column(block.attn.c_attn, group, fused=3))
    replace_module(block, "attn.c_proj", shard_row(block.attn.c_proj, group))
    replace_module(block, "mlp.c_fc", shard_column(block.mlp.c_fc, group))
    replace_module(block, "mlp.c_proj", shard_row(block.mlp.c_proj, group))
    # the own forward's generic rule (core/own_tp.py): the attributes equal to a split width or its heads
    width = block.attn.embed_dim
    changes = localize_generic(block.attn, (3 * width, width), dist.get_world_size(group))
    assert {name for name, _, _ in changes} == {"num_heads", "split_size", "embed_dim"}


def _gpt2_config(**overrides: Any) -> Any:
    from transformers import GPT2Config

    kw: dict[str, Any] = {
        "n_embd": 32, "n_head": 4, "n_layer": 2, "n_positions": 16, "vocab_size": 1001,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "attn_implementation": "eager",
    }
    kw.update(overrides)
    return GPT2Config(**kw)


def _compare_block(group: dist.ProcessGroup, full: nn.Module, tp: nn.Module,
                   run: Callable[[nn.Module, torch.Tensor], torch.Tensor], seed: int) -> None:
    x_ref = randn(2, 6, 32, seed=seed, grad=True)
    x = x_ref.detach().clone().requires_grad_(True)
    gy = randn(2, 6, 32, seed=seed + 1)
    y_ref, y = run(full, x_ref), run(tp, x)
    close(y, y_ref, "block output")
    (y_ref * gy).sum().backward()
    (y * gy).sum().backward()
    close(grad(x), grad(x_ref), "block input grad")
    assert_grads_match(full, tp, group)


def check_gpt2_block(group: dist.ProcessGroup) -> None:
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    torch.manual_seed(30)
    full = GPT2Block(_gpt2_config(), layer_idx=0)
    tp = copy.deepcopy(full)
    _shard_gpt2_block(tp, group)
    _compare_block(group, full, tp, lambda m, x: m(x), seed=31)


def check_llama_layer(group: dist.ProcessGroup) -> None:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import (
        LlamaDecoderLayer,
        LlamaRotaryEmbedding,
    )

    config = LlamaConfig(hidden_size=32, intermediate_size=48, num_attention_heads=4,
                         num_key_value_heads=2, num_hidden_layers=1, vocab_size=64,
                         max_position_embeddings=16, attn_implementation="eager")
    torch.manual_seed(32)
    full = LlamaDecoderLayer(config, layer_idx=0)
    tp = copy.deepcopy(full)
    for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
                 "mlp.up_proj"):
        replace_module(tp, name, shard_column(full.get_submodule(name), group))
    for name in ("self_attn.o_proj", "mlp.down_proj"):
        replace_module(tp, name, shard_row(full.get_submodule(name), group))
    # the own forward's generic rule: Llama's attention views with -1, nothing to change
    changes = localize_generic(tp.self_attn, (32, 16), dist.get_world_size(group))
    assert changes == [] and tp.self_attn.num_key_value_groups == 2
    rope = LlamaRotaryEmbedding(config)

    def run(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        pos = rope(x, torch.arange(x.size(1))[None])
        return m(x, position_embeddings=pos, attention_mask=None)

    _compare_block(group, full, tp, run, seed=33)


def check_bert_layer(group: dist.ProcessGroup) -> None:
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertLayer

    config = BertConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                        num_hidden_layers=1, vocab_size=64, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, attn_implementation="eager")
    torch.manual_seed(34)
    full = BertLayer(config)
    tp = copy.deepcopy(full)
    for name in ("attention.self.query", "attention.self.key", "attention.self.value",
                 "intermediate.dense"):
        replace_module(tp, name, shard_column(full.get_submodule(name), group))
    for name in ("attention.output.dense", "output.dense"):
        replace_module(tp, name, shard_row(full.get_submodule(name), group))
    changes = localize_generic(tp.attention.self, (32,), dist.get_world_size(group))  # the own forward's rule
    assert {n for n, _, _ in changes} == {"num_attention_heads", "all_head_size"}
    _compare_block(group, full, tp, lambda m, x: m(x), seed=35)


def check_gpt2_lm(group: dist.ProcessGroup) -> None:
    """Whole GPT-2 LM: vocab-parallel wte (odd vocab, padded), split blocks, tied padded head,
    vocab-parallel CE == HF's own loss; all gradients equal."""
    from transformers import GPT2LMHeadModel

    torch.manual_seed(36)
    full = GPT2LMHeadModel(_gpt2_config())
    assert full.lm_head.weight is full.transformer.wte.weight
    tp = copy.deepcopy(full)
    wte = shard_vocab_embedding(tp.transformer.wte, group, pad_to=8)
    replace_module(tp, "transformer.wte", wte)
    for i in range(len(tp.transformer.h)):
        _shard_gpt2_block(tp.transformer.h[i], group)
    head = shard_lm_head(tp.lm_head, group, pad_to=8)
    head.weight = wte.weight  # re-tie
    replace_module(tp, "lm_head", head)

    ids = torch.randint(0, 1001, (2, 12), generator=seeded(37))
    labels = ids.clone()
    labels[0, 3:5] = -100
    ref = full(ids, labels=labels).loss
    ref.backward()
    hidden = tp.transformer(ids).last_hidden_state
    logits = tp.lm_head(hidden)[:, :-1]
    loss = vocab_parallel_cross_entropy(logits, labels[:, 1:], group, head.partition.start,
                                        head.partition.end)
    close(loss, ref, "LM loss")
    loss.backward()
    assert_grads_match(full, tp, group)


def check_localize_attention(group: dist.ProcessGroup) -> None:
    """Attribute rewrites per family, the shared config untouched, and the error cases (runs
    in a rank only because transformers is imported there already)."""
    from transformers import FalconConfig, GemmaConfig
    from transformers.models.falcon.modeling_falcon import FalconAttention
    from transformers.models.gemma.modeling_gemma import GemmaAttention
    from transformers.models.gpt2.modeling_gpt2 import GPT2Attention

    def falcon_config(**kw: Any) -> Any:
        return FalconConfig(hidden_size=48, num_attention_heads=6, multi_query=False,
                            new_decoder_architecture=False, **kw)

    attn = FalconAttention(falcon_config())
    loc = localize_attention(attn, 2)
    assert loc.family == "falcon" and (attn.num_heads, attn.hidden_size, attn.split_size,
                                       attn.head_dim) == (3, 24, 24, 8), loc
    with pytest.raises(ValueError, match="already localized"):
        localize_attention(attn, 2)
    with pytest.raises(ValueError, match="num_heads = 6 .* not divisible by tp = 4"):
        localize_attention(FalconAttention(falcon_config()), 4)
    # a class no family claims: the own forward localises it by the generic rule (core/own_tp.py)
    with pytest.raises(ValueError, match="no tensor-parallel rule for attention class .*GPT2Attention"):
        localize_attention(GPT2Attention(_gpt2_config(n_embd=48, n_head=6)), 2)

    gemma_cfg = GemmaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            intermediate_size=8)
    gemma = GemmaAttention(gemma_cfg, layer_idx=0)
    loc = localize_attention(gemma, 2)
    assert loc.family == "gemma" and loc.changes == ()
    assert gemma.num_key_value_groups == 2 and gemma.head_dim == 8
    assert (gemma_cfg.num_attention_heads, gemma_cfg.num_key_value_heads) == (4, 2)
    with pytest.raises(ValueError, match="2 key/value heads must both be divisible by tp = 8"):
        localize_attention(GemmaAttention(gemma_cfg, layer_idx=0), 8)
    replicated = GemmaAttention(gemma_cfg, layer_idx=0)  # 2 kv heads over tp = 4: each replicated twice
    loc = localize_attention(replicated, 4)
    assert loc.changes == (("num_key_value_groups", 2, 1),) and replicated.num_key_value_groups == 1


# =============================================================================================
# Suites
# =============================================================================================

TP2_CHECKS: dict[str, Callable[[dist.ProcessGroup], None]] = {
    **{
        f"column-{kind}-fused{fused}-{'gather' if gather else 'local'}":
            (lambda g, k=kind, f=fused, ga=gather: check_column(g, k, f, ga))
        for kind in ("linear", "conv1d") for fused in (1, 3) for gather in (False, True)
    },
    "column-fused-local-order": check_fused_local_order,
    **{
        f"row-{kind}-{'parallel' if par else 'scatter'}-input":
            (lambda g, k=kind, p=par: check_row(g, k, p))
        for kind in ("linear", "conv1d") for par in (True, False)
    },
    "mlp": lambda g: check_mlp(g, False),
    "mlp-sequence-parallel": lambda g: check_mlp(g, True),
    "comm": check_comm,
    "embedding-50257-pad64": lambda g: check_embedding(g, 50257, 64),
    "embedding-padding-idx": lambda g: check_embedding(g, 30, 4, padding_idx=17),
    "embedding-all-padding-rank": lambda g: check_embedding(g, 10, 64),
    "embedding-sequence-parallel": check_embedding_sequence_parallel,
    "deepcopy": check_deepcopy,
    "cross-entropy-50257-pad64": lambda g: check_cross_entropy(g, 50257, 64),
    "cross-entropy-no-pad": lambda g: check_cross_entropy(g, 64, None),
    "cross-entropy-all-padding-rank": lambda g: check_cross_entropy(g, 10, 64),
    "tied-lm-head": check_tied_head,
    "errors": check_errors,
    "localize-attention": check_localize_attention,
    "hf-gpt2-block": check_gpt2_block,
    "hf-llama-gqa-layer": check_llama_layer,
    "hf-bert-layer": check_bert_layer,
    "hf-gpt2-lm-vocab-parallel": check_gpt2_lm,
}

TP4_CHECKS: dict[str, Callable[[dist.ProcessGroup], None]] = {
    "column-linear-fused3-gather": lambda g: check_column(g, "linear", 3, True),
    "row-linear": lambda g: check_row(g, "linear", True),
    "mlp-sequence-parallel": lambda g: check_mlp(g, True),
    "comm": check_comm,
    "embedding-50257-pad64": lambda g: check_embedding(g, 50257, 64),
    "cross-entropy-50257-pad64": lambda g: check_cross_entropy(g, 50257, 64),
}


def _run_checks(checks: dict[str, Check], group: dist.ProcessGroup, prefix: str = ""
                ) -> dict[str, str | None]:
    """Run the checks in order; per check None (passed) or why not. After a check fails on this
    rank the rest are not run here: the failure may have left the ranks at different
    collectives, and a mismatched gloo collective aborts the process (losing every report).
    Peers then fail fast on the closed connection instead."""
    out: dict[str, str | None] = {}
    failed = ""
    for name, check in checks.items():
        if failed:
            out[prefix + name] = f"not run: {failed} failed before it on this rank"
            continue
        try:
            check(group)
            out[prefix + name] = None
        except Exception:  # noqa: BLE001 -- recorded and reported per check by pytest
            out[prefix + name] = traceback.format_exc()
            failed = prefix + name
    return out


def _world() -> dist.ProcessGroup:
    group = dist.group.WORLD
    assert group is not None
    return group


def suite_tp2(rank: int, world_size: int) -> dict[str, str | None]:
    return _run_checks(TP2_CHECKS, _world())


def suite_world4(rank: int, world_size: int) -> dict[str, str | None]:
    results = _run_checks(TP4_CHECKS, _world(), "tp4/")
    # Two tp=2 groups side by side: tp rank must come from the group, not the global rank;
    # each pair runs different data.
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pair = pairs[rank // 2]
    results.update(_run_checks({"mlp": lambda g: check_mlp(g, False, seed=40 + rank // 2),
                                "mlp-sequence-parallel":
                                    lambda g: check_mlp(g, True, seed=50 + rank // 2),
                                "comm": check_comm,
                                "cross-entropy": lambda g: check_cross_entropy(g, 1001, 8)},
                               pair, "2x2/"))
    return results


@pytest.fixture(scope="module")
def tp2_results() -> list[dict[str, str | None]]:
    return run_distributed(suite_tp2, 2, timeout=SUITE_TIMEOUT_S)


@pytest.fixture(scope="module")
def world4_results() -> list[dict[str, str | None]]:
    return run_distributed(suite_world4, 4, timeout=SUITE_TIMEOUT_S)


def _assert_passed(results: list[dict[str, str | None]], name: str) -> None:
    failures = [f"--- rank {r} ---\n{res[name]}" for r, res in enumerate(results)
                if res.get(name, "check did not run") is not None]
    if failures:
        pytest.fail(f"{name} failed:\n" + "\n".join(failures), pytrace=False)


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(TP2_CHECKS))
def test_tp2(name: str, tp2_results: list[dict[str, str | None]]) -> None:
    _assert_passed(tp2_results, name)


WORLD4_NAMES = [f"tp4/{n}" for n in TP4_CHECKS] + [
    f"2x2/{n}" for n in ("mlp", "mlp-sequence-parallel", "comm", "cross-entropy")]


@pytest.mark.distributed
@pytest.mark.parametrize("name", WORLD4_NAMES)
def test_world4(name: str, world4_results: list[dict[str, str | None]]) -> None:
    _assert_passed(world4_results, name)


# =============================================================================================
# In-process tests (no process group)
# =============================================================================================


def test_padded_size() -> None:
    assert padded_size(50257, 1, 64) == 50304
    assert padded_size(50257, 8, 128 * 8) == 51200
    assert padded_size(30522, 2, None) == 30522
    with pytest.raises(ValueError, match="not divisible by tp = 4"):
        padded_size(30522, 4, None)
    with pytest.raises(ValueError, match="positive"):
        padded_size(10, 2, 0)


def test_partition_shard_merge_roundtrip() -> None:
    full = torch.arange(50257.0).view(-1, 1).repeat(1, 3)
    parts = [Partition.build(50257, r, 4, 64) for r in range(4)]
    shards = [p.shard(full, 0) for p in parts]
    assert all(s.shape == (12576, 3) for s in shards)
    assert parts[3].end == 50257 and parts[3].start == 3 * 12576
    assert torch.count_nonzero(shards[3][50257 - parts[3].start:]) == 0
    assert torch.equal(parts[0].merge(shards, 0), full)
    empty = Partition.build(10, 1, 2, 64)
    assert (empty.start, empty.end, empty.local) == (32, 32, 32)


def test_replace_module() -> None:
    root = nn.Sequential(nn.ModuleDict({"h": nn.ModuleList([nn.Linear(2, 2), nn.ReLU()])}))
    new = nn.Identity()
    old = replace_module(root, "0.h.0", new)
    assert isinstance(old, nn.Linear) and root[0]["h"][0] is new
    with pytest.raises(ValueError, match="no module"):
        replace_module(root, "0.h.5", new)
    with pytest.raises(ValueError, match="no module"):
        replace_module(root, "0.x.0", new)
    with pytest.raises(ValueError, match="empty"):
        replace_module(root, "", new)


def test_localize_attention_unknown_class() -> None:
    class MyAttention(nn.Module):
        pass

    with pytest.raises(ValueError, match="no tensor-parallel rule for attention class .*"
                                         "MyAttention; supported: .*FalconAttention"):
        localize_attention(MyAttention(), 2)


def _fail_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        raise RuntimeError("boom on rank 1")
    return rank


@pytest.mark.distributed
def test_harness_propagates_child_traceback() -> None:
    with pytest.raises(DistributedFailure, match=r"(?s)rank 1 ---.*RuntimeError: boom on rank 1"):
        run_distributed(_fail_on_rank_1, 2, timeout=SUITE_TIMEOUT_S)
