"""Which HF classes run their own forward: the coverage table of the own-forward path.

For every ``*ForCausalLM`` / ``*ForSequenceClassification`` class of the installed transformers
that no registered family claims: a generic tiny shrink of its default config, a spec without
blocks / first / last, `ppdsl check` (whose meta trace infers the layout or refuses the class,
naming why), lowering at pp 2, and the two stages built in this process and chained by hand
against the single-process reference (loss within 1e-6, gradients within 1e-5 relative):

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/own_forward_sweep.py [--limit N] [--budget S]
        [--only REGEX] [--after CLASS] [--per-class S] [--configs default,groups,real] [--out table.md]
    .venv/bin/python benchmarks/own_forward_sweep.py --merge part1.md part2.md --out table.md

With ``--configs default,groups,real`` each class runs at three configs (`CONFIGS`): the generic
shrink; other head / key-value head counts (groups of 3) and another rotary fraction; and the
proportions of the checkpoint its default config describes (head and key/value head counts, ffn
ratio, rotary fraction), each head narrowed. The table has a row per class and config.

With ``--tp 2``: the classes that declare a tensor-parallel plan, at pp 2 x tp 2 with
``tensor_parallel { hf_plan = true }``, each run by ``ppdsl verify``'s machinery in a spawned
gloo world of 4 (two SGD steps: Adam's first step, about lr * sign(g), turns rounding-level
gradient differences of near-zero entries into visible parameter differences); verdict
``match`` when verify says OK, ``match (fp64)`` when only fp32 differs and verify in fp64 (both
runs in float64) is OK: rounding the model amplifies, not the split. A class without a plan is
``no-plan`` (not run).

Verdicts: ``match`` (check OK, pp 2 equals one process), ``MISMATCH`` (check OK but the numbers
differ: a bug of the own forward, or a class check should refuse), ``refused E04xx`` (check
refuses it: the reason follows), ``no-build`` (the shrunk config does not build: the sweep's
shrink, not ppdsl), ``too-large`` (check OK, but the shrink left a nested sub-config full size:
not run), ``run-error`` (check OK but the stages raised).
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import sys
import time
import warnings
from typing import Any

SHRINK = {
    "num_hidden_layers": 4, "n_layer": 4, "n_layers": 4, "num_layers": 4,
    "hidden_size": 32, "n_embd": 32, "d_model": 32, "dim": 32,
    "intermediate_size": 64, "n_inner": 64, "ffn_dim": 64, "d_ff": 64, "hidden_dim": 64,
    "num_attention_heads": 4, "n_head": 4, "n_heads": 4, "num_heads": 4,
    "num_key_value_heads": 2, "head_dim": 8, "kv_channels": 8,
    "vocab_size": 128, "max_position_embeddings": 64, "n_positions": 64,
    "num_local_experts": 4, "num_experts": 4, "n_routed_experts": 4, "moe_intermediate_size": 32,
    "num_experts_per_tok": 2, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
}
# the other heads' classes (--heads other) also shrink each stack of two (BART, Whisper, ...) and
# the images (32 x 32, patches of at most 8), where the default is of the same kind (Swin's
# per-stage num_heads list stays a list)
SHRINK_OTHER = {
    "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4, "decoder_attention_heads": 4,
    "encoder_ffn_dim": 64, "decoder_ffn_dim": 64, "num_decoder_layers": 2, "image_size": 32, "num_channels": 3,
    "window_size": 2,
}
# randomness in training differs between processes (verify switches the same keys off:
# runtime/verify/compare.py): dropout, layer drop, stochastic depth (BEiT's drop_path_rate), a MoE router's jitter
RANDOM = re.compile(r"dropout|pdrop|layerdrop|drop_path|jitter", re.IGNORECASE)
MAX_PARAMS = 100_000_000  # beyond this the shrink missed the model's size: building it three times could exhaust memory
ZERO = ("hidden_dropout", "attention_dropout", "dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop",
        "hidden_dropout_prob", "attention_probs_dropout_prob")


TEXT_HEADS = r"\w+For(CausalLM|SequenceClassification)"
# the other heads people train (issue 32): seq2seq and image-text generation, image
# classification, speech seq2seq, and classes named otherwise (MarianMTModel)
OTHER_HEADS = r"\w+For(ConditionalGeneration|ImageClassification|SpeechSeq2Seq)|\w+MTModel"


def classes(only: str | None, heads: str = TEXT_HEADS) -> list[str]:
    import transformers

    from ppdsl.core.families import supported_hf_classes

    claimed = set(supported_hf_classes())
    names = sorted(n for n in dir(transformers) if re.fullmatch(heads, n))
    return [n for n in names if n not in claimed and not n.startswith(("Auto", "TF", "Flax"))
            and (only is None or re.search(only, n))]


# what a class is, decided by its forward's inputs (and its config's is_encoder_decoder), in
# the order docs/coverage_kinds.md lists them
KIND_ORDER = ("text", "seq2seq", "vision", "image-text", "speech", "audio-text", "speech seq2seq", "other")


def model_kind(cls_name: str) -> str:
    """text | seq2seq | vision | image-text | speech | audio-text | speech seq2seq | other, from the
    parameters of the class's forward: ``input_ids``, ``pixel_values``, ``input_features`` /
    ``input_values``, and ``decoder_input_ids`` (or ``is_encoder_decoder``) for two stacks."""
    import inspect

    import transformers

    cls = getattr(transformers, cls_name)
    try:
        params = set(inspect.signature(cls.forward).parameters)
    except (TypeError, ValueError):
        return "other"
    try:
        two_stacks = bool(getattr(cls.config_class(), "is_encoder_decoder", False))
    except Exception:  # noqa: BLE001 - a config class that needs arguments
        two_stacks = False
    if not two_stacks and {"pixel_values", "input_ids"} <= params:  # Blip2's decoder_input_ids: its T5 text models'
        return "image-text"
    two_stacks = two_stacks or "decoder_input_ids" in params
    audio = bool(params & {"input_features", "input_values"})
    if two_stacks:
        return "speech seq2seq" if audio else "seq2seq" if "input_ids" in params else "other"
    if "pixel_values" in params:
        return "image-text" if "input_ids" in params else "vision"
    if audio:
        return "audio-text" if "input_ids" in params else "speech"
    return "text" if "input_ids" in params else "other"


def declares_tp_plan(cls_name: str) -> bool:
    import transformers

    cls = getattr(transformers, cls_name)
    return bool(getattr(cls.config_class, "base_model_tp_plan", None) or getattr(cls, "_tp_plan", None))


def shrink(cls_name: str) -> dict[str, Any]:
    import transformers

    config = getattr(transformers, cls_name).config_class()
    values = config.to_dict()
    out: dict[str, Any] = {k: v for k, v in SHRINK.items() if k in values} if re.fullmatch(TEXT_HEADS, cls_name) \
        else _shrunk_keys(values)
    out.update({k: 0.0 for k in ZERO if isinstance(values.get(k), float)})
    # randomness in training (dropout, a MoE router's jitter noise) differs between processes
    out.update({k: 0.0 for k, v in values.items() if RANDOM.search(k) and isinstance(v, float)})
    if "layer_types" in values and isinstance(values["layer_types"], list):
        kinds = values["layer_types"]
        out["layer_types"] = [kinds[i % len(kinds)] for i in range(4)] if kinds else kinds
    for key in ("dtype", "torch_dtype"):
        if key in values and values[key] not in (None, "float32"):
            out[key] = "float32"  # a bf16 default would meet fp32 inputs on meta
    if cls_name.endswith(("ForSequenceClassification", "ForImageClassification")):
        out["num_labels"] = 3
    start, vocab = values.get("decoder_start_token_id"), out.get("vocab_size", values.get("vocab_size"))
    if values.get("is_encoder_decoder") and (start is None or (isinstance(vocab, int) and start >= vocab)) and \
            _accepts(cls_name, "decoder_start_token_id"):
        # the token the decoder starts from, as the released checkpoints write it (T5's and Marian's:
        # the pad id): a bare config leaves it out, or names a row of the full vocabulary (check's E0439)
        out["decoder_start_token_id"] = out.get("pad_token_id", values.get("pad_token_id")) or 0
    for key, sub in values.items():  # a composite model's sub-configs (text_config, vision_config, ...)
        if isinstance(sub, dict) and "model_type" in sub and not re.fullmatch(TEXT_HEADS, cls_name):
            out[key] = _shrunk_sub_config(sub)
    text = out.get("text_config") if isinstance(out.get("text_config"), dict) else out
    vocab = text.get("vocab_size", values.get("vocab_size"))
    for key in ("image_token_id", "image_token_index"):
        token = values.get(key)
        if token is None and key in values and isinstance(vocab, int) and model_kind(cls_name) == "image-text":
            token = vocab  # a config that leaves its image token out (Blip2's image_token_index): the last row
        if isinstance(token, int) and isinstance(vocab, int) and token >= vocab and _accepts(cls_name, key):
            # the image placeholder a checkpoint writes is a row of its full vocabulary (32000, ...):
            # the shrunk text model's last row stands for it (check's E0477)
            out[key] = vocab - 1
    if model_kind(cls_name) == "image-text" and "projection_dim" in values and isinstance(text.get("hidden_size"), int):
        out["projection_dim"] = text["hidden_size"]  # the projector writes the text model's width (E0478)
    if model_kind(cls_name) == "vision" and "image_size" not in values and not any(
            isinstance(sub, dict) and "image_size" in sub for sub in values.values()):
        out["image_size"] = SHRINK_OTHER["image_size"]  # a CNN's config says no image size: written, as E0421's hint asks
    return out


def _accepts(cls_name: str, key: str) -> bool:
    """The class's config declares ``key`` (check refuses a key it does not: E0401)."""
    import transformers

    from ppdsl.core.build import _check_config_keys

    cls = getattr(transformers, cls_name)
    try:
        _check_config_keys(cls.config_class, {key: 0}, cls)
    except Exception:  # noqa: BLE001 - check's refusal of the key
        return False
    return True


def _shrunk_keys(values: dict[str, Any]) -> dict[str, Any]:
    """The other heads' shrink (`SHRINK_OTHER`) for the keys the config has."""
    out = {k: v for k, v in {**SHRINK, **SHRINK_OTHER}.items()
           if k in values and (values[k] is None or isinstance(values[k], type(v)))}
    if isinstance(values.get("patch_size"), int) and "image_size" in values:
        out["patch_size"] = min(values["patch_size"], 8)
    return out


def _shrunk_sub_config(values: dict[str, Any]) -> dict[str, Any]:
    """A nested config block (`config { text_config { ... } }`): the shrink's keys it has."""
    out: dict[str, Any] = _shrunk_keys(values)
    out.update({k: 0.0 for k, v in values.items() if RANDOM.search(k) and isinstance(v, float)})
    if isinstance(values.get("layer_types"), list) and values["layer_types"]:
        out["layer_types"] = [values["layer_types"][i % len(values["layer_types"])] for i in range(4)]
    for key, sub in values.items():
        if isinstance(sub, dict) and "model_type" in sub:
            out[key] = _shrunk_sub_config(sub)
    return out


HEAD_KEYS = ("num_attention_heads", "n_head", "n_heads", "num_heads")
KV_KEYS = ("num_key_value_heads", "n_kv_heads", "num_kv_heads")
WIDTH_KEYS = ("hidden_size", "n_embd", "d_model", "dim")
FFN_KEYS = ("intermediate_size", "n_inner", "ffn_dim", "d_ff", "hidden_dim")
ROTARY_FRACTION_KEYS = ("partial_rotary_factor", "rotary_pct")
EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


def shrink_groups(cls_name: str) -> dict[str, Any]:
    """The default shrink with other head counts: 6 query heads over 2 key/value heads (groups of
    3, not a power of two; tp 2 still divides both), heads of 8 features (hidden 48), and another
    rotary fraction where the config has one (0.5, or 0.25 where the default is 0.5; rotary_dim: half
    a head)."""
    import transformers

    values = getattr(transformers, cls_name).config_class().to_dict()
    out = shrink(cls_name)
    head_dim = 8
    for key in HEAD_KEYS:
        if key in values:
            out[key] = 6
    for key in KV_KEYS:
        if key in values:
            out[key] = 2
    for key in WIDTH_KEYS:
        if key in values:
            out[key] = 6 * head_dim
    for key in FFN_KEYS:
        if key in values:
            out[key] = 96
    fraction = _rotary_fraction(values)
    if fraction is not None:  # another fraction than the default's (transformers 5 keeps it in rope_parameters)
        out[fraction[0]] = 0.25 if fraction[1] == 0.5 else 0.5
    if isinstance(values.get("rotary_dim"), int):
        out["rotary_dim"] = head_dim // 2
    return out


def _rotary_fraction(values: dict[str, Any]) -> tuple[str, float] | None:
    """(the config key, its default) of the fraction of each head the rotary embedding turns."""
    rope = values.get("rope_parameters") if isinstance(values.get("rope_parameters"), dict) else {}
    for key in ROTARY_FRACTION_KEYS:
        for where in (values, rope):
            if isinstance(where.get(key), float):
                return key, where[key]
    return None


def shrink_real(cls_name: str) -> dict[str, Any]:
    """The proportions of the checkpoint the class's default config describes (usually a
    published one): its head and key/value head counts (at most 32), its ffn / hidden ratio, its
    rotary fraction and everything else as they are; only each head narrowed to 4 features (so
    hidden = heads x 4), 4 layers, a vocabulary of 128 and at most 8 experts."""
    import transformers

    values = getattr(transformers, cls_name).config_class().to_dict()
    out = shrink(cls_name)
    for key in (*HEAD_KEYS, *KV_KEYS, *WIDTH_KEYS, *FFN_KEYS, "head_dim", "kv_channels"):
        out.pop(key, None)
    heads_key = next((k for k in HEAD_KEYS if isinstance(values.get(k), int)), None)
    width_key = next((k for k in WIDTH_KEYS if isinstance(values.get(k), int)), None)
    if heads_key is None or width_key is None:
        return out
    heads = min(values[heads_key], 32)
    kv_key = next((k for k in KV_KEYS if isinstance(values.get(k), int)), None)
    kv = values[kv_key] if kv_key else None
    if kv is not None and (kv > heads or heads % kv):
        kv = heads  # a default that only fits the uncapped head count
    head_dim = 4
    out[heads_key] = heads
    if kv_key:
        out[kv_key] = kv
    out[width_key] = heads * head_dim
    if "head_dim" in values and values["head_dim"] is not None:
        out["head_dim"] = head_dim
    ffn_key = next((k for k in FFN_KEYS if isinstance(values.get(k), int)), None)
    if ffn_key:
        out[ffn_key] = max(2, 2 * round(values[ffn_key] / values[width_key] * heads * head_dim / 2))
    for key in EXPERT_KEYS:
        if isinstance(values.get(key), int):
            out[key] = min(values[key], 8)
    if isinstance(values.get("num_experts_per_tok"), int):
        out["num_experts_per_tok"] = min(values["num_experts_per_tok"], 2)
    if isinstance(values.get("rotary_dim"), int):
        out["rotary_dim"] = head_dim if values["rotary_dim"] >= values[width_key] // values[heads_key] else head_dim // 2
    return out


# the configs each class runs at (`--configs`): name -> how its config is made
CONFIGS = {"default": shrink, "groups": shrink_groups, "real": shrink_real}


def _config_lines(config: dict[str, Any], indent: str = "    ") -> str:
    """The config as spec text: plain keys, and nested blocks for sub-configs."""
    lines = []
    for k, v in config.items():
        if isinstance(v, dict):
            lines.append(f"{indent}{k} {{\n{_config_lines(v, indent + '  ')}\n{indent}}}")
        else:
            lines.append(f"{indent}{k} = {json.dumps(v)}")
    return "\n".join(lines)


def spec_text(cls_name: str, config: dict[str, Any], tp: int = 1, kind: str = "text",
              sequence_parallel: bool = False) -> str:
    split = ("tensor_parallel {\n  hf_plan = true\n  sequence_parallel = true\n}\n" if sequence_parallel
             else "tensor_parallel { hf_plan = true }\n") if tp > 1 else ""
    # an image model's positions come from its config; an image-text model's samples hold its image
    # tokens (16 for most at the shrink's 32 x 32 images) before the text: the shrunk text model's
    # 64 positions
    seq = "" if kind == "vision" else "seq_len = 64, " if kind == "image-text" else "seq_len = 16, "
    return f"""ppspec 1
model m {{
  source = hf("{cls_name}")
  config {{
{_config_lines(config)}
  }}
}}
mesh {{ pp = 2, tp = {tp} }}
{split}pipeline {{ style = 1f1b, microbatches = 2 }}
train {{ global_batch = 4, {seq}steps = {2 if tp > 1 else 1}, optimizer = sgd(lr = 0.1), data = synthetic(seed = 0) }}
"""


def pp2_matches(plan: Any) -> tuple[bool, str]:
    """Stage 0 -> stage 1 in this process against the reference: loss and gradients."""
    import torch

    from ppdsl.runtime.stage.build import MicroBatch, build_reference_model, build_stages
    from ppdsl.runtime.verify.reference_loss import reference_loss

    torch.manual_seed(0)
    s0 = build_stages(plan, 0, torch.device("cpu"), 0)[0]
    s1 = build_stages(plan, 1, torch.device("cpu"), 0)[0]
    ref = build_reference_model(plan.model, torch.device("cpu"), 0)
    for m in (s0, s1, ref):
        m.train()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 128, (2, 16), generator=gen)
    from ppdsl.core.task_loss import CLASSIFICATION_TASKS

    classify = plan.model.task in CLASSIFICATION_TASKS
    # a seq2seq model's targets: the sources reversed, as the synthetic data gives them
    labels = torch.tensor([0, 2]) if classify else ids.flip(-1) if plan.model.task == "seq2seq_lm" else ids
    if plan.own_forward.inputs == "pixels":  # images: the token ids a placeholder, as the data source gives them
        pixels = torch.randn((2, *plan.own_forward.input_shape), generator=gen)
        mb = MicroBatch(torch.zeros((2, plan.train.seq_len), dtype=torch.long), labels, pixel_values=pixels)
    elif plan.own_forward.inputs == "image_text":  # the image tokens, then text, as the synthetic data gives them
        from ppdsl.runtime.data.image_text import image_text_source

        batch = image_text_source(plan, None, plan.train.data, 0).batch(0, 0)
        mb = MicroBatch(batch.input_ids[:2], batch.labels[:2], pixel_values=batch.pixel_values[:2])
    elif plan.own_forward.inputs == "speech":  # audio features; the targets: target_len ids (runtime/data/speech.py)
        features = torch.randn((2, *plan.own_forward.input_shape), generator=gen)
        targets = ids[:, : plan.train.data.options_dict["target_len"]]
        mb = MicroBatch(torch.zeros((2, plan.train.seq_len), dtype=torch.long), targets, input_features=features)
    else:
        mb = MicroBatch(ids, labels, token_type_ids=torch.zeros_like(ids) if classify else None)
    h = s0(None, mb)
    x = h.detach().requires_grad_(True)
    loss = s1.loss(s1(x, mb), mb)
    loss.backward()
    h.backward(x.grad)
    want = reference_loss(plan, ref, mb)
    want.backward()
    if abs(loss.item() - want.item()) > 1e-6:
        return False, f"loss {loss.item():.8f} vs {want.item():.8f}"
    from ppdsl.runtime.stage.build import tied_parameter_groups

    ref_grads = dict(ref.named_parameters(remove_duplicate=False))
    grads: dict[str, Any] = {}
    for stage in (s0, s1):
        for n, p in stage.named_parameters():
            grads[n] = p.grad if n not in grads or grads[n] is None else grads[n] + p.grad
    for group in tied_parameter_groups(plan, (s0, s1)):  # tied copies: the sum of their gradients (as verify does)
        parts = [grads.pop(n) for n in group if grads.get(n) is not None]
        if parts:
            grads[group[0]] = sum(parts[1:], parts[0])
    for n, g in grads.items():
        r = ref_grads[n].grad if n in ref_grads else None
        if r is None or g is None:
            if (g is None) != (r is None or not r.abs().sum()):
                return False, f"{n}: gradient on one side only"
            continue
        rel = (g - r).abs().max().item() / max(r.abs().max().item(), 1e-12)
        if rel > 1e-5:
            return False, f"{n}: gradient rel {rel:.2e}"
    return True, ""


def tp_verify(plan: Any, timeout_s: int = 180) -> tuple[str, str]:
    """The plan (pp 2 x tp 2) in a spawned gloo world against one process: verify's verdict, in
    fp32 and, where fp32 differs, again in fp64 (`train.precision = fp64`), which tells rounding
    the model amplifies from a wrong split: ``match (fp64)`` when only fp32 differs."""
    import attrs

    from ppdsl.runtime.verify.world import verify

    report = verify(plan, plan.train.steps, timeout_s=timeout_s, fp64_rerun=False)
    if report.ok:
        return "match", ""
    first = _exceeded(report)
    fp64 = verify(attrs.evolve(plan, train=attrs.evolve(plan.train, precision="fp64")), plan.train.steps, timeout_s=timeout_s + 60,
                  fp64_rerun=False)
    if fp64.ok:
        worst = max(fp64.first_step_grad_diff, fp64.later_grad_diff, fp64.max_param_diff)
        return "match (fp64)", f"fp32: {first.split('(tolerance')[0].strip()}; fp64: OK, largest rel {worst:.1e}"
    return "MISMATCH", f"{first} (fp64: {_exceeded(fp64)})"[:200]


def _exceeded(report: Any) -> str:
    lines = report.render().splitlines()
    return next((line for line in lines if "EXCEEDED" in line or line.startswith("problem")), "verify failed")[:120]


def sweep_one(cls_name: str, tp: int = 1, config_name: str = "default", verify_timeout: int = 180,
              sequence_parallel: bool = False) -> tuple[str, str]:
    from ppdsl.dsl.check import check_text
    from ppdsl.lowering.lower import lower

    try:
        config = CONFIGS[config_name](cls_name)
    except Exception as exc:  # noqa: BLE001 - a sweep reports, never stops
        return "no-build", f"default config: {type(exc).__name__}: {exc}"[:160]
    world = 2 * tp
    result = check_text(spec_text(cls_name, config, tp, model_kind(cls_name), sequence_parallel), f"<{cls_name}>",
                        world=world, model=True)
    errors = [d for d in result.diagnostics if d.is_error]
    if errors:
        d = errors[0]
        if d.code == "E0401":
            return "no-build", d.message[:160]
        if d.code == "E0223":
            return "no-plan", "declares no tensor-parallel plan"
        why = d.message.replace(f"{cls_name} cannot be cut into pipeline stages: ", "")
        return f"refused {d.code}", why.replace("on the meta device: ", "on meta: ")[:240]
    params = result.model_info.total_params
    if params > MAX_PARAMS:  # nested sub-configs (text_config, vision_config) the shrink leaves as they are
        return "too-large", f"the sweep's shrink leaves {params:,} parameters (a nested sub-config): not run"
    try:
        plan = lower(result.spec, world, result.model_info)
        if tp > 1:
            return tp_verify(plan, verify_timeout)
        ok, why = pp2_matches(plan)
    except Exception as exc:  # noqa: BLE001
        return "run-error", f"{type(exc).__name__}: {exc}"[:160]
    return ("match", "") if ok else ("MISMATCH", why)


HEADER = """# Coverage: HF classes no family claims, run through their own forward

Written by `python benchmarks/own_forward_sweep.py --configs default,groups,real --out docs/coverage.md`
(transformers {version}): every `*ForCausalLM` / `*ForSequenceClassification` class of the
installed transformers that no registered family claims, built at three configs (below), checked by
`ppdsl check` and, where check accepts it, run as two pipeline stages against the whole model in
one process (loss <= 1e-6, gradients <= 1e-5 relative). *match*: equal; *refused EXXXX*: check
refuses it before launch with that code and the reason shown; *no-build*: the sweep's config
is not a valid config of the class (not a ppdsl verdict); *too-large*: the shrink still has over
100M parameters and was not run. The registered families are in
[language.md](language.md#families).

"""


HEADER_TP = """# Coverage at pp 2 x tp 2: HF classes no family claims that declare a tensor-parallel plan

Written by `python benchmarks/own_forward_sweep.py --tp 2 --configs default,groups,real --out
docs/coverage_tp.md` (transformers {version}): every class of [coverage.md](coverage.md) whose config
declares `base_model_tp_plan` (or whose class declares `_tp_plan`), at the same configs, checked at world 4 with `mesh {{ pp = 2,
tp = 2 }}` and `tensor_parallel {{ hf_plan = true }}`, and where check accepts it, run by verify's
machinery in a spawned gloo world of 4 for two SGD steps against one process (loss <= 1e-6,
step-1 gradients <= 1e-5 relative, later ones and parameters <= 1e-5). *match*: verify OK;
*match (fp64)*: fp32 differs beyond those tolerances, and verify with `train.precision = fp64`
(both runs in float64, loss <= 1e-7, gradients and parameters <= 1e-6) is OK: the fp32
difference is rounding the model amplifies (the first fp32 line and the largest fp64 difference
shown), not the split; *refused EXXXX*: check refuses it before launch (the reason shown);
*MISMATCH*: verify's first exceeded line, in fp32 and fp64; *no-build* / *too-large*: as in
coverage.md.

"""


def write_table(out: str | None, rows: list[tuple[str, ...]], version: str, total: int,
                header: str = HEADER, quiet: bool = False) -> None:
    """`rows`: (class, config, verdict, why); a summary line per config, then one row each."""
    configs = list(dict.fromkeys(r[1] for r in rows))
    summaries = []
    for config in configs:
        counts: dict[str, int] = {}
        for _, c, verdict, _ in rows:
            if c == config:
                counts[verdict] = counts.get(verdict, 0) + 1
        summaries.append(f"config {config}: {sum(counts.values())} of {total} classes (transformers {version}): "
                         + ", ".join(f"{v} {n}" for v, n in sorted(counts.items())))
    if not quiet:
        print("\n".join(summaries))
    if out:
        with open(out, "w", encoding="utf-8") as f:
            f.write(header.format(version=version) + CONFIGS_NOTE + "".join(f"- {line}\n" for line in summaries)
                    + "\n| class | config | verdict | why |\n| --- | --- | --- | --- |\n")
            f.writelines(f"| {n} | {c} | {v} | {' '.join(w.replace('|', '/').split())} |\n" for n, c, v, w in rows)


CONFIGS_NOTE = """Configs (`--configs`): *default*, the generic tiny shrink (4 heads over 2 key/value heads of 8
features); *groups*, 6 query heads over 2 key/value heads (groups of 3) of 8 features, and another
rotary fraction where the config has one (0.5, or 0.25 where its default is 0.5); *real*, the head and key/value head counts (at most
32), ffn / hidden ratio and rotary fraction of the checkpoint the class's default config describes,
each head 4 features wide, at most 8 experts.

"""


HEADER_KINDS = """# Coverage of the other kinds: seq2seq, vision, image-text and speech classes

Written by `python benchmarks/own_forward_sweep.py --heads other --out docs/coverage_kinds.md`
(transformers {version}): every `*ForConditionalGeneration`, `*ForImageClassification`,
`*ForSpeechSeq2Seq` and `*MTModel` class of the installed transformers, by kind, the kind decided
by its forward's inputs (`input_ids`, `pixel_values`, `input_features` / `input_values`, and
`decoder_input_ids` or `is_encoder_decoder` for two stacks): *text* (one stack on token ids),
*seq2seq* (an encoder and a decoder on token ids), *vision* (images), *image-text* (images and
token ids), *speech* and *speech seq2seq* (audio features), *audio-text* (audio features and token
ids), *other*. Each class is built on the
generic tiny shrink (nested sub-configs shrunk as `config {{ text_config {{ ... }} }}` blocks; images
32 x 32, patches of 8; a vision config without an image size, a CNN's, gets `image_size = 32`
written, as E0421's hint asks), checked at `mesh {{ pp = 2 }}`, and where check accepts it, run as two
pipeline stages against the whole model in one process, as in [coverage.md](coverage.md)
(*match*, *MISMATCH*, *refused EXXXX* with check's reason, *no-build*, *too-large*).
An image-text class runs its images and token ids together (the vision tower in the first stage;
the rows use `seq_len = 64`, the image tokens then text, an in-range `image_token_id` and the
projector's `projection_dim` at the text width) where check's trace can run its image path on
`pixel_values` alone; otherwise, as an audio-text class, it runs on its token ids alone: the text
model, with one process's numbers, while its vision or audio tower never runs (check's warning
W0437 says why). A speech seq2seq class runs on audio features of the config's size.

"""


def write_kinds_table(out: str | None, rows: list[tuple[str, ...]], version: str, names: list[str],
                      quiet: bool = False) -> None:
    """`rows` (class, config, verdict, why) as a section per kind: its summary, then its rows."""
    kinds = {n: model_kind(n) for n in {r[0] for r in rows}}
    sections, summaries = [], []
    for kind in KIND_ORDER:
        mine = [r for r in rows if kinds[r[0]] == kind]
        if not mine:
            continue
        counts: dict[str, int] = {}
        for r in mine:
            counts[r[2]] = counts.get(r[2], 0) + 1
        summary = f"{kind}: {len(mine)} classes: " + ", ".join(f"{v} {n}" for v, n in sorted(counts.items()))
        summaries.append(summary)
        sections.append(f"## {kind}\n\n{summary}\n\n| class | verdict | why |\n| --- | --- | --- |\n" + "".join(
            f"| {n} | {v} | {' '.join(w.replace('|', '/').split())} |\n" for n, _, v, w in mine))
    if not quiet:
        print("\n".join(summaries))
    if out:
        with open(out, "w", encoding="utf-8") as f:
            f.write(HEADER_KINDS.format(version=version) + f"{len(rows)} of {len(names)} classes.\n\n"
                    + "".join(f"- {line}\n" for line in summaries) + "\n" + "\n".join(sections))


def _table_rows(path: str) -> list[tuple[str, ...]]:
    """A written table's rows as (class, config, verdict, why); a table without a config column
    (written before configs existed) is the default config's."""
    rows = []
    for line in open(path, encoding="utf-8"):
        if not line.startswith("| ") or line.startswith("| class") or line.startswith("| ---"):
            continue
        cells = tuple(cell.strip() for cell in line.strip()[1:-1].split("|"))
        rows.append(cells if len(cells) == 4 else (cells[0], "default", *cells[1:]))
    return rows


HEADER_SP = """# Coverage at pp 2 x tp 2 with sequence parallelism

Written by `python benchmarks/own_forward_sweep.py --tp 2 --sequence-parallel --out docs/coverage_sp.md`
(transformers {version}): the classes of [coverage_tp.md](coverage_tp.md), at its default config,
with `tensor_parallel {{ hf_plan = true, sequence_parallel = true }}`: between their split layers the
blocks hold 1/tp of the sequence ([families.md](families.md#tensor-parallelism-of-the-own-forward)).
The verdicts and tolerances are coverage_tp.md's. Where the class's declared plan gathers a column
inside the blocks (E0218: Olmo2's `q_proj`, whose norm takes all heads), splits nothing in the blocks
or leaves a module of them whole (E0215: DiffLlama's plan splits only the embedding; Llama 4's experts),
or replicates key/value heads over tp (E0423), sequence parallelism is refused with that reason: the
same spec without it is coverage_tp.md's row.

"""


def _header(args: Any) -> str:
    return (HEADER_SP if args.sequence_parallel else HEADER_TP) if args.tp > 1 else HEADER


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--budget", type=float, default=None, help="stop after this many seconds")
    ap.add_argument("--only", default=None, help="a regex the class names must match")
    ap.add_argument("--out", default=None, help="write the table (markdown) here")
    ap.add_argument("--after", default=None, help="start after this class (resume a sweep)")
    ap.add_argument("--per-class", type=int, default=None, help="seconds one class may take (30; 240 with --tp)")
    ap.add_argument("--tp", type=int, default=1, help="tp > 1: classes declaring a tp plan, verified at pp 2 x tp")
    ap.add_argument("--sequence-parallel", action="store_true",
                    help="with --tp: sequence_parallel = true beside hf_plan = true (docs/coverage_sp.md)")
    ap.add_argument("--verify-timeout", type=int, default=180,
                    help="--tp: seconds one verify may take (its fp64 rerun 60 more); raise it on a loaded machine")
    ap.add_argument("--heads", choices=("text", "other"), default="text",
                    help="text: *ForCausalLM / *ForSequenceClassification (coverage.md); other: seq2seq, image, "
                         "image-text and speech heads, by kind (coverage_kinds.md)")
    ap.add_argument("--kind", default=None, help="--heads other: only the classes of this kind (vision, seq2seq, ...)")
    ap.add_argument("--configs", default="default", help=f"comma-separated, of {', '.join(CONFIGS)}")
    ap.add_argument("--merge", nargs="+", default=None, help="tables of sweeps run in chunks: write them as one (--out), a class's last row winning")
    args = ap.parse_args(argv)
    if args.merge:
        rows = [row for path in args.merge for row in _table_rows(path)]
        import transformers

        latest = {row[:2]: row for row in rows}  # a class and config run again in a later table: its last verdict
        if args.heads == "other":
            write_kinds_table(args.out, sorted(latest.values()), transformers.__version__, sorted({r[0] for r in latest}))
        else:
            write_table(args.out, sorted(latest.values()), transformers.__version__, len({r[0] for r in latest}),
                        _header(args))
        return 0
    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    names = classes(args.only, OTHER_HEADS if args.heads == "other" else TEXT_HEADS)
    if args.tp > 1:
        names = [n for n in names if declares_tp_plan(n)]
    if args.kind is not None:
        names = [n for n in names if model_kind(n) == args.kind]
    if args.after is not None:
        names = names[names.index(args.after) + 1:]
    names = names[: args.limit]

    def too_slow(*_: Any) -> None:
        raise TimeoutError(f"more than {args.per_class} s")

    if args.per_class is None:
        args.per_class = 240 if args.tp > 1 else 30
    signal.signal(signal.SIGALRM, too_slow)
    configs = args.configs.split(",")
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        ap.error(f"unknown config {', '.join(unknown)}; expected some of {', '.join(CONFIGS)}")
    start, rows = time.time(), []

    def write(rows: list[tuple[str, ...]], quiet: bool = False) -> None:
        if args.heads == "other":
            write_kinds_table(args.out, rows, transformers.__version__, names, quiet)
        else:
            write_table(args.out, rows, transformers.__version__, len(names), _header(args),
                        quiet)
    for name in names:
        for config in configs:
            if args.budget is not None and time.time() - start > args.budget:
                break
            t = time.time()
            signal.alarm(args.per_class)
            try:
                verdict, why = sweep_one(name, args.tp, config, args.verify_timeout, args.sequence_parallel)
            except TimeoutError as exc:  # a shrink too large to build quickly (nested sub-configs)
                verdict, why = "no-build", str(exc)
            finally:
                signal.alarm(0)
            rows.append((name, config, verdict, why))
            print(f"{name:50s} {config:8s} {verdict:14s} {time.time() - t:5.1f}s {why}", flush=True)
        if args.out:  # after each class: a sweep stopped midway keeps its rows (resume with --after, then --merge)
            write(rows, quiet=True)
    write(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
