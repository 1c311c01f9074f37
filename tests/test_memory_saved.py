"""The activation term of each rank's memory (issue 34, item 1): check's meta trace of what a
training forward saves for backward (dsl/saved_activations.py) and lowering's arithmetic on it
(`lowering.rank_memory.activation_bytes`).

The arithmetic tests are pure Python (a plan from a spec checked without its model, a hand-made
trace); the trace tests build a tiny Llama (on meta, then on CPU for the measurement).
"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest

from ppdsl.dsl.check import check_text
from ppdsl.dsl.saved_activations import LOSS, SavedActivations, SavedGroup, trace_lengths
from ppdsl.lowering.lower import lower
from ppdsl.lowering.rank_memory import activation_bytes

needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None or
                                 importlib.util.find_spec("transformers") is None, reason="runs the model")

SPEC = """ppspec 1
model gemma {
  source = hf("GemmaForCausalLM")
  config { num_hidden_layers = 4, hidden_size = 64, intermediate_size = 128, num_attention_heads = 4,
           num_key_value_heads = 4, head_dim = 16, vocab_size = 256, max_position_embeddings = 256 }
}
mesh { tp = TP, pp = 2 }
tensor_parallel {
  model.layers[*].self_attn.q_proj : column
  model.layers[*].self_attn.o_proj : row
}
pipeline { style = 1f1b, microbatches = 4, blocks = model.layers, first = [model.embed_tokens], last = [model.norm, lm_head] }
train { global_batch = 8, seq_len = 32, activation_checkpointing = AC }
"""
HIDDEN = 64


def _plan(tp: int = 1, ac: bool = False, sets: tuple[str, ...] = ()) -> object:
    r = check_text(SPEC.replace("TP", str(tp)).replace("AC", str(ac).lower()), world=2 * tp, overrides=list(sets),
                   model=False)
    assert r.ok, r.diagnostics
    return lower(r.spec, 2 * tp, None)


def _trace(per_block: dict[str, tuple[int, int]], roots: dict[tuple[str, str], tuple[int, int]] = {}) -> SimpleNamespace:
    """A trace at lengths (16, 32): the same groups in each of the 4 blocks, plus `roots`."""
    groups = [SavedGroup(f"model.layers.{i}.{m}", p.replace("#", str(i)), *b)
              for i in range(4) for key, b in per_block.items() for m, p in [key.split("|")]]
    groups += [SavedGroup(m, p, *b) for (m, p), b in roots.items()]
    return SimpleNamespace(saved=SavedActivations((16, 32), tuple(groups)))


def test_the_fit_goes_through_both_traced_points() -> None:
    # 3 s + 2 s^2 bytes: 800 at 16, 2144 at 32
    trace = SavedActivations((16, 32), (SavedGroup("m", "", 3 * 16 + 2 * 256, 3 * 32 + 2 * 1024),))
    assert trace.bytes_at(trace.groups, 1, 16) == pytest.approx(560)
    assert trace.bytes_at(trace.groups, 2, 100) == pytest.approx(2 * (300 + 20_000))


def test_trace_lengths_stay_within_the_model_positions() -> None:
    assert trace_lengths({"max_position_embeddings": 2048}) == (64, 128)
    assert trace_lengths({"n_positions": 40}) == (20, 40)
    assert trace_lengths({}) == (64, 128)


def test_a_rank_holds_its_stages_parts_times_its_microbatches_in_flight() -> None:
    plan = _plan()
    # 1 KiB per token in each block, linear; the embedding 100 B and the loss 1000 B per token
    info = _trace({"mlp|": (16 * 1024, 32 * 1024)},
                  {("model.embed_tokens", ""): (1600, 3200), (LOSS, "lm_head"): (16_000, 32_000)})
    b, s = plan.train.microbatch_size, plan.train.seq_len
    first, last = plan.stages_of(0), plan.stages_of(1)
    assert activation_bytes(plan, info, first, 3, HIDDEN) == 3 * b * s * (2 * 1024 + 100)
    assert activation_bytes(plan, info, last, 1, HIDDEN) == b * s * (2 * 1024 + 1000)


def test_tp_divides_only_what_a_column_split_layer_produced() -> None:
    info = _trace({"self_attn|model.layers.#.self_attn.q_proj": (1600, 3200),  # split over tp
                   "input_layernorm|": (1600, 3200)})  # the residual stream: whole
    one, two = _plan(1), _plan(2)
    b, s = one.train.microbatch_size, one.train.seq_len
    assert activation_bytes(one, info, one.stages_of(0), 1, HIDDEN) == 2 * b * s * (100 + 100)
    assert activation_bytes(two, info, two.stages_of(0), 1, HIDDEN) == 2 * b * s * (50 + 100)


def test_the_square_term_follows_the_sequence() -> None:
    info = _trace({"self_attn|": (256, 1024)})  # s^2 bytes per block
    plan = _plan(sets=("train.seq_len=64",))
    assert activation_bytes(plan, info, plan.stages_of(0), 1, HIDDEN) == 2 * plan.train.microbatch_size * 64 * 64


def test_a_checkpointed_block_keeps_its_input_and_one_block_recomputes() -> None:
    info = _trace({"mlp|": (16 * 1024, 32 * 1024)})
    plan = _plan(ac=True)
    b, s = plan.train.microbatch_size, plan.train.seq_len
    inputs = 2 * b * s * HIDDEN * 4  # two blocks' inputs, fp32
    assert activation_bytes(plan, info, plan.stages_of(0), 3, HIDDEN) == 3 * inputs + b * s * 1024


def test_without_a_trace_the_formula_stays() -> None:
    plan = _plan()
    b, s = plan.train.microbatch_size, plan.train.seq_len
    assert activation_bytes(plan, None, plan.stages_of(0), 2, HIDDEN) == 2 * 2 * 34 * b * s * HIDDEN


@needs_torch
@pytest.mark.slow
def test_the_meta_trace_matches_what_a_cpu_forward_keeps() -> None:
    """A tiny Llama's forward and loss on CPU: the bytes its graph keeps alive once the forward is
    done (counted by allocation, not by the saved-tensor hooks) against the meta trace's figure."""
    import weakref

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    from ppdsl.core.build import build
    from ppdsl.core.task_loss import causal_lm_loss
    from ppdsl.dsl.introspect import introspect

    config = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 176, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 512}
    info = introspect("hf", "LlamaForCausalLM", config, dataflow=True)
    assert info.saved is not None, info.saved_error
    batch, seq = 2, 200  # neither traced length: the fit is used
    traced = info.saved.bytes_at(info.saved.groups, batch, seq)

    class Live(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.live, self.refs = 0, {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and (st := t.untyped_storage()).data_ptr() not in self.refs:
                    key, n = st.data_ptr(), st.nbytes()
                    self.live += n
                    self.refs[key] = weakref.ref(st, lambda _, k=key, n=n: self._free(k, n))
            return out

        def _free(self, key: int, n: int) -> None:
            if self.refs.pop(key, None) is not None:
                self.live -= n

    torch.manual_seed(0)
    model, _ = build("hf", "LlamaForCausalLM", config, "cpu", [])
    model.train()
    ids = torch.randint(0, 512, (batch, seq))
    mode = Live()
    with mode:
        logits = model(input_ids=ids, use_cache=False).logits
        loss = causal_lm_loss(logits, ids)
        del logits
    kept = mode.live
    assert loss.requires_grad
    print(f"traced {traced:.0f} B, kept {kept} B")
    assert abs(traced - kept) <= 0.1 * kept, (traced, kept)


@needs_torch
def test_the_trace_round_trips_through_the_model_facts_cache_and_old_entries_are_not_read() -> None:
    import json

    from ppdsl.dsl.introspect import introspect
    from ppdsl.dsl.model_facts_cache import FORMAT, SUBDIR, info_from_json, info_to_json

    info = introspect("hf", "LlamaForCausalLM", {"num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64,
                                                 "num_attention_heads": 2, "vocab_size": 64}, dataflow=True)
    assert info.saved is not None and info.saved.groups
    data = json.loads(json.dumps(info_to_json(info)))
    assert info_from_json(data) == info
    assert FORMAT >= 3 and SUBDIR.endswith(str(FORMAT))  # a format-2 entry lives elsewhere and is keyed apart
    del data["saved"]
    with pytest.raises(KeyError):  # an entry written without the trace is rebuilt, never read as "no trace"
        info_from_json(data)


def test_the_largest_temporary_of_the_rank_counts_once() -> None:
    plan = _plan()
    trace = _trace({"mlp|": (16 * 1024, 32 * 1024)}).saved
    temps = (SavedGroup("model.layers.0.mlp", "", 1600, 3200), SavedGroup("model.layers.3.mlp", "", 3200, 6400),
             SavedGroup(LOSS, "", 16_000, 32_000))
    info = SimpleNamespace(saved=SavedActivations(trace.lengths, trace.groups, temps))
    b, s = plan.train.microbatch_size, plan.train.seq_len
    saved = 2 * b * s * 1024
    assert activation_bytes(plan, info, plan.stages_of(0), 1, HIDDEN) == saved + b * s * 100  # block 0's
    assert activation_bytes(plan, info, plan.stages_of(1), 1, HIDDEN) == saved + b * s * 1000  # the loss's
