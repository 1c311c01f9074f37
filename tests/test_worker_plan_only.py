"""A worker reads the plan, never the spec: given only a plan's JSON, with check's modules
(ppdsl.dsl) unimportable, it builds its stages and runs them, and they compute what the whole
model computes. Two models: one running its own forward (the traced layout comes in the plan),
one python factory (the generic family)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

QWEN2 = """ppspec 1
model tiny {
  source = hf("Qwen2ForCausalLM")
  config { vocab_size = 128, hidden_size = 32, intermediate_size = 64, num_hidden_layers = 4,
           num_attention_heads = 4, num_key_value_heads = 2, max_position_embeddings = 64 }
}
mesh { pp = 2 }
pipeline { style = 1f1b, microbatches = 2 }
train { global_batch = 2, seq_len = 16, steps = 1, optimizer = sgd(lr = 0.1), data = synthetic(seed = 0) }
"""
DECODER = """ppspec 1
model tiny {
  source = python("ppdsl.models.decoder:build_decoder")
  config { vocab_size = 128, dim = 32, n_layers = 4, n_heads = 4, max_seq_len = 64 }
}
mesh { pp = 2 }
pipeline { style = 1f1b, microbatches = 2, blocks = layers, first = [tok_embeddings, pos_embeddings], last = [norm, output] }
train { global_batch = 2, seq_len = 16, steps = 1, optimizer = sgd(lr = 0.1), data = synthetic(seed = 0) }
"""

# the worker: ppdsl.dsl refused at import, the plan read from JSON, both pipeline ranks' stages
# built and chained, their loss compared with the whole model's
WORKER = r"""
import importlib.abc, json, sys

class NoCheck(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "ppdsl.dsl" or name.startswith("ppdsl.dsl."):
            raise ImportError(f"a worker imported check's module {name}")
        return None

sys.meta_path.insert(0, NoCheck())
import torch
from ppdsl.lowering.plan import Plan
from ppdsl.runtime.data.source import make_data
from ppdsl.runtime.verify.reference_loss import reference_loss
from ppdsl.runtime.stage.build import build_reference_model, build_stages

plan = Plan.from_json(json.load(open(sys.argv[1])))
stages = [s for rank in range(plan.mesh.pp) for s in build_stages(plan, rank, torch.device("cpu"), plan.train.seed)]
mb = make_data(plan).microbatches(0, 0)[0]
x = None
with torch.no_grad():
    ordered = sorted(stages, key=lambda s: s.stage)
    for stage in ordered:
        x = stage(x, mb)
    x = ordered[-1].loss(x, mb)
    whole = reference_loss(plan, build_reference_model(plan.model, torch.device("cpu"), plan.train.seed), mb)
assert not any(m == "ppdsl.dsl" or m.startswith("ppdsl.dsl.") for m in sys.modules)
print(json.dumps({"stages": len(stages), "loss": float(x), "whole": float(whole)}))
"""


@pytest.mark.parametrize("text", [QWEN2, DECODER], ids=["own_forward", "python_factory"])
def test_a_worker_given_only_the_plan_builds_its_stages(tmp_path: Path, text: str) -> None:
    from ppdsl.dsl.check import check_text
    from ppdsl.lowering.lower import lower

    result = check_text(text, "w.ppspec", world=2, model=True)
    assert result.ok, [f"{d.code} {d.message}" for d in result.diagnostics if d.is_error]
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(lower(result.spec, 2, result.model_info).to_json()), encoding="utf-8")
    done = subprocess.run([sys.executable, "-c", WORKER, str(plan_file)], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["stages"] == 2
    assert abs(out["loss"] - out["whole"]) <= 1e-6 * max(1.0, abs(out["whole"])), out
