"""The model-family registry: the one place that lists the families ppdsl runs.

A family is one folder ``core/families/<name>/``: ``__init__.py`` holds its torch-free
descriptor ``FAMILY`` (a `descriptor.Family`: HF classes it claims, layout, task, config keys,
fused projections, attention classes) that check, lowering and the data code read. Its torch half
(stage forward, loss, attention localisation, init quirks) is the runtime's: the descriptor names
it (``stage = "ppdsl.runtime.stage.adapters.<name>:Class"``, data), `ppdsl.runtime.stage.adapters.stage_adapter`
loads it; nothing here imports the runtime. Adding a family: a folder, its adapter, one line in
`REGISTRY`, one tiny config in tests/test_families.py (see docs/families.md).

Nothing outside this package names a family.
"""

from __future__ import annotations

from typing import Any, Mapping

from . import falcon, gemma, gemma2, generic, own, phi3
from .descriptor import DIM_ALIASES, Family, Fused

__all__ = [
    "DIM_ALIASES", "GENERIC", "OWN", "REGISTRY", "Family", "Fused", "attention_family", "by_name", "family_of",
    "hf_attention_classes", "run_refusal", "supported_hf_classes",
]

REGISTRY: tuple[Family, ...] = (
    gemma.FAMILY,
    gemma2.FAMILY,
    phi3.FAMILY,
    falcon.FAMILY,
    generic.FAMILY,
    own.FAMILY,
)
GENERIC = generic.FAMILY
OWN = own.FAMILY  # HF classes no other family claims: their own forward (check traces its layout)

_BY_NAME = {f.name: f for f in REGISTRY}
_BY_HF_CLASS = {cls: f for f in REGISTRY for cls in f.hf_classes}
assert len(_BY_NAME) == len(REGISTRY) and len(_BY_HF_CLASS) == sum(len(f.hf_classes) for f in REGISTRY)


def by_name(name: str) -> Family:
    """The family a plan's ``model.family`` names."""
    if name not in _BY_NAME:
        raise ValueError(f"unknown model family '{name}'; expected one of {', '.join(_BY_NAME)}")
    return _BY_NAME[name]


def hf_class_of(source_kind: str, target: str, config: Mapping[str, Any]) -> str | None:
    """The HF model class a source builds: hf("Class"), or hf_pretrained's config.json
    ``architectures`` (the first one ppdsl runs, else the first listed)."""
    if source_kind == "hf":
        return target
    if source_kind == "hf_pretrained":
        archs = [a for a in config.get("architectures") or [] if isinstance(a, str)]
        known = [a for a in archs if a in _BY_HF_CLASS]
        return (known or archs or [None])[0]
    return None


def family_of(source_kind: str, target: str, config: Mapping[str, Any]) -> Family:
    """The family that runs a model source: GENERIC for python factories, OWN for HF classes no
    family claims (their own forward, where check's trace accepts the class)."""
    if source_kind not in ("hf", "hf_pretrained"):
        return GENERIC
    hf_class = hf_class_of(source_kind, target, config)
    return _BY_HF_CLASS.get(hf_class or "", OWN)


def supported_hf_classes() -> tuple[str, ...]:
    return tuple(_BY_HF_CLASS)


def run_refusal(kind: str, family: str, class_name: str) -> str | None:
    """Why `ppdsl run` / `verify` / `plan` refuse a model (None: a family runs it): an HF model
    in the python factories' family. Check says it (E0429, dsl/plan_needs.py); the runtime runs
    only plans check lowered."""
    if kind == "python" or by_name(family) is not GENERIC:
        return None
    supported = ", ".join(f"{f.name} ({', '.join(f.hf_classes)})" for f in REGISTRY if f.hf_classes)
    return (f"no model family runs {class_name}: ppdsl runs the families {supported}, and python factories "
            "whose blocks take and return one tensor (check still proves this spec's layout)")


def hf_attention_classes() -> tuple[str, ...]:
    """The attention classes the registered families localise for tp: with sequence parallelism
    such a module must be split over tp."""
    return tuple(sorted({c for f in REGISTRY for c in f.attention_classes}))


def attention_family(class_name: str) -> Family | None:
    for f in REGISTRY:
        if class_name in f.attention_classes:
            return f
    return None

