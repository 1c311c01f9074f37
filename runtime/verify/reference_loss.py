"""The single-process reference's loss of one microbatch, computed the way the stages compute it
(the whole model built by `runtime.stage.build.build_reference_model`)."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from ppdsl.lowering.plan import Plan


def reference_loss(plan: Plan, model: nn.Module, mb: Any) -> torch.Tensor:
    """One microbatch's mean loss on the single-process reference model, computed the way the
    stage adapters compute it: a class that runs its own forward (family "own") by ppdsl's task
    loss on its logits (`ppdsl.core.task_loss`, which its stages compute; HF's own ``labels=``
    loss differs for some, such as Bart's ``*ForCausalLM``, which does not shift), other
    transformers models through their own ``labels=`` loss (the family adapters match it bit for
    bit; under precision fp64 by ppdsl's task loss, as HF's casts the logits to float32), python
    factories (logits out) by the causal-LM loss."""
    return reference_outputs(plan, model, mb)[0]


def reference_outputs(plan: Plan, model: nn.Module, mb: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, logits) of one microbatch on the reference model (see `reference_loss`). A
    microbatch with a token divisor (chat data): its per-token losses summed over the divisor,
    as the stages compute it (`ppdsl.core.task_loss.over_tokens`)."""
    from ppdsl.core.document_masks import documents
    from ppdsl.core.task_loss import next_token_loss, over_tokens, shifted_labels

    with documents(getattr(mb, "position_ids", None)):  # packed documents, for ppdsl's document masks
        loss, logits = _reference_outputs(plan, model, mb)
    divisor = getattr(mb, "token_divisor", None)
    if divisor is None:
        return loss, logits
    return over_tokens(next_token_loss(logits, shifted_labels(mb.labels), "none"), divisor), logits


def _reference_outputs(plan: Plan, model: nn.Module, mb: Any) -> tuple[torch.Tensor, torch.Tensor]:
    from ppdsl.core.task_loss import causal_lm_loss, own_task, task_loss

    if not type(model).__module__.startswith("transformers."):
        logits = model(mb.input_ids)
        return causal_lm_loss(logits, mb.labels), logits
    if plan.own_forward is not None:  # the inputs its stages pass (`ppdsl.core.own_cut`), use_cache off among them
        from ppdsl.core.own_cut import as_parameters, model_inputs

        pixels = as_parameters(model, getattr(mb, "pixel_values", None))  # a model fed images
        features = as_parameters(model, getattr(mb, "input_features", None))  # a speech model
        logits = _logits(model(**model_inputs(model, mb.input_ids, mb.attention_mask, mb.token_type_ids,
                                              position_ids=getattr(mb, "position_ids", None),
                                              pixel_values=pixels, labels=mb.labels, input_features=features)))
        return task_loss(plan.model.task, model.config, logits, mb.labels), logits
    kwargs: dict[str, Any] = {"input_ids": mb.input_ids}
    if "use_cache" in inspect.signature(model.forward).parameters:  # training keeps no cache; nor do the stages
        kwargs["use_cache"] = False
    if mb.attention_mask is not None:
        kwargs["attention_mask"] = mb.attention_mask
    if getattr(mb, "position_ids", None) is not None:  # packed documents: the model's own packed-sequence masks
        kwargs["position_ids"] = mb.position_ids
    if mb.token_type_ids is not None and "token_type_ids" in inspect.signature(model.forward).parameters:
        kwargs["token_type_ids"] = mb.token_type_ids  # (DistilBERT 4.x takes none; 5.x swallows them)
    out = model(**kwargs, labels=mb.labels)
    if out.logits.dtype == torch.float64:  # HF's loss rounds the logits to float32 (`.float()`); the stages do not
        return task_loss(own_task(type(model).__name__), model.config, out.logits, mb.labels), out.logits
    return out.loss, out.logits


def _logits(out: Any) -> torch.Tensor:
    """The logits of a model's own forward, read as the stages read them (`ppdsl.core.own_cut.run_forward`):
    ``logits``, else the first output (PPLCNet's classifier returns its head's output as
    ``last_hidden_state``)."""
    return out.logits if hasattr(out, "logits") else out[0]
