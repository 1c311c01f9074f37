"""The plan's JSON round trip is exact: ``Plan.from_json(plan.to_json()) == plan``, list-valued
config entries included (lowering holds them as tuples; JSON turns them into arrays)."""

from __future__ import annotations

import functools
import json

import attrs

from ppdsl.dsl.check import check_text
from ppdsl.lowering.lower import lower
from ppdsl.lowering.plan import DataPlan, Plan

SPEC = """ppspec 1
model bert {
  source = hf("BertForSequenceClassification")
  config { vocab_size = 128, hidden_size = 32, num_hidden_layers = 4, num_attention_heads = 4,
           intermediate_size = 64, max_position_embeddings = 16, num_labels = 2,
           architectures = ["BertForSequenceClassification"], nested = [[1, 2], [3, "x"], []] }
}
mesh { tp = 2, pp = 2 }
pipeline { style = 1f1b, microbatches = 4 }
train { global_batch = 4, seq_len = 16 }
"""


def _plan() -> Plan:
    result = check_text(SPEC, "t.ppspec", world=4)
    assert result.ok, result.diagnostics
    return lower(result.spec, 4)


def _round_trip(plan: Plan) -> Plan:
    return Plan.from_json(json.loads(json.dumps(plan.to_json())))


def test_lowering_holds_list_config_values_as_tuples() -> None:
    config = _plan().model.config_dict
    assert config["architectures"] == ("BertForSequenceClassification",)
    assert config["nested"] == ((1, 2), (3, "x"), ())


def test_round_trip_with_list_config_values_is_exact_and_hashable() -> None:
    plan = _plan()
    again = _round_trip(plan)
    assert again == plan
    assert again.model.config_dict["architectures"] == ("BertForSequenceClassification",)
    assert again.model.config_dict["nested"] == ((1, 2), (3, "x"), ())
    assert hash(again) == hash(plan)  # the runtime caches per plan (functools.lru_cache)
    assert functools.lru_cache(maxsize=1)(lambda p: p.mesh.world)(again) == 4
    assert _round_trip(again) == plan and again.to_json() == plan.to_json()


def test_round_trip_keeps_scalar_options() -> None:
    plan = _plan()
    data = DataPlan(kind="jsonl", options=(("label", "label"), ("path", "x.jsonl"), ("seed", 3)))
    plan = attrs.evolve(plan, train=attrs.evolve(plan.train, data=data))
    assert _round_trip(plan) == plan
