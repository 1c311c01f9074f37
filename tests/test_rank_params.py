"""`ppdsl plan`'s parameters per rank (lowering/rank_params.py) are what the runtime holds.

Each rank of a spawned gloo world builds its stages as `ppdsl run` does and counts the elements
of its parameters (a tied one once); the plan's `params` column must equal it: a tied head's copy
on the last stage (GPT-2's lm_head), column / vocab layers at 1/tp of the rows, row layers with
the whole bias, a layer whose key / value head is replicated whole (a family's Llama, the own
forward's multi-query GPTBigCode), norms and position embeddings whole.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")

GPT2 = """ppspec 1
model gpt2 {
  source = hf("GPT2LMHeadModel")
  config { n_layer = 4, n_embd = 64, n_head = 4, vocab_size = 128, n_positions = 32 }
}
mesh { tp = 2, pp = 2 }
tensor_parallel {
  transformer.wte : vocab
  lm_head : column
  transformer.h[*].attn.c_attn : column(fused = 3)
  transformer.h[*].attn.c_proj : row
  transformer.h[*].mlp.c_fc : column
  transformer.h[*].mlp.c_proj : row
}
pipeline { style = 1f1b, microbatches = 2 }
train { global_batch = 4, seq_len = 16, steps = 1, optimizer = sgd(lr = 0.1) }
"""

LLAMA_ONE_KV_HEAD = """ppspec 1
model llama {
  source = hf("LlamaForCausalLM")
  config { num_hidden_layers = 4, hidden_size = 32, intermediate_size = 64, num_attention_heads = 4,
           num_key_value_heads = 1, vocab_size = 128, max_position_embeddings = 64, tie_word_embeddings = false }
}
mesh { tp = 2, pp = 2 }
tensor_parallel {
  model.embed_tokens : vocab
  model.layers[*].self_attn.q_proj : column
  model.layers[*].self_attn.k_proj : column
  model.layers[*].self_attn.v_proj : column
  model.layers[*].self_attn.o_proj : row
  model.layers[*].mlp.gate_proj : column
  model.layers[*].mlp.up_proj : column
  model.layers[*].mlp.down_proj : row
  lm_head : column
}
pipeline { style = interleaved, chunks = 2, microbatches = 4 }
train { global_batch = 4, seq_len = 16, steps = 1, optimizer = sgd(lr = 0.1) }
"""

# its own forward (no family): one fused c_attn of 64 query + 8 key + 8 value features, the kv head replicated
BIGCODE_MULTI_QUERY = """ppspec 1
model bigcode {
  source = hf("GPTBigCodeForCausalLM")
  config { vocab_size = 128, n_embd = 64, n_layer = 4, n_head = 8, n_positions = 64, multi_query = true }
}
mesh { tp = 2, pp = 2 }
tensor_parallel {
  transformer.h[*].attn.c_attn : column(fused = 3)
  transformer.h[*].attn.c_proj : row
  transformer.h[*].mlp.c_fc : column
  transformer.h[*].mlp.c_proj : row
}
pipeline { style = 1f1b, microbatches = 2 }
train { global_batch = 4, seq_len = 16, steps = 1, optimizer = sgd(lr = 0.1) }
"""

SPECS = {"gpt2_tied": GPT2, "llama_one_kv_head": LLAMA_ONE_KV_HEAD, "bigcode_multi_query": BIGCODE_MULTI_QUERY}


def _planned(tmp_path: Path) -> list[tuple[str, dict[str, Any], list[int]]]:
    from ppdsl.dsl.check import check_file
    from ppdsl.lowering.lower import lower
    from ppdsl.views.report import plan_report

    out = []
    for name, text in SPECS.items():
        path = tmp_path / f"{name}.ppspec"
        path.write_text(text, encoding="utf-8")
        result = check_file(path, world=4)
        assert result.ok, (name, [f"{d.code} {d.message}" for d in result.diagnostics])
        plan = lower(result.spec, 4, result.model_info)
        out.append((name, plan.to_json(), [row.params for row in plan_report(plan, result.model_info).rows]))
    return out


def held_worker(rank: int, world: int, plans: list[tuple[str, dict[str, Any], list[int]]]) -> dict[str, int]:
    import torch

    from ppdsl.lowering.plan import Plan
    from ppdsl.runtime.parallel.groups import build_process_groups, tie_pp_ranks_of
    from ppdsl.runtime.parallel.parallelize import parallelize
    from ppdsl.runtime.stage.build import build_stages

    held = {}
    for name, data, _ in plans:
        plan = Plan.from_json(data)
        groups = build_process_groups(plan.mesh, "cpu", tie_pp_ranks_of(plan.schedule.stage_ranks))
        stages = build_stages(plan, groups.pp_rank, torch.device("cpu"), 0)
        parallelize(stages, plan, groups, torch.device("cpu"))
        params = {id(p): p.numel() for s in stages for p in s.parameters()}
        held[name] = sum(params.values())
    return held


@pytest.mark.distributed
def test_the_plan_counts_what_each_rank_holds(tmp_path: Path) -> None:
    from dist_harness import run_distributed

    plans = _planned(tmp_path)
    held = run_distributed(held_worker, 4, plans, timeout=240)
    for name, _, predicted in plans:
        assert predicted == [held[rank][name] for rank in range(4)], name
