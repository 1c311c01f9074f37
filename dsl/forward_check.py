"""The model's own forward at the config written: a forward that fails on meta is a refusal.

Check runs the model's forward once on the meta device (`ppdsl.dsl.tp_dataflow`). Meta tensors
carry every shape and no values, so a forward that fails there on a shape (a rotary dimension
that does not fit the heads, query heads that key/value heads do not divide) fails the same way
on every device: `ppdsl run` would crash in every worker. Such a failure is E0428, at the config
key behind it where a known rule names one (`config_rule`), else at the model's source, with the
model's own error. Only a failure that is demonstrably the meta device's (`meta_only`: an op
without a meta kernel, a value read that meta tensors cannot answer) stays note N0219, which
says what could not be proven (the column/row pairing, judged per block instead).

A ``python(...)`` factory's forward is not what ppdsl runs (its stages call first -> blocks ->
last in order): its failure stays the note too.

Torch-free: it judges the facts the build recorded (`ModelInfo.dataflow_error`, its config and
modules), so a cached build says it again without building.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Iterator

from .diagnostics import Diagnostic, error
from .families import DIM_ALIASES, by_name
from .spec import Spec

if TYPE_CHECKING:
    from ppdsl.dsl.introspect import ModelInfo

__all__ = ["check_forward", "config_rule", "forward_refused", "meta_failure", "meta_only"]

# What only the meta device raises: a kernel it lacks, a value it cannot give (data-dependent
# control flow, .item(), .tolist(), numpy), a tensor without storage, a device mix with a buffer
# made elsewhere. Shape errors ("The size of tensor a (7) must match ...", "Attempting to
# broadcast a dimension ...", "mat1 and mat2 shapes cannot be multiplied") name no device.
_META_ONLY = re.compile(
    r"\bmeta\b|data[- ]dependent|DataDependent|DynamicOutputShape|UnsupportedOperator|"
    r"_local_scalar_dense|(?:doesn't|does not) have storage|has no storage|no data!",
    re.IGNORECASE,
)
_META_ONLY_TYPES = ("MetaOnlyFailure", "NotImplementedError", "DataDependentOutputException", "DynamicOutputShapeException",
                    "GuardOnDataDependentSymNode", "UnsupportedOperatorException")


def meta_only(error_text: str) -> bool:
    """Whether a failure of the forward on meta (``ExcType: message``) is the meta device's own,
    so that the same forward may well run on a real device."""
    kind = error_text.partition(":")[0].strip()
    return kind in _META_ONLY_TYPES or _META_ONLY.search(error_text) is not None


def meta_failure(error_text: str | None) -> str:
    """The failure as a note says it: without the marker of a call that runs on cpu."""
    text = error_text or "not traced"
    return text.partition(": ")[2] if text.startswith("MetaOnlyFailure: ") else text


# torch's shape errors are RuntimeErrors; another kind (a TypeError: the trace called a forward
# whose signature this transformers release changed, BERT's under 4.57) says nothing of the shapes
_SHAPE_ERROR_TYPES = ("RuntimeError",)


def forward_refused(spec: Spec, info: ModelInfo | None) -> bool:
    """The forward failed on meta, on a shape, in a way every device shares (E0428)."""
    error_text = getattr(info, "dataflow_error", None)
    return (info is not None and info.dataflow is None and bool(error_text)
            and error_text.partition(":")[0].strip() in _SHAPE_ERROR_TYPES
            and spec.model.source.kind != "python" and not meta_only(error_text))


def check_forward(spec: Spec, info: ModelInfo | None) -> Iterator[Diagnostic]:
    """E0428 for a forward that fails on meta on a shape."""
    if not forward_refused(spec, info):
        return
    found = config_rule(spec, info)
    failure = f"{info.class_name}'s forward fails on meta ({info.dataflow_error})"
    if found is None:
        yield error("E0428", spec.span("model.source") or spec.span("model"),
                    f"{failure}: meta tensors carry every shape, so it fails the same way on every device and "
                    "ppdsl run would crash in every worker",
                    hint="check the model's config values against each other (the widths of heads, key/value "
                         "heads, rotary dimensions); ppdsl verify runs nothing a forward this config breaks")
        return
    key, rule, hint = found
    at = spec.spans.get(f"model.config.{key}")
    yield error("E0428", at or spec.span("model.source") or spec.span("model"),
                f"{rule}: {failure}" + ("" if at else f" (the config's {key})"),
                label="the model's forward fails at this value", hint=hint)


def config_rule(spec: Spec, info: ModelInfo | None) -> tuple[str, str, str] | None:
    """(key, the rule it breaks, a hint) for the first known rule of attention shapes the built
    config breaks, or None. The rules: key/value heads divide the attention heads; attention heads
    divide the hidden size (unless head_dim is set); a rotary dimension is even and at most one
    head's width."""
    config = dict(getattr(info, "config", {}) or {})
    heads_key, heads = _dim(spec, config, "heads")
    kv_key, kv = _dim(spec, config, "kv_heads")
    hidden_key, hidden = _dim(spec, config, "hidden")
    # head_dim as written (or a config.json's that is not hidden / heads); configs that derive it
    # (LlamaConfig: hidden // heads when unset) hold it too
    explicit_head_dim = _int(config.get("head_dim"))
    if explicit_head_dim is not None and not _written(spec, "head_dim") and heads and hidden \
            and explicit_head_dim == hidden // heads:
        explicit_head_dim = None
    if heads and kv and heads % kv:
        return (kv_key or "", f"{kv_key} = {kv} does not divide {heads_key} = {heads}: key/value heads must divide "
                f"the attention heads (each key/value head serves a whole group of query heads)",
                f"choose {kv_key} dividing {heads} ({heads}: multi-head attention, 1: multi-query)")
    if heads and hidden and explicit_head_dim is None and hidden % heads:
        key = heads_key if _written(spec, heads_key) or not _written(spec, hidden_key) else hidden_key
        return (key or "", f"{heads_key} = {heads} does not divide {hidden_key} = {hidden}: the attention heads must "
                f"divide the hidden size ({hidden} / {heads} is no whole head width)",
                f"choose {heads_key} dividing {hidden}" + (", or set head_dim" if "head_dim" in config else ""))
    head_dim = explicit_head_dim or _module_head_dim(info) or (hidden // heads if heads and hidden else None)
    rotary = _int(config.get("rotary_dim"))
    if rotary is not None and (rotary % 2 or (head_dim is not None and rotary > head_dim)):
        bound = f" and at most head_dim = {head_dim}" if head_dim is not None else ""
        return ("rotary_dim", f"rotary_dim = {rotary}: the rotary dimension must be even{bound} (rotary embeddings "
                "turn pairs of a head's features)",
                f"choose an even rotary_dim <= {head_dim}" if head_dim is not None else "choose an even rotary_dim")
    if head_dim is not None and head_dim % 2 and rotary is None and _rotary(info, config):
        if explicit_head_dim is not None:
            key, what = "head_dim", f"head_dim = {head_dim}"
        else:
            key = heads_key if _written(spec, heads_key) or not _written(spec, hidden_key) else hidden_key
            what = f"{hidden_key} = {hidden} over {heads_key} = {heads} heads of {head_dim} features"
        return (key or "", f"{what}: the rotary dimension (a whole head here) must be even (rotary embeddings turn "
                "pairs of a head's features)",
                "choose an even head_dim" if key == "head_dim" else "choose sizes that give each head an even width")
    return None


def _int(v: object) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def _written(spec: Spec, key: str | None) -> bool:
    return key is not None and f"model.config.{key}" in spec.spans


def _dim(spec: Spec, config: dict[str, Any], dim: str) -> tuple[str | None, int | None]:
    """The config key holding a canonical dim (the one the spec writes, if any) and its value."""
    try:
        own = tuple(by_name(spec.model.family).config_keys.get(dim, ()))
    except ValueError:
        own = ()
    keys = (*own, *DIM_ALIASES.get(dim, ()))
    for key in sorted(keys, key=lambda k: not _written(spec, k)):
        value = _int(config.get(key))
        if value is not None:
            return key, value
    return None, None


def _module_head_dim(info: ModelInfo | None) -> int | None:
    widths = {m.head_dim for m in getattr(info, "modules", {}).values() if getattr(m, "head_dim", None)}
    return widths.pop() if len(widths) == 1 else None


def _rotary(info: ModelInfo | None, config: dict[str, Any]) -> bool:
    """The model turns its heads by rotary embeddings over a whole head (no partial factor)."""
    if config.get("partial_rotary_factor") not in (None, 1, 1.0):
        return False
    return any("Rotary" in m.type_name for m in getattr(info, "modules", {}).values())
