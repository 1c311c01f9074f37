"""The torch-free half of a model family: what check, lowering and the data code know about it.

A `Family` is plain data (no torch, no transformers import): the HF classes it claims, its module
layout (blocks / first / last), its task, the config keys holding the dimensions the rules talk
about, its fused projections and its attention classes. Defaults of config values are read from
the HF config class of the claimed model class (`hf_config_defaults`), never copied by hand.
The torch half (stage forward, loss, attention localisation, init) is named by ``stage`` and
imported only by the runtime.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

import attrs

TASKS = ("causal_lm", "sequence_classification")

# canonical dimension -> config key aliases, tried in order (python factories, unknown HF classes;
# a family lists its own keys first through `Family.config_keys`)
DIM_ALIASES: dict[str, tuple[str, ...]] = {
    "layers": ("num_hidden_layers", "n_layer", "n_layers", "num_layers"),
    "hidden": ("hidden_size", "n_embd", "dim", "d_model"),
    "heads": ("num_attention_heads", "n_head", "n_heads", "num_heads"),
    "kv_heads": ("num_key_value_heads", "n_kv_heads", "num_kv_heads"),
    "ffn": ("intermediate_size", "n_inner", "ffn_dim", "d_ff"),
    "vocab": ("vocab_size", "n_vocab"),
    "labels": ("num_labels",),
    "positions": ("n_positions", "max_position_embeddings", "max_seq_len"),
    "experts": ("num_local_experts", "num_experts", "n_routed_experts"),  # routed experts per MoE layer
}


@attrs.frozen
class Fused:
    """A projection holding ``parts`` equal outputs side by side (q|k|v: 3, gate|up: 2).
    ``per_head``: the parts are interleaved per head ([q0 k0 v0 | q1 k1 v1 ...], GPT-NeoX,
    Falcon) rather than concatenated ([q | k | v], GPT-2 c_attn, Phi-3 qkv_proj)."""

    parts: int
    per_head: bool = False


@attrs.frozen
class SplitRefusal:
    """A tensor-parallel split of the block-relative module ``path`` that the family's stages
    cannot run while the config holds every ``when`` value (check: E0407)."""

    path: str
    when: Mapping[str, Any]
    why: str

    def applies(self, config: Mapping[str, Any]) -> bool:
        return all(config.get(k) == v for k, v in self.when.items())


@attrs.frozen
class Layout:
    """The pipeline layout: the repeated block list and the modules before / after it."""

    blocks: str
    first: tuple[str, ...]
    last: tuple[str, ...]


@attrs.frozen
class Family:
    name: str  # the family folder's name; what a plan's model.family holds
    # HF model class -> "transformers module:config class" whose defaults fill missing config keys
    hf_classes: Mapping[str, str]
    task: str  # one of TASKS
    stage: str  # "ppdsl.core.families.<name>.stage:Class": the torch half (runtime only)
    config_keys: Mapping[str, tuple[str, ...]] = attrs.field(factory=dict)  # dim -> keys, before DIM_ALIASES
    ffn_per_hidden: int | None = None  # ffn = this * hidden when the config leaves it None (GPT-2: 4)
    kv_heads_default_heads: bool = False  # kv_heads = heads when the config leaves it None
    # relative module path inside a block -> how its output splits into equal fused parts
    fused: Mapping[str, Fused] = attrs.field(factory=dict)
    # block-relative key / value projections: with fewer kv heads than tp (tp a multiple of them)
    # each rank holds them whole and uses its heads' kv head (each kv head replicated)
    kv_projections: tuple[str, ...] = ()
    # attention classes inside a block (mix tokens: sequence parallelism needs them split)
    attention_classes: tuple[str, ...] = ()
    # synthetic data of a sequence-classification task fed token ids carries a random right padding
    # and its attention mask (the head reads one token: padded examples exercise the mask)
    synthetic_padding: bool = False
    # HF config keys this family's models are built with unless the spec's config sets them: check
    # builds with them and lowering records them in the plan's model config, so the runtime does too
    build_config: Mapping[str, Any] = attrs.field(factory=dict)
    # config keys check refuses when set to a value other than the given one: key -> (value, why)
    refuse: Mapping[str, tuple[Any, str]] = attrs.field(factory=dict)
    split_refusals: tuple[SplitRefusal, ...] = ()
    # block-relative fused projection -> the config values under which its output is all query
    # heads then one key and one value head (Falcon's multi-query [all q | k | v]): a column split
    # divides the query heads and replicates the kv head (dsl/kv_parts.py), and overrides any
    # `split_refusals` entry of that path
    multi_query: Mapping[str, Mapping[str, Any]] = attrs.field(factory=dict)
    # written by hand only where the HF class declares no pipeline plan (`hf_pp_layout`)
    layout: Layout | None = None
    # modules a stage may also hold before / after the blocks, where the model has them (OPT's
    # project_in / project_out when word_embed_proj_dim != hidden_size)
    optional_first: tuple[str, ...] = ()
    optional_last: tuple[str, ...] = ()
    # the layout is found by a meta trace of the model's own forward (dsl/own_layout.py), per model
    layout_from_trace: bool = False
    # the family runs python factories: the spec's layout is the contract (not the family's), and
    # what the model is fed is the factory's own (a family's HF classes are fed token ids)
    python_factories: bool = False
    # the stages give the blocks the microbatch's position ids (runtime: runtime/stage/adapters/base.py positions), so
    # under context parallelism a rank's tokens keep their global positions (check: E0246)
    positions_from_microbatch: bool = False

    def __attrs_post_init__(self) -> None:
        assert self.task in TASKS, self.task
        assert self.layout is not None or self.hf_classes, f"{self.name}: a python family needs its layout"

    @property
    def pipeline_layout(self) -> Layout:
        """The layout defaults (and what the torch half runs): the HF class's own pipeline plan
        where it declares one, else the hand-written `layout`."""
        if self.layout is not None:
            return self.layout
        layouts = {hf_pp_layout(spec, cls) for cls, spec in self.hf_classes.items()}
        assert len(layouts) == 1 and None not in layouts, (
            f"{self.name}: its HF classes declare no single pipeline plan ({layouts}); write its layout")
        return layouts.pop()  # type: ignore[return-value]

    @property
    def blocks(self) -> str:
        return self.pipeline_layout.blocks

    @property
    def first(self) -> tuple[str, ...]:
        return self.pipeline_layout.first

    @property
    def last(self) -> tuple[str, ...]:
        return self.pipeline_layout.last

    def layout_problem(self, blocks: str, first: Sequence[str], last: Sequence[str]) -> str | None:
        """Why a spec's blocks / first / last are not what this family's stages run (None: they
        are). `ppdsl check` reports it (E0402); the runtime's stage adapter asserts the same."""
        if self.python_factories or self.layout_from_trace:
            return None  # python factories: the spec's layout is the contract; the own forward: the trace's
        if blocks != self.blocks:
            return f"{self.name} stages run the blocks '{self.blocks}', not '{blocks}'"
        for where, got, default, optional in (("first", first, self.first, self.optional_first),
                                              ("last", last, self.last, self.optional_last)):
            need = set(default) - set(optional)
            if not need <= set(got) <= set(default) | set(optional):
                may = f" (and, where the model has them, {', '.join(optional)})" if optional else ""
                return (f"{self.name} stages run {', '.join(sorted(need))}{may} as the '{where}' modules, "
                        f"not {', '.join(got) or 'none'}")
        return None

    def replicates_kv_heads(self, kv_heads: int, tp: int, sequence_parallel: bool) -> bool:
        """Whether a column split of the kv projections replicates each kv head over tp / kv_heads
        ranks (fewer kv heads than tp, tp a multiple of them, no sequence parallelism)."""
        return bool(self.kv_projections) and not sequence_parallel and kv_heads < tp and tp % kv_heads == 0

    def hf_splits(self, hf_class: str | None) -> tuple[HfSplit, ...] | None:
        """The split rules HF declares for ``hf_class`` (None: it declares none)."""
        spec = self.hf_classes.get(hf_class or "")
        return hf_tp_plan(spec, hf_class or "", self.blocks.split(".")[0]) if spec else None

    def defaults(self, hf_class: str | None) -> dict[str, Any]:
        """The HF config class defaults of ``hf_class`` (empty for python factories): the claimed
        class's config class, or the one transformers' auto mappings give a class no family claims."""
        spec = self.hf_classes.get(hf_class or "") or (hf_config_class(hf_class) if hf_class else None)
        return {**PRETRAINED_CONFIG_DEFAULTS, **hf_config_defaults(spec)} if spec else {}

    def dims(self, config: Mapping[str, Any], hf_class: str | None = None) -> dict[str, Any]:
        """Canonical dims (layers, hidden, heads, kv_heads, ffn, vocab, labels, positions) from a
        config over the HF class's defaults."""
        merged = {**self.defaults(hf_class), **config}
        if config.get("num_labels") is None and isinstance(config.get("id2label"), Mapping):
            merged["num_labels"] = len(config["id2label"])  # what PreTrainedConfig derives
        out: dict[str, Any] = {}
        for dim, aliases in DIM_ALIASES.items():
            for key in (*self.config_keys.get(dim, ()), *aliases):
                if merged.get(key) is not None:
                    out[dim] = merged[key]
                    break
        if "ffn" not in out and "hidden" in out and self.ffn_per_hidden:
            out["ffn"] = self.ffn_per_hidden * out["hidden"]
        if "kv_heads" not in out and "heads" in out and self.kv_heads_default_heads:
            out["kv_heads"] = out["heads"]
        return out


# HF tp-plan styles -> (ppdsl split style, gather_output); anything else is not expressible
HF_TP_STYLES: Mapping[str, tuple[str, bool]] = {
    "colwise": ("column", False),
    "rowwise": ("row", False),
    "embedding_rowwise": ("vocab", False),
    "colwise_gather_output": ("column", True),
    "replicated_with_grad_allreduce": ("replicate", False),  # ppdsl sums such gradients itself
}


# transformers 4.x names of the same styles (Phi-3's plan in 4.57)
HF_STYLE_RENAMED: Mapping[str, str] = {"colwise_rep": "colwise_gather_output", "rowwise_rep": "rowwise_split_input"}


@attrs.frozen
class HfSplit:
    """One entry of an HF class's tp plan, as a ppdsl rule (``style`` None: not expressible)."""

    pattern: str  # ppdsl pattern text, e.g. "model.layers[*].self_attn.q_proj"
    hf_style: str
    style: str | None
    gather_output: bool = False


def hf_tp_plan(config_spec: str, hf_class: str, base_prefix: str) -> tuple[HfSplit, ...] | None:
    """The split rules of an HF class: its config class's ``base_model_tp_plan`` (paths under
    the base model ``base_prefix``) and the model class's own ``_tp_plan`` (the head), read from
    the sources without importing them; None when the class declares neither."""
    module, _, config_cls = config_spec.partition(":")
    base = _class_literal(module, config_cls, "base_model_tp_plan")
    head = _class_literal(module.replace(".configuration_", ".modeling_"), hf_class, "_tp_plan")
    if not isinstance(base, dict) and not isinstance(head, dict):
        return None
    return hf_splits_of(base, head, base_prefix)


def hf_splits_of(base: Mapping[str, Any] | None, head: Mapping[str, Any] | None, base_prefix: str,
                 pair_gathers: bool = True) -> tuple[HfSplit, ...]:
    """An HF tp plan as ppdsl rules: ``base`` (a config's ``base_model_tp_plan``, paths under the
    base model ``base_prefix``) and ``head`` (the model class's ``_tp_plan``). ``pair_gathers``:
    a gathered column followed by a re-split row in one module is written as column + row (a
    family's knowledge that nothing in between needs the whole width)."""
    out = []
    for prefix, plan in ((base_prefix, base), ("", head)):
        for key, hf_style in (plan or {}).items():
            parts = [f"{prefix}"] if prefix else []
            for seg in str(key).split("."):
                if seg == "*" and parts:
                    parts[-1] += "[*]"
                else:
                    parts.append(seg)
            hf_style = HF_STYLE_RENAMED.get(str(hf_style), str(hf_style))
            style, gather = HF_TP_STYLES.get(hf_style, (None, False))
            out.append(HfSplit(".".join(parts), hf_style, style, gather))
    if pair_gathers:
        out = _gather_then_split_is_column_then_row(out)
    # an entry under an inexpressible one (Mixtral's mlp.experts.down_proj under mlp.experts) goes with it
    lost = [s.pattern for s in out if s.style is None]
    return tuple(attrs.evolve(s, style=None) if any(s.pattern.startswith(p + ".") for p in lost) else s for s in out)


# torch.nn layers without parameters: in an HF pipeline plan, not a module a stage holds
_PARAMETER_FREE = frozenset({"Dropout", "Identity"})


@functools.lru_cache(maxsize=None)
def hf_pp_layout(config_spec: str, hf_class: str) -> Layout | None:
    """The pipeline layout an HF class declares: its config class's ``base_model_pp_plan``
    (modules of the base model, in forward order, ``base_model_prefix`` in front) and the model
    class's own ``_pp_plan`` (the head), read from the sources without importing them. The
    blocks are the plan's ``nn.ModuleList``; parameter-free entries (GPT-NeoX's emb_dropout) are
    left out, as a stage holds only modules with parameters. None when the class declares none."""
    module, _, config_cls = config_spec.partition(":")
    modeling = module.replace(".configuration_", ".modeling_")
    base = _class_literal(module, config_cls, "base_model_pp_plan")
    head = _class_literal(modeling, hf_class, "_pp_plan")
    prefix = _inherited_literal(modeling, hf_class, "base_model_prefix")
    if not isinstance(base, dict) or not isinstance(prefix, str):
        return None
    built = _init_constructors(modeling, tuple(base))
    lists = [i for i, key in enumerate(base) if built.get(key) == "ModuleList"]
    if len(lists) != 1:
        return None
    keys = [f"{prefix}.{key}" if built.get(key) not in _PARAMETER_FREE else None for key in base]
    at = lists[0]
    return Layout(
        blocks=str(keys[at]),
        first=tuple(k for k in keys[:at] if k is not None),
        last=(*(k for k in keys[at + 1:] if k is not None), *(str(k) for k in head or {})),
    )


def _inherited_literal(module: str, cls: str, attr: str) -> Any:
    """A class attribute of ``cls`` or of a base class defined in the same module."""
    tree = _module_ast(module)
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)} if tree is not None else {}
    todo, seen = [cls], set()
    while todo:
        name = todo.pop(0)
        if name in seen or name not in classes:
            continue
        seen.add(name)
        value = _class_literal(module, name, attr)
        if value is not None:
            return value
        todo += [b.id for b in classes[name].bases if isinstance(b, ast.Name)]
    return None


def _init_constructors(module: str, attrs_: tuple[str, ...]) -> dict[str, str]:
    """attribute -> the name of the class its ``__init__`` builds it with (``self.layers =
    nn.ModuleList(...)``: "ModuleList"), in the module's class whose ``__init__`` assigns all
    of ``attrs_`` (the base model)."""
    tree = _module_ast(module)
    for node in tree.body if tree is not None else ():
        init = next((s for s in node.body if isinstance(s, ast.FunctionDef) and s.name == "__init__"), None) \
            if isinstance(node, ast.ClassDef) else None
        if init is None:
            continue
        built: dict[str, str] = {}
        for stmt in ast.walk(init):
            if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Call):
                func = stmt.value.func
                name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
                for t in stmt.targets:
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                        built[t.attr] = name
        if set(attrs_) <= set(built):
            return built
    return {}


def _gather_then_split_is_column_then_row(splits: list[HfSplit]) -> list[HfSplit]:
    """Phi-3 declares ``qkv_proj: colwise_gather_output`` before ``o_proj: rowwise_split_input``
    (and gate_up / down the same way): gathering an output only to split it again for the
    next layer is, on the data path, a column split feeding a row split, which is how ppdsl
    writes it (without the two collectives). Paired by parent module."""
    def parent(s: HfSplit) -> str:
        return s.pattern.rpartition(".")[0]

    gathered = {parent(s) for s in splits if s.hf_style == "colwise_gather_output"}
    resplit = {parent(s) for s in splits if s.hf_style == "rowwise_split_input"}
    pairs = gathered & resplit
    return [attrs.evolve(s, style="column", gather_output=False) if s.hf_style == "colwise_gather_output" and parent(s) in pairs
            else attrs.evolve(s, style="row", gather_output=False) if s.hf_style == "rowwise_split_input" and parent(s) in pairs
            else s for s in splits]


def _class_literal(module: str, cls: str, attr: str) -> Any:
    tree = _module_ast(module)
    for node in tree.body if tree is not None else ():
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for stmt in node.body:
                targets = stmt.targets if isinstance(stmt, ast.Assign) else (
                    [stmt.target] if isinstance(stmt, ast.AnnAssign) and stmt.value is not None else [])
                if any(isinstance(t, ast.Name) and t.id == attr for t in targets):
                    try:
                        return ast.literal_eval(stmt.value)  # type: ignore[arg-type]
                    except ValueError:
                        return None
    return None


@functools.lru_cache(maxsize=None)
def _module_ast(module: str) -> ast.Module | None:
    top = importlib.util.find_spec(module.split(".")[0])
    if top is None or not top.submodule_search_locations:
        return None
    path = Path(next(iter(top.submodule_search_locations)), *module.split(".")[1:]).with_suffix(".py")
    try:
        return ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError):
        return None


@functools.lru_cache(maxsize=None)
def hf_config_class(hf_class: str) -> str | None:
    """``"module:ConfigClass"`` of an HF model class, from the source of transformers' auto
    mappings (read as text: nothing imported, no syntax tree built): the model type whose
    mapping lists the class, its config class and its module folder. None when no mapping
    lists it."""
    modeling, *config_sources = (_module_text(f"transformers.models.auto.{m}")
                                 for m in ("modeling_auto", "configuration_auto", "auto_mappings"))
    listing = [m.group(1) for m in re.finditer(r'\(\s*"([\w-]+)"\s*,\s*"%s"\s*\)' % re.escape(hf_class), modeling)]
    # several model types may list one class (LlamaForCausalLM under "exaone" before "llama",
    # GPT2LMHeadModel under "gpt-sw3"): the one the class is named after first, then in order
    named = hf_class.lower()
    listing.sort(key=lambda t: -len(t.replace("-", "").replace("_", "")) if named.startswith(
        t.replace("-", "").replace("_", "")) else 0)
    for model_type in listing:
        entry = r'\(\s*"%s"\s*,\s*"(\w+)"\s*\)' % re.escape(model_type)
        configs = [m.group(1) for text in config_sources for m in re.finditer(entry, text)
                   if m.group(1).endswith("Config")]
        if not configs:
            continue
        special = [text.partition("SPECIAL_MODEL_TYPE_TO_MODULE_NAME")[2].partition("\n)")[0] for text in config_sources]
        module = next((m.group(1) for text in special for m in [re.search(entry, text)] if m),
                      model_type.replace("-", "_"))
        return f"transformers.models.{module}.configuration_{module}:{configs[0]}"
    return None


def _module_text(module: str) -> str:
    top = importlib.util.find_spec(module.split(".")[0])
    if top is None or not top.submodule_search_locations:
        return ""
    path = Path(next(iter(top.submodule_search_locations)), *module.split(".")[1:]).with_suffix(".py")
    try:
        return path.read_text(encoding="utf-8")
    except OSError:
        return ""


@functools.lru_cache(maxsize=None)
def hf_config_defaults(spec: str) -> Mapping[str, Any]:
    """Class-level defaults of an HF config class, read from its source file without importing
    transformers (or torch): ``"transformers.models.mistral.configuration_mistral:MistralConfig"``
    -> {"max_position_embeddings": 131072, ...}. transformers 5 declares them as annotated class
    attributes (``vocab_size: int = 32000``), 4.x as ``__init__``'s keyword defaults; values that
    are not constant expressions are left out, as is everything when transformers is not
    installed."""
    module, _, cls = spec.partition(":")
    top = importlib.util.find_spec(module.split(".")[0])
    if top is None or not top.submodule_search_locations:
        return {}
    path = Path(next(iter(top.submodule_search_locations)), *module.split(".")[1:]).with_suffix(".py")
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except OSError:
        return {}
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    out: dict[str, Any] = {}
    chain: list[ast.ClassDef] = []
    node = classes.get(cls)
    while node is not None and node not in chain:  # base classes defined in the same file first
        chain.append(node)
        base = node.bases[0] if node.bases else None
        node = classes.get(base.id) if isinstance(base, ast.Name) else None
    for node in reversed(chain):
        for stmt in node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.value is not None:
                try:
                    out[stmt.target.id] = _constant(stmt.value)
                except ValueError:
                    continue
            elif isinstance(stmt, ast.FunctionDef) and stmt.name == "__init__":  # 4.x: __init__'s defaults
                for name, value in _init_defaults(stmt.args):
                    try:
                        out.setdefault(name, _constant(value))
                    except ValueError:
                        continue
    return out


def _init_defaults(args: ast.arguments) -> list[tuple[str, ast.expr]]:
    """(parameter, default) of a def's parameters that have one (positional defaults are the last)."""
    positional = [*args.posonlyargs, *args.args]
    pairs = list(zip([a.arg for a in positional[len(positional) - len(args.defaults):]], args.defaults))
    pairs += [(a.arg, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
    return pairs


_OPS = {ast.Mult: lambda a, b: a * b, ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b,
        ast.Pow: lambda a, b: a**b}
# PreTrainedConfig's own defaults that the rules read (every HF class inherits them)
PRETRAINED_CONFIG_DEFAULTS: Mapping[str, Any] = {"num_labels": 2}


def _constant(node: ast.expr) -> Any:
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_constant(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        a, b = _constant(node.left), _constant(node.right)
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (a, b)):
            return _OPS[type(node.op)](a, b)
    raise ValueError(ast.dump(node))
