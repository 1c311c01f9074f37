"""The torch half shared by the rotary decoders (Gemma, Gemma 2, Phi-3), mirroring
transformers 5.24 LlamaModel.forward / MistralModel.forward / Qwen2Model.forward and their
...ForCausalLM.forward.

Kept for Gemma's scaled vocab-split embedding and Phi-3's qkv_proj, which the own forward cannot split
(E0426, E0221); Llama, whose family it also ran, the own forward reproduces, sequence parallelism
included (benchmarks/own_forward_vs_families.py), and its family was deleted (issue 30).

first: model.embed_tokens (times ``embed_scale`` where the family scales it); blocks:
model.layers, each given its attention mask and the rotary (cos, sin) from model.rotary_emb,
which has no parameters and is rebuilt on every stage; last: model.norm, lm_head.

``mask`` says which attention mask each block gets, as the family's forward builds it:
"causal" (Gemma), "sliding_if_set" (Phi-3: the sliding-window causal mask when
config.sliding_window is set), "layer_types" (Gemma 2: config.layer_types[i] picks the full or
the sliding-window mask per layer).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from ppdsl.core.hf_masks import build_mask
from ppdsl.runtime.stage.adapters.base import StageAdapter, divide_attrs, positions

if TYPE_CHECKING:
    from ppdsl.runtime.stage.build import MicroBatch, StageModule


class RotaryDecoderStage(StageAdapter):
    mask: str = "causal"

    @staticmethod
    def attention_changes(module: nn.Module, tp: int) -> list[tuple[str, int, int]]:
        # The forward reshapes with -1 heads and reads only head_dim, scaling and
        # num_key_value_groups: with q and kv projections both split by tp the ratio is
        # unchanged, so nothing is rewritten; head counts held by older versions (num_heads,
        # num_key_value_heads, hidden_size) are made local where present. The shared config is
        # never touched (all layers share it). With fewer kv heads than tp (tp a multiple of them)
        # each rank's query heads share one replicated kv head (runtime/parallel/tp/kv_replicated.py).
        config = cast(Any, module).config
        heads = int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        if heads % tp == 0 and kv_heads < tp and tp % kv_heads == 0:
            # each rank: heads / tp query heads over one (replicated) kv head
            groups = int(getattr(module, "num_key_value_groups", heads // kv_heads))
            changes = [("num_key_value_groups", groups, heads // tp)]
            if hasattr(module, "num_heads"):
                changes.append(("num_heads", int(getattr(module, "num_heads")), heads // tp))
            if hasattr(module, "num_key_value_heads"):
                changes.append(("num_key_value_heads", int(getattr(module, "num_key_value_heads")), 1))
            return changes
        if heads % tp != 0 or kv_heads % tp != 0:
            raise ValueError(
                f"{type(module).__name__}: {heads} attention heads and {kv_heads} key/value heads "
                f"must both be divisible by tp = {tp}"
            )
        groups = getattr(module, "num_key_value_groups", heads // kv_heads)
        assert groups == (heads // tp) // (kv_heads // tp), (groups, heads, kv_heads, tp)
        return divide_attrs(module, ("num_heads", "num_key_value_heads", "hidden_size"), tp, "attention heads/width")

    def embed(self, stage: StageModule, mb: MicroBatch) -> torch.Tensor:
        return stage.get_submodule("model.embed_tokens")(mb.input_ids)

    def context(self, stage: StageModule, hidden: torch.Tensor, mb: MicroBatch) -> Any:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        config = stage.config
        position_ids = positions(hidden.shape[1], hidden.device, mb)

        def mask(builder: Any) -> Any:
            return build_mask(builder, config, hidden, mb.attention_mask, position_ids)

        if self.mask == "causal":
            masks: dict[str | None, Any] = {None: mask(create_causal_mask)}
        elif self.mask == "sliding_if_set":
            masks = {None: mask(create_causal_mask if config.sliding_window is None else create_sliding_window_causal_mask)}
        else:
            assert self.mask == "layer_types", self.mask
            masks = {"full_attention": mask(create_causal_mask)}
            if "sliding_attention" in config.layer_types:
                masks["sliding_attention"] = mask(create_sliding_window_causal_mask)
        # cos / sin take the dtype of the hidden states, as in LlamaModel.forward.
        position_embeddings = stage.get_submodule("model.rotary_emb")(hidden, position_ids=position_ids)
        return masks, position_ids, position_embeddings

    def block_mask(self, stage: StageModule, block: nn.Module, masks: dict[str | None, Any]) -> Any:
        if self.mask != "layer_types":
            return masks[None]
        layer = cast(Any, block).self_attn.layer_idx
        return masks[stage.config.layer_types[layer]]

    def run_block(self, stage: StageModule, block: nn.Module, hidden: torch.Tensor, ctx: Any) -> torch.Tensor:
        masks, position_ids, position_embeddings = ctx
        return block(
            hidden,
            attention_mask=self.block_mask(stage, block, masks),
            position_embeddings=position_embeddings,
            position_ids=position_ids,
            cache=None,
            use_cache=False,
        )

    def head(self, stage: StageModule, hidden: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        hidden = stage.get_submodule("model.norm")(hidden)
        return stage.get_submodule("lm_head")(hidden)
