"""The traced data path behind the tensor-parallel pairing rules (ppdsl.dsl.tp_dataflow), and
check's fallback when a forward cannot be traced. Fast: meta tensors only."""

from __future__ import annotations

import attrs
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from ppdsl.dsl.check import load_text  # noqa: E402
from ppdsl.dsl.introspect import describe, introspect  # noqa: E402
from ppdsl.dsl.model_check import check_model  # noqa: E402
from ppdsl.dsl.tp_dataflow import trace_dataflow  # noqa: E402


class FusedBlock(nn.Module):
    """A hand-written attention with one fused q|k|v projection, chunked by its forward."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        return x + self.out(torch.softmax(q @ k.transpose(-1, -2), -1) @ v)


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 32)
        self.layers = nn.ModuleList([FusedBlock(), FusedBlock()])
        self.head = nn.Linear(32, 16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def _layers(model: nn.Module) -> list[str]:
    return [p for p, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))]


def test_producers_fused_parts_and_outputs_of_a_hand_written_model() -> None:
    with torch.device("meta"):
        model = Tiny()
    norms = [p for p, m in model.named_modules() if isinstance(m, nn.LayerNorm)]
    flow = trace_dataflow(model, {}, _layers(model), watched=norms)
    assert flow.producers["layers.0.qkv"] == {"emb"}
    assert flow.producers["layers.0.out"] == {"layers.0.qkv"}
    assert flow.producers["layers.1.qkv"] == {"emb", "layers.0.out"}
    assert flow.producers["layers.1.norm"] == {"emb", "layers.0.out"}
    assert flow.fused_parts == {"layers.0.qkv": 3, "layers.1.qkv": 3}  # read from the chunk, not a table
    assert flow.outputs == {"head"}
    assert flow.watched == set(norms)
    assert set(flow.consumers("layers.0.out")) == {"layers.1.qkv", "layers.1.norm", "head"}


def test_gpt2_c_attn_is_three_fused_parts() -> None:
    info = introspect("hf", "GPT2LMHeadModel", {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 128,
                                                 "n_positions": 32}, dataflow=True)
    assert info.dataflow is not None, info.dataflow_error
    assert info.dataflow.fused_parts == {"transformer.h.0.attn.c_attn": 3, "transformer.h.1.attn.c_attn": 3}
    assert info.dataflow.producers["transformer.h.0.attn.c_proj"] == {"transformer.h.0.attn.c_attn"}


def test_multi_query_c_attn_is_three_unequal_parts() -> None:
    """GPTBigCode's multi-query attention splits c_attn's output (unsqueezed first) into q, one key
    and one value head: widths 32, 8, 8, which no equal split could divide (dsl/kv_parts.py)."""
    info = introspect("hf", "GPTBigCodeForCausalLM", {"n_layer": 2, "n_embd": 32, "n_head": 4, "vocab_size": 128,
                                                       "n_positions": 32, "multi_query": True}, dataflow=True)
    assert info.dataflow is not None, info.dataflow_error
    assert info.dataflow.part_widths == {f"transformer.h.{i}.attn.c_attn": (32, 8, 8) for i in range(2)}
    assert "transformer.h.0.attn.c_attn" not in info.dataflow.fused_parts
    assert info.modules["transformer.h.0.attn"].head_dim == 8


def test_a_width_viewed_as_three_parts_and_unbound_is_fused() -> None:
    """ModernBERT's Wqkv: viewed as (..., 3, heads, head_dim) and unbound along the 3 (5.x), or
    transposed first (4.x): three fused parts; its MLP's Wi is chunked in two."""
    info = introspect("hf", "ModernBertForSequenceClassification",
                      {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                       "num_attention_heads": 4, "max_position_embeddings": 64, "pad_token_id": 0}, dataflow=True)
    assert info.dataflow is not None, info.dataflow_error
    parts = info.dataflow.fused_parts
    assert parts["model.layers.0.attn.Wqkv"] == 3 and parts["model.layers.1.mlp.Wi"] == 2, parts


def _spec(rules: str, source: str = 'hf("GPT2LMHeadModel")',
          config: str = "n_layer = 2, n_embd = 64, n_head = 4, vocab_size = 128, n_positions = 32") -> object:
    text = f"""ppspec 1
model m {{
  source = {source}
  config {{ {config} }}
}}
mesh {{
  tp = 2
  pp = 1
}}
tensor_parallel {{
{rules}
}}
train {{
  global_batch = 4
  seq_len = 16
}}
"""
    spec, diags, _ = load_text(text, "<t>")
    assert spec is not None, diags
    return spec


def test_without_a_trace_pairing_falls_back_to_blocks_and_the_family_table() -> None:
    """A forward that cannot run on meta: N0219, per-block pairing, fused from the family table
    (Phi-3's: qkv_proj holds three parts)."""
    config = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
              "num_key_value_heads": 4, "vocab_size": 128, "max_position_embeddings": 32,
              "pad_token_id": 0}
    info = introspect("hf", "Phi3ForCausalLM", config)
    info = attrs.evolve(info, dataflow=None, dataflow_error="RuntimeError: no values on meta")

    def phi3(rules: str) -> object:
        return _spec(rules, 'hf("Phi3ForCausalLM")', ", ".join(f"{k} = {v}" for k, v in config.items()))

    codes = [d.code for d in check_model(phi3("  model.layers[*].mlp.gate_up_proj : column(fused = 2)"), info)]
    assert codes == ["N0219", "E0219"]
    codes = [d.code for d in check_model(phi3("  model.layers[*].self_attn.qkv_proj : column\n"
                                              "  model.layers[*].self_attn.o_proj : row"), info)]
    assert codes == ["N0219", "E0221"]


def test_a_forward_that_fails_leaves_the_reason() -> None:
    class NeedsMask(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(8, 4)

        def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return self.emb(ids) * mask

    with torch.device("meta"):
        model = NeedsMask()
    with pytest.raises(TypeError):
        trace_dataflow(model, {}, ["emb"])
    assert describe(model).dataflow is None


class PerHeadNormBlock(nn.Module):
    """Qwen3-style attention: q and k normalised per head (over head_dim), after the projection."""

    def __init__(self, dim: int = 32, heads: int = 4, full_width_norm: bool = False) -> None:
        super().__init__()
        self.heads, self.full = heads, full_width_norm
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        width = dim if full_width_norm else dim // heads
        self.q_norm, self.k_norm = nn.LayerNorm(width), nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        if self.full:
            q, k = self.q_norm(self.q(x)), self.k_norm(self.k(x))
            q, k = q.view(b, s, self.heads, -1), k.view(b, s, self.heads, -1)
        else:
            q = self.q_norm(self.q(x).view(b, s, self.heads, -1))
            k = self.k_norm(self.k(x).view(b, s, self.heads, -1))
        v = self.v(x).view(b, s, self.heads, -1)
        att = torch.softmax(q.transpose(1, 2) @ k.transpose(1, 2).transpose(-1, -2), -1) @ v.transpose(1, 2)
        return x + self.o(att.transpose(1, 2).reshape(b, s, d))


@pytest.mark.parametrize("full_width_norm", [False, True])
def test_a_norm_within_a_head_takes_a_split_by_heads_a_full_width_one_does_not(full_width_norm: bool) -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Embedding(16, 32), PerHeadNormBlock(full_width_norm=full_width_norm))
    norms = [p for p, m in model.named_modules() if isinstance(m, nn.LayerNorm)]
    flow = trace_dataflow(model, {}, _layers(model), watched=norms)
    if full_width_norm:
        assert flow.watched == {"1.q_norm", "1.k_norm"} and flow.producers["1.q_norm"] == {"1.q"}
    else:  # per-head: not a consumer of the split, so q/k column -> o row pairs as usual
        assert flow.watched == frozenset() and "1.q_norm" not in flow.producers
        assert flow.producers["1.o"] == {"1.q", "1.k", "1.v"}


def test_a_replicated_kv_head_is_whole_only_for_a_consumer_in_its_own_module() -> None:
    """One kv head kept whole on every rank (`kv_parts`): the k_norm of its attention takes it
    whole (its gradients are summed over tp with the projection's); a column-split consumer, or a
    whole one elsewhere, would see the projection's gradient summed twice: still E0219."""
    from ppdsl.dsl.spec import TpRule
    from ppdsl.dsl.tp_dataflow import DataFlow
    from ppdsl.dsl.tp_pairing import check_pairing

    column, row = TpRule((), "k_proj : column", "column"), TpRule((), "o_proj : row", "row")
    attn = "layers.0.attn"

    def codes(consumer: str, consumer_rule: TpRule | None) -> list[str]:
        effective = {f"{attn}.k_proj": column, f"{attn}.o_proj": row}
        if consumer_rule is not None:
            effective[consumer] = consumer_rule
        flow = DataFlow({consumer: frozenset({f"{attn}.k_proj"}), f"{attn}.o_proj": frozenset({f"{attn}.k_proj"})},
                        {}, frozenset(), watched=frozenset({consumer}))
        return [d.code for d in check_pairing(effective, flow, replicated=frozenset({f"{attn}.k_proj"}))]

    assert codes(f"{attn}.k_norm", None) == []
    assert codes(f"{attn}.k_norm", TpRule((), "k_norm : replicate", "replicate")) == []
    assert codes("layers.0.mlp_norm", None) == ["E0219"]  # outside the attention module
    assert codes(f"{attn}.k_up", TpRule((), "k_up : column", "column")) == ["E0219"]
