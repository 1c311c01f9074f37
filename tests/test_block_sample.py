"""The first blocks a meta trace runs for all of them (dsl/block_sample.py): which blocks are of
one kind, which traced block stands for each later one, and that an answer is copied from fewer
blocks only when it does not depend on how many ran (check's facts stay those of the whole
model; the comparison with every block traced is the test)."""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="builds modules")


def _stack(kinds: list[str]):  # a stack of blocks whose attention is "full" or "sliding" (plain attributes)
    from torch import nn

    class Attention(nn.Module):
        def __init__(self, kind: str, index: int) -> None:
            super().__init__()
            self.q = nn.Linear(4, 4)
            self.layer_idx = index  # counts the blocks: not a kind
            self.sliding_window = 8 if kind == "sliding" else None

    class Block(nn.Module):
        def __init__(self, kind: str, index: int) -> None:
            super().__init__()
            self.attn = Attention(kind, index)

    return nn.ModuleList(Block(k, i) for i, k in enumerate(kinds))


def test_blocks_alike_are_traced_twice_and_the_second_stands_for_the_rest() -> None:
    from ppdsl.dsl.block_sample import representatives

    assert representatives(_stack(["full"] * 6)) == (2, {2: 1, 3: 1, 4: 1, 5: 1})
    assert representatives(_stack(["full"] * 6), 1) == (3, {3: 2, 4: 2, 5: 2})


def test_each_kind_is_traced_twice_and_stands_on_its_own_kind() -> None:
    from ppdsl.dsl.block_sample import representatives

    alternating = ["sliding", "full"] * 4
    assert representatives(_stack(alternating)) == (4, {4: 2, 5: 3, 6: 2, 7: 3})
    # the first block of a kind is never the one copied: it computes what its kind shares once
    assert representatives(_stack(["full", "sliding", "sliding", "sliding", "full", "full"])) == (5, {5: 4})
    assert representatives(_stack(["full", "sliding", "sliding", "sliding", "sliding", "full"])) is None
    assert representatives(_stack(["full", "full", "sliding", "sliding", "sliding", "full"])) == (4, {4: 3, 5: 1})


def test_a_block_held_twice_is_traced_whole() -> None:
    from torch import nn

    from ppdsl.dsl.block_sample import representatives

    stack = _stack(["full"] * 5)
    assert representatives(nn.ModuleList([*stack, stack[0]])) is None


def test_paths_move_by_block() -> None:
    from ppdsl.dsl.block_sample import index_in, moved

    assert index_in("model.layers.3.mlp", "model.layers") == 3
    assert index_in("model.layers", "model.layers") is None and index_in("lm_head", "model.layers") is None
    assert moved("model.layers.1.mlp.down_proj", "model.layers", 9) == "model.layers.10.mlp.down_proj"
    assert moved("model.norm", "model.layers", 9) == "model.norm"


def test_an_answer_that_depends_on_the_blocks_run_comes_from_every_block() -> None:
    from ppdsl.dsl.block_sample import over_sampled_blocks

    stack = _stack(["full"] * 8)
    model = type(stack)([stack])  # the blocks at "0"
    ran: list[int] = []

    def run() -> int:
        ran.append(len(model[0]))
        return 1

    assert over_sampled_blocks(model, "0", run, lambda answer, reps: answer) == 1
    assert ran == [2, 3]  # the fewest blocks and one more agree: nothing else runs
    ran.clear()
    assert over_sampled_blocks(model, "0", lambda: len(model[0]) + 0 * run(), lambda answer, reps: answer) == 8
    assert ran == [2, 3, 8] and len(model[0]) == 8  # they disagree: every block, and the stack is whole again


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="builds an HF model")
@pytest.mark.parametrize("cls, config", [
    ("LlamaForCausalLM", dict(num_hidden_layers=10, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                              num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)),
    # sliding and full attention alternating
    ("Gemma2ForCausalLM", dict(num_hidden_layers=10, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=8, vocab_size=128, max_position_embeddings=64,
                               sliding_window=8)),
    # one activation module shared by every block (its path is block 0's): copied, it would be wrong
    ("OpenAIGPTForSequenceClassification", dict(n_layer=10, n_embd=32, n_head=4, vocab_size=128, n_positions=64,
                                                num_labels=3, pad_token_id=0)),
])
def test_the_saved_activations_are_those_of_every_block(cls: str, config: dict) -> None:
    import attrs

    from ppdsl.core.build import build
    from ppdsl.dsl.saved_activations import trace_saved

    def traced(blocks: str) -> tuple:
        model, full = build("hf", cls, config, "meta", ())
        layers = [p for p, m in model.named_modules() if type(m).__name__ in ("Linear", "Embedding", "Conv1D")]
        return attrs.astuple(trace_saved(model, {**full, **config}, layers, 0, blocks))

    path = "transformer.h" if cls.startswith("OpenAI") else "model.layers"
    assert traced(path) == traced("")


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="builds an HF model")
@pytest.mark.parametrize("cls, config, blocks, rules", [
    ("LlamaForCausalLM", dict(num_hidden_layers=10, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                              num_key_value_heads=2, vocab_size=128, max_position_embeddings=64),
     "model.layers", {"self_attn.q_proj": "column", "self_attn.k_proj": "column", "self_attn.v_proj": "column",
                      "self_attn.o_proj": "row", "mlp.up_proj": "column", "mlp.gate_proj": "column",
                      "mlp.down_proj": "row"}),
    # CodeGen views qkv_proj's output as a constant 4 groups: refused (kind "groups") either way
    ("CodeGenForCausalLM", dict(n_embd=64, n_head=4, n_layer=10, rotary_dim=8, vocab_size=128, n_positions=64),
     "transformer.h", {"attn.qkv_proj": "column", "attn.out_proj": "row"}),
    # the same, split from block 3 on only: blocks alike but split differently are not of one kind
    # (else blocks 0 to 2, whole, would stand for all, and nothing would be refused)
    ("CodeGenForCausalLM", dict(n_embd=64, n_head=4, n_layer=12, rotary_dim=8, vocab_size=128, n_positions=64),
     "transformer.h", {"attn.qkv_proj": "column", "attn.out_proj": "row", "from": 3}),
])
def test_the_tp_proof_over_the_first_blocks_is_that_over_every_block(cls: str, config: dict, blocks: str,
                                                                      rules: dict) -> None:
    import ppdsl.dsl.block_sample as sample
    from ppdsl.core.build import build, quiet_transformers
    from ppdsl.dsl.own_tp_proof import LayerSplit, prove_local_shapes

    def proved(sampled: bool) -> tuple:
        model, _ = build("hf", cls, config, "meta", ())
        splits = {f"{blocks}.{i}.{path}": LayerSplit(style, False, (), None)
                  for i in range(rules.get("from", 0), config.get("n_layer", config.get("num_hidden_layers")))
                  for path, style in rules.items() if path != "from"}
        local: list = []
        kept = []
        real = sample.first_blocks

        def spied(stack, n):  # noqa: ANN001, ANN202
            kept.append(n)
            return real(stack, n)

        sample.first_blocks = spied
        if not sampled:
            sample.representatives, saved = (lambda *a, **k: None), sample.representatives
        try:
            with quiet_transformers():
                found = prove_local_shapes(model, blocks, splits, 2, 16, None, (), True, local)
        finally:
            sample.first_blocks = real
            if not sampled:
                sample.representatives = saved
        return repr(found), local, bool(kept)

    found, local, ran_sampled = proved(True)
    assert (found, local) == proved(False)[:2]
    assert ran_sampled  # the first blocks ran
    assert (found == "None") == cls.startswith("Llama") and ("groups" in found) == cls.startswith("CodeGen")


def test_a_forward_that_changes_the_model_is_run_over_every_block_on_the_model_as_it_was() -> None:
    from ppdsl.dsl.block_sample import over_sampled_blocks

    stack = _stack(["full"] * 8)
    model = type(stack)([stack])

    def run() -> int:  # as BigBird's: its first short input switches the attention of the blocks it holds
        switched = [b.attn.sliding_window for b in model[0]]
        for b in model[0]:
            b.attn.sliding_window = 4
        return len(switched) + 100 * switched.count(4)

    # the sampled forwards changed blocks 0-2 only: undone, then every block runs on the model as built
    assert over_sampled_blocks(model, "0", run, lambda answer, reps: answer % 100) == 8
    assert [b.attn.sliding_window for b in stack] == [4] * 8


def test_an_incomplete_answer_comes_from_every_block() -> None:
    from ppdsl.dsl.block_sample import over_sampled_blocks

    stack = _stack(["full"] * 8)
    model = type(stack)([stack])
    ran: list[int] = []

    def run() -> int:
        ran.append(len(model[0]))
        return len(model[0])

    assert over_sampled_blocks(model, "0", run, lambda answer, reps: 0, complete=lambda answer: answer > 0) == 8
    assert ran == [2, 3, 8]


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="builds an HF model")
def test_what_a_backward_recomputes_is_not_saved_by_the_forward() -> None:
    """Reformer's reversible blocks recompute their forward under grad in backward: what that saves
    lives only while the backward runs (the head's producer never reaches a block's saved tensors)."""
    from ppdsl.core.build import build, quiet_transformers
    from ppdsl.dsl.saved_activations import trace_saved

    config = dict(attn_layers=["local"] * 6, hidden_size=32, feed_forward_size=64, num_attention_heads=4,
                  attention_head_size=8, vocab_size=128, max_position_embeddings=64, axial_pos_embds=False,
                  local_attn_chunk_length=16, is_decoder=True, hidden_dropout_prob=0.0,
                  local_attention_probs_dropout_prob=0.0, lsh_attention_probs_dropout_prob=0.0, pad_token_id=0)
    model, full = build("hf", "ReformerModelWithLMHead", config, "meta", ())
    layers = [p for p, m in model.named_modules() if type(m).__name__ in ("Linear", "Embedding")]
    with quiet_transformers():
        saved = trace_saved(model, {**full, **config}, layers, 0)
    assert saved.groups and not [g for g in saved.groups if g.module.startswith("reformer.encoder.layers.")
                                 and g.producer.startswith("lm_head")]
