"""The task losses ppdsl computes on a model's logits, on one device (no tensor-parallel split).

One definition for every caller: the stage adapters (runtime/stage/adapters/base.py, which adds the
vocab-parallel split on top), the single-process reference of a model that runs its own forward
(runtime/verify/reference_loss.py: HF's ``labels=`` loss of such a class is not always this one; Bart's
``*ForCausalLM`` does not shift its labels), and check's meta run of the cut own forward
(dsl/own_layout.py), which proves the last stage's logits fit the labels.

- ``causal_lm``: transformers' ForCausalLMLoss (labels padded with -100 and shifted left,
  logits upcast to fp32, all positions flattened);
- ``sequence_classification``: the rules of transformers' ...ForSequenceClassification heads
  (``config.problem_type``, or inferred from ``num_labels`` and the labels' dtype) on the
  already pooled logits;
- ``seq2seq_lm``: an encoder-decoder model's loss (T5, BART), and a speech-to-text model's
  (Whisper, Speech2Text: HF's ``labels=`` loss is the same): cross entropy of the decoder's
  logits against the labels at the same positions (no shift: the decoder's input is the labels
  shifted right), -100 ignored, the mean over the counted targets;
- ``image_classification``: the same rules, as transformers' ...ForImageClassification heads
  compute them (``ForImageClassification`` loss: cross entropy over ``num_labels`` for integer
  labels, mean squared error for one label, binary cross entropy for float multi-labels).

torch is imported inside the functions: importing this module is torch-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["IGNORE_INDEX", "TASKS", "CLASSIFICATION_TASKS", "causal_lm_loss", "classification_loss", "own_task", "problem_type",
           "next_token_loss", "over_tokens", "shifted_labels", "task_loss"]

IGNORE_INDEX = -100
TASKS = ("causal_lm", "seq2seq_lm", "sequence_classification", "image_classification")
CLASSIFICATION_TASKS = ("sequence_classification", "image_classification")  # one label per sample


def own_task(class_name: str, inputs: str = "tokens") -> str:
    """The task of an HF class that runs its own forward: by its input kind
    (`ppdsl.core.model_inputs`; images are classified, check's cut proof refuses a model whose
    logits do not fit one label per image) and, for tokens, its name."""
    if inputs == "pixels":
        return "image_classification"
    if inputs in ("seq2seq", "speech"):  # speech to text: the same loss on the decoder's logits
        return "seq2seq_lm"
    return "sequence_classification" if class_name.endswith("ForSequenceClassification") else "causal_lm"


def shifted_labels(labels: torch.Tensor) -> torch.Tensor:
    """Next-token targets: the labels shifted left by one, the last position ignored."""
    import torch.nn.functional as F

    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].contiguous()


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return next_token_loss(logits, shifted_labels(labels))


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross entropy against already shifted targets (logits in fp32 at least, -100 ignored): the
    mean, or per token (``reduction = "none"``, 0 where ignored)."""
    import torch.nn.functional as F

    logits = at_least_fp32(logits)
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=IGNORE_INDEX,
                           reduction=reduction)


def over_tokens(per_token: torch.Tensor, divisor: float) -> torch.Tensor:
    """A microbatch's loss normalised per token over the global batch (chat data,
    runtime/data/chat.py): the sum of its per-token losses (0 where ignored) over `divisor`
    (the global batch's counted targets / (microbatches * dp)). The stages and the
    single-process reference both compute it here."""
    return per_token.sum() / divisor


def at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float32, or float64 where it is (precision = fp64): losses and scores are never
    computed in an autocast dtype, nor rounded below the parameters' precision."""
    import torch

    return t if t.dtype == torch.float64 else t.float()


def problem_type(config: Any, labels: torch.Tensor) -> str:
    # BertForSequenceClassification infers it on the first call (and writes it into the config);
    # here it is inferred without mutating the shared config.
    import torch

    if config.problem_type is not None:
        return str(config.problem_type)
    if config.num_labels == 1:
        return "regression"
    if labels.dtype in (torch.long, torch.int):
        return "single_label_classification"
    return "multi_label_classification"


def classification_loss(config: Any, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    import torch.nn.functional as F

    problem = problem_type(config, labels)
    if problem == "regression":
        if config.num_labels == 1:
            return F.mse_loss(output.squeeze(), labels.squeeze())
        return F.mse_loss(output, labels)
    if problem == "single_label_classification":
        return F.cross_entropy(output.view(-1, output.size(-1)), labels.view(-1))
    return F.binary_cross_entropy_with_logits(output, labels)


def task_loss(task: str, config: Any, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """One microbatch's mean loss of ``task`` on the whole model's (or the last stage's) logits."""
    if task in CLASSIFICATION_TASKS:
        return classification_loss(config, logits, labels)
    if task == "causal_lm":
        return causal_lm_loss(logits, labels)
    if task == "seq2seq_lm":
        return next_token_loss(logits, labels)
    raise ValueError(f"unknown task '{task}'; expected one of {', '.join(TASKS)}")
