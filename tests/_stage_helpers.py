"""Plans and microbatches for the stage-builder tests.

`stage_plan(family, style, pp=..., ...)` is the tiny model's plan (tests/_tiny_models.py: 8
blocks, hidden 32, 4 heads; Llama with 2 kv heads) with every split of its blocks, embedding and
head, 4 microbatches of 2, cut evenly into pp * chunks virtual stages placed in a loop (gpipe:
one chunk, interleaved: stage s on rank s % pp) or a V (zbv: rank r holds r and 2pp-1-r). The
stage builder reads the stages, their placement and the splits, not the schedule's actions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from _tiny_models import LAYERS, SEQ, TINY, tiny_plan
from ppdsl.lowering.plan import Plan
from ppdsl.runtime.stage.build import MicroBatch

FAMILIES = ("gpt2", "bert", "llama", "generic")
SEQ_LEN = SEQ
MICROBATCH = 2
MICROBATCHES = 4
N_BLOCKS = LAYERS

# Llama's head gathers its output (the others stay vocab / label parallel): the stage chain's
# one gathered head, the other path of the tp check's logits
_HEADS = {"llama": ("lm_head : column(gather_output = true)",)}


def stage_plan(family: str, style: str = "gpipe", **kw: Any) -> Plan:
    """tiny_plan with the stage tests' arguments: all the model's splits, MICROBATCHES of MICROBATCH."""
    return tiny_plan(family, style, microbatches=MICROBATCHES, microbatch_size=MICROBATCH, steps=1, splits="all",
                     tensor_parallel=_HEADS.get(family, ()), **kw)


def make_microbatch(family: str, seed: int = 0, *, padded: bool = False) -> MicroBatch:
    g = torch.Generator().manual_seed(seed)
    vocab = TINY[family].config["vocab_size"]
    ids = torch.randint(0, vocab, (MICROBATCH, SEQ_LEN), generator=g)
    mask = None
    if padded:  # left-pad the second sequence by 3 tokens
        mask = torch.ones(MICROBATCH, SEQ_LEN, dtype=torch.long)
        mask[1, :3] = 0
    if TINY[family].task == "classify":
        labels = torch.randint(0, TINY[family].config["num_labels"], (MICROBATCH,), generator=g)
        token_types = torch.randint(0, 2, (MICROBATCH, SEQ_LEN), generator=g)
        return MicroBatch(input_ids=ids, labels=labels, attention_mask=mask, token_type_ids=token_types)
    labels = ids.clone()
    labels[0, :2] = -100
    return MicroBatch(input_ids=ids, labels=labels, attention_mask=mask)


def reference_forward(family: str, model: torch.nn.Module, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, loss) of the single-process reference model."""
    if family == "generic":
        from ppdsl.runtime.stage.adapters.base import causal_lm_loss

        class _NoTP:
            head_partition = None
            tp_group = None

        logits = model(mb.input_ids)
        return logits, causal_lm_loss(_NoTP(), logits, mb.labels)  # type: ignore[arg-type]
    kwargs: dict[str, Any] = dict(input_ids=mb.input_ids, labels=mb.labels, attention_mask=mb.attention_mask)
    if family == "bert":
        kwargs["token_type_ids"] = mb.token_type_ids
    else:
        kwargs["use_cache"] = False
    out = model(**kwargs)
    return out.logits, out.loss


def chain(stages: Sequence[Any], mb: MicroBatch) -> torch.Tensor:
    """Run stages in model order, passing each output (still attached to the graph) on."""
    x = None
    for stage in sorted(stages, key=lambda s: s.stage):
        x = stage(x, mb)
    return x
