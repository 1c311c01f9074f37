"""hf_pretrained reads a checkpoint that stores the names transformers renames as it loads.

transformers 5 renamed modules of some classes (Swin's and ViT's ``attention.q_proj`` is
``attention.self.query`` in their checkpoints, which ``save_pretrained`` still writes) and maps
the names back in ``from_pretrained``; ``runtime.stage.weights.load_pretrained`` tries the class's own
renamings, reversed, so such a checkpoint (every released one, and ppdsl's own export) loads.
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("name", ["swin", "vit"])
def test_a_saved_checkpoint_loads_every_parameter(tmp_path: Path, name: str) -> None:
    from ppdsl.runtime.stage.weights import load_pretrained

    if name == "swin":
        config = transformers.SwinConfig(embed_dim=16, depths=[1, 1], num_heads=[2, 2], image_size=32, patch_size=4,
                                         window_size=2, num_labels=3)
        cls = transformers.SwinForImageClassification
    else:
        config = transformers.ViTConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                                        image_size=32, patch_size=8, num_labels=3)
        cls = transformers.ViTForImageClassification
    torch.manual_seed(0)
    saved = cls(config)
    saved.save_pretrained(tmp_path)
    torch.manual_seed(1)
    fresh = cls(config)
    report = load_pretrained(fresh, tmp_path)
    assert report.kept == [], report.kept
    for (n, a), b in zip(saved.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), n
