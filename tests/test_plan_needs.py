"""E0429: what a plan needs beyond a valid spec is a diagnostic of check's, never lowering's error."""

from __future__ import annotations

from pathlib import Path

import pytest

from ppdsl import cli

OWN = """ppspec 1
model m {
  source = hf("Olmo2ForCausalLM")
  config { hidden_size = 64, intermediate_size = 128, num_hidden_layers = 4, num_attention_heads = 4, vocab_size = 128 }
}
mesh { pp = 2 }
pipeline { style = 1f1b, microbatches = 4 }
train { global_batch = 8, seq_len = 16 }
"""


@pytest.mark.parametrize("argv", [["plan", "--world", "2", "--no-model"], ["schedule", "--world", "2", "--no-model"]])
def test_an_own_forward_plan_without_the_model_is_E0429_at_the_source(tmp_path: Path, capsys, argv) -> None:
    pytest.importorskip("transformers")
    spec = tmp_path / "olmo.ppspec"
    spec.write_text(OWN)
    assert cli.main([argv[0], str(spec), *argv[1:]]) == 2
    err = capsys.readouterr().err
    assert "error[E0429]" in err and f"{spec}:3:3" in err and "Traceback" not in err
    assert cli.main(["check", str(spec), "--no-model"]) == 0  # the spec itself is right
    assert "drop --no-model" in err
    assert cli.main([argv[0], str(spec), *argv[1:-1]]) == 0  # with the model (the default), the layout is traced


def test_no_layer_count_without_the_model_is_E0429(tmp_path: Path, capsys) -> None:
    spec = tmp_path / "nol.ppspec"
    spec.write_text(OWN.replace('hf("Olmo2ForCausalLM")', 'python("ppdsl.models.decoder:build_decoder")')
                    .replace("hidden_size = 64, intermediate_size = 128, num_hidden_layers = 4, num_attention_heads = 4, "
                             "vocab_size = 128", "vocab_size = 128, dim = 64, n_heads = 4, max_seq_len = 64")
                    .replace("microbatches = 4 }", "microbatches = 4, blocks = layers, first = [tok_embeddings, "
                             "pos_embeddings], last = [norm, output] }"))
    assert cli.main(["plan", str(spec), "--world", "2", "--no-model"]) == 2
    assert "error[E0429]" in capsys.readouterr().err
    assert cli.main(["plan", str(spec), "--world", "2"]) == 0  # built, the model says 4 blocks
