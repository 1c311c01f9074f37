"""Phi3ForCausalLM stages: Phi3Model.forward (sliding-window mask when config.sliding_window is
set). Phi3Attention slices its fused qkv output at ``config.num_attention_heads * head_dim``
and ``self.num_key_value_heads * head_dim``: once qkv_proj is split (fused = 3) the module gets
its own copy of the config with the local head counts (the shared config is never touched).

Kept: the own forward cannot split qkv_proj, which the forward slices at fixed offsets rather than
splitting (E0221), nor run sequence parallelism (E0423).
"""

from __future__ import annotations

import copy
from typing import Any, cast

from torch import nn

from ppdsl.runtime.stage.adapters.rotary_decoder import RotaryDecoderStage


class Phi3Stage(RotaryDecoderStage):
    mask = "sliding_if_set"

    @staticmethod
    def attention_changes(module: nn.Module, tp: int) -> list[tuple[str, int, int]]:
        changes = RotaryDecoderStage.attention_changes(module, tp)
        attn = cast(Any, module)
        local = copy.copy(attn.config)
        local.num_attention_heads = attn.config.num_attention_heads // tp
        local.num_key_value_heads = attn.config.num_key_value_heads // tp
        attn.config = local
        return changes
