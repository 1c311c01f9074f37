"""The plan's JSON round trip is exact: ``Plan.from_json(plan.to_json()) == plan``, list-valued
config entries included (lowering holds them as tuples; JSON turns them into arrays)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

from ppdsl.dsl.check import check_file, check_text
from ppdsl.lowering.lower import lower
from ppdsl.lowering.plan import Plan

SPEC = """ppspec 1
model gemma {
  source = hf("GemmaForCausalLM")
  config { vocab_size = 128, hidden_size = 32, num_hidden_layers = 4, num_attention_heads = 4,
           num_key_value_heads = 2, head_dim = 8, intermediate_size = 64, max_position_embeddings = 16,
           architectures = ["GemmaForCausalLM"], nested = [[1, 2], [3, "x"], []] }
}
mesh { tp = 2, pp = 2 }
pipeline { style = 1f1b, microbatches = 4 }
train { global_batch = 4, seq_len = 16 }
"""

TOKENS_SPEC = """ppspec 1
model decoder {
  source = python("ppdsl.models.decoder:build_decoder")
  config { vocab_size = 128, dim = 32, n_layers = 2, n_heads = 4, max_seq_len = 16 }
}
train { global_batch = 4, seq_len = 16, data = tokens("t.bin", dtype = "uint16", seed = 3) }
"""


def _plan() -> Plan:
    result = check_text(SPEC, "t.ppspec", world=4)
    assert result.ok, result.diagnostics
    return lower(result.spec, 4)


def _round_trip(plan: Plan) -> Plan:
    return Plan.from_json(json.loads(json.dumps(plan.to_json())))


def test_lowering_holds_list_config_values_as_tuples() -> None:
    config = _plan().model.config_dict
    assert config["architectures"] == ("GemmaForCausalLM",)
    assert config["nested"] == ((1, 2), (3, "x"), ())


def test_round_trip_with_list_config_values_is_exact_and_hashable() -> None:
    plan = _plan()
    again = _round_trip(plan)
    assert again == plan
    assert again.model.config_dict["architectures"] == ("GemmaForCausalLM",)
    assert again.model.config_dict["nested"] == ((1, 2), (3, "x"), ())
    assert hash(again) == hash(plan)  # the runtime caches per plan (functools.lru_cache)
    assert functools.lru_cache(maxsize=1)(lambda p: p.mesh.world)(again) == 4
    assert _round_trip(again) == plan and again.to_json() == plan.to_json()


def test_round_trip_keeps_scalar_options(tmp_path: Path) -> None:
    (tmp_path / "t.bin").write_bytes(bytes(2 * 4 * 16))  # one global batch of uint16 ids
    spec = tmp_path / "t.ppspec"
    spec.write_text(TOKENS_SPEC, encoding="utf-8")
    result = check_file(spec, world=1, model=False)
    assert result.ok, result.diagnostics
    plan = lower(result.spec, 1)
    assert plan.train.data.options_dict == {"dtype": "uint16", "path": str(tmp_path / "t.bin"), "seed": 3}
    assert _round_trip(plan) == plan


def test_the_plan_says_microbatches_once_and_reads_an_older_plan_json() -> None:
    # the schedule holds the count; a plan.json written before kept a copy in its train part
    plan = _plan()
    data = json.loads(json.dumps(plan.to_json()))
    assert data["schedule"]["microbatches"] == 4 and "microbatches" not in data["train"]
    older = {**data, "train": {**data["train"], "microbatches": 4}}
    assert Plan.from_json(older) == plan
    assert plan.replica_batch == plan.train.microbatch_size * plan.schedule.microbatches == 4


def test_a_checkpoint_fingerprint_keeps_its_microbatches_entry() -> None:
    # checkpoints written before compare their fingerprint's "microbatches" with the plan's
    from ppdsl.runtime.checkpoint.resume import fingerprint

    plan = _plan()
    assert fingerprint(plan)["microbatches"] == plan.schedule.microbatches == 4
    assert fingerprint(Plan.from_json(json.loads(json.dumps(plan.to_json())))) == fingerprint(plan)
