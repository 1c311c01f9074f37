"""Every block and key of the language, its kind, default and one-line doc.

docs/language.md documents each of these; tests/test_docs.py keeps the two in step.
"""

from __future__ import annotations

from typing import Any

import attrs


@attrs.frozen
class Key:
    name: str
    kind: str  # int | float | bool | enum | path | paths | split | str | call | block | float_or_none | size
    default: Any = None  # None = no default (required where `required`)
    required: bool = False
    choices: tuple[str, ...] = ()
    doc: str = ""


STYLES = ("gpipe", "1f1b", "interleaved", "looped_bfs", "zbh1", "zbv", "interleaved_zb", "dualpipev")  # = ppdsl.core.schedules.STYLES
TP_STYLES = ("column", "row", "vocab", "replicate")
PRECISIONS = ("fp32", "bf16", "fp16", "fp64")
OPTIMIZERS = ("adamw", "adam", "sgd")
LR_SCHEDULES = ("constant", "cosine", "linear")
DATA_KINDS = ("synthetic", "tokens", "text", "jsonl", "csv", "hf_dataset", "image_folder", "audio_folder", "image_text_folder",
              "mix", "holdout")
TOKEN_DTYPES = ("uint16", "uint32")  # token files: flat binary or .npy of these
SOURCES = ("hf", "hf_pretrained", "python")
METRICS_SINKS = ("jsonl", "tensorboard")
PACKING_MODES = ("windows", "documents", "none")  # train.packing (dsl/resolve/packing.py)
NONFINITE_POLICIES = ("skip", "stop")  # train.on_nonfinite

BLOCKS: dict[str, dict[str, Key]] = {
    "model": {
        "source": Key("source", "call", required=True, choices=SOURCES,
                      doc='hf("Class"), hf_pretrained("local/dir") or python("pkg.module:factory")'),
        "config": Key("config", "block", doc="values passed to the HF config class or the factory"),
    },
    "mesh": {
        "tp": Key("tp", "int", 1, doc="tensor-parallel size"),
        "pp": Key("pp", "int", 1, doc="pipeline-parallel size"),
        "dp": Key("dp", "int", None, doc="data-parallel size; default world / (tp * pp * cp)"),
        "ep": Key("ep", "int", 1, doc="expert-parallel size: each MoE layer's experts divided over ep of the dp ranks"),
        "cp": Key("cp", "int", 1, doc="context-parallel size: each sequence split over cp ranks (head-tail chunks)"),
    },
    "tensor_parallel": {
        "sequence_parallel": Key("sequence_parallel", "bool", False, doc="split norms/dropout over tp along the sequence"),
        "hf_plan": Key("hf_plan", "bool", False,
                       doc="add the split rules the HF class declares (base_model_tp_plan, the head's _tp_plan)"),
    },
    "pipeline": {
        "style": Key("style", "enum", "1f1b", choices=STYLES, doc="the pipeline schedule"),
        "chunks": Key("chunks", "int", 1, doc="model chunks (virtual stages) per pipeline rank"),
        "microbatches": Key("microbatches", "int", None, doc="microbatches per step and replica"),
        "microbatch_size": Key("microbatch_size", "int", None, doc="samples per microbatch (instead of microbatches)"),
        "blocks": Key("blocks", "path", None, doc="the repeated layer list cut into stages; default from the model family"),
        "first": Key("first", "paths", None, doc="modules before the blocks, on the first stage"),
        "last": Key("last", "paths", None, doc="modules after the blocks, on the last stage"),
        "split": Key("split", "split", "auto", doc="auto, or explicit block ranges [a:b, ...], one per virtual stage"),
        "balance": Key("balance", "enum", "even", choices=("even", "cost", "measured"), doc="how split = auto spreads blocks"),
        "profile": Key("profile", "str", None,
                       doc="a measured cost profile (ppdsl tune writes one): balance = measured splits on it, plan and schedule predict the step time"),
    },
    "train": {
        "global_batch": Key("global_batch", "int", required=True, doc="samples per optimizer step, all replicas"),
        "seq_len": Key("seq_len", "int", None, doc="tokens per sample (required where the model takes tokens; an image model's positions are traced)"),
        "steps": Key("steps", "int", 10, doc="optimizer steps"),
        "seed": Key("seed", "int", 0, doc="seed of initialisation and synthetic data"),
        "optimizer": Key("optimizer", "call", "adamw", choices=OPTIMIZERS, doc="adamw(lr, weight_decay, betas, eps) | adam(...) | sgd(lr, momentum, weight_decay)"),
        "lr_schedule": Key("lr_schedule", "call", "constant", choices=LR_SCHEDULES, doc="constant() | cosine(warmup, min_lr) | linear(warmup, min_lr)"),
        "precision": Key("precision", "enum", "fp32", choices=PRECISIONS, doc="compute precision: fp32; bf16 / fp16 autocast over fp32 weights; fp64 everything in float64"),
        "grad_clip": Key("grad_clip", "float_or_none", None, doc="clip the global gradient norm to this; none = off"),
        "zero": Key("zero", "int", 0, doc="ZeRO stage: 0 (replicas), 1 (optimizer state sharded over dp) or 3 (FSDP2: weights, gradients and optimizer state sharded over dp)"),
        "reshard_after_forward": Key("reshard_after_forward", "bool", False,
                                     doc="zero = 3: free each block's gathered weights after its forward and backward, "
                                         "every microbatch (less memory, an all-gather per block and microbatch)"),
        "data": Key("data", "call", "synthetic", choices=DATA_KINDS,
                    doc='synthetic(seed) | tokens("file.bin", dtype) | text("corpus.txt", tokenizer) | '
                        'jsonl("f.jsonl", tokenizer, text, label) | csv("f.csv", tokenizer, text, label) | '
                        'hf_dataset("dir or f.parquet", tokenizer, split, text, label, packing, messages, chat_template, target) | '
                        'image_folder("dir", processor, split) | audio_folder("dir", tokenizer, processor) | '
                        'image_text_folder("dir", tokenizer, processor)'),
        "checkpoint": Key("checkpoint", "block", doc="checkpoint { dir = \"...\", every = N }"),
        "activation_checkpointing": Key("activation_checkpointing", "bool", False, doc="recompute each block in backward"),
        "compile": Key("compile", "bool", False,
                       doc="compile each block with torch.compile (inductor), as torchtitan does; not with a "
                           "split-backward style"),
        "log_every": Key("log_every", "int", 1, doc="steps between metric lines"),
        "save_final": Key("save_final", "bool", True, doc="write the trained model to RUN_DIR/final at the end"),
        "eval": Key("eval", "block", doc="eval { data = ..., every = N, batches = K }: held-out evaluation"),
        "packing": Key("packing", "enum", "windows", choices=PACKING_MODES,
                       doc="a causal LM's hf_dataset documents: windows (packed into seq_len windows, an EOS "
                           "between them), documents (the same, attention and positions kept inside each "
                           "document) or none (one padded sample each); left out: each source's packing argument"),
        "metrics": Key("metrics", "enum", "jsonl", choices=METRICS_SINKS,
                       doc="jsonl (RUN_DIR/metrics.jsonl) or tensorboard (metrics.jsonl and event files)"),
        "peak_tflops": Key("peak_tflops", "float_or_none", None,
                           doc="peak dense TFLOP/s of one device at the run's precision, for MFU; none = no MFU"),
        "trace": Key("trace", "bool", False, doc="record every rank's actions per step: RUN_DIR/trace.json, bubble in metrics"),
        "hang_timeout": Key("hang_timeout", "float_or_none", 60.0,
                            doc="seconds without progress after which the hang watchdog names the rank and ends the job; "
                                "off (or none) = no watchdog"),
        "on_nonfinite": Key("on_nonfinite", "enum", "skip", choices=NONFINITE_POLICIES,
                            doc="a step whose loss or a gradient is inf/nan: skip its update (stop after "
                                "max_nonfinite in a row), or stop at once"),
        "max_nonfinite": Key("max_nonfinite", "int", 10,
                             doc="on_nonfinite = skip: stop after this many non-finite steps in a row"),
        "device_memory": Key("device_memory", "size", None,
                             doc="memory of one accelerator (80GiB, 141GB, or bytes): check proves every rank's "
                                 "peak fits it (the estimate ppdsl plan prints); none = not stated"),
    },
}

CHECKPOINT_KEYS: dict[str, Key] = {
    "dir": Key("dir", "str", required=True, doc="directory of the run's checkpoints"),
    "every": Key("every", "int", 0, doc="steps between checkpoints; 0 = only at the end"),
}

EVAL_KEYS: dict[str, Key] = {
    "data": Key("data", "call", required=True, choices=DATA_KINDS,
                doc="the held-out data, a data source like train.data's; synthetic(seed) defaults to seed + 1"),
    "every": Key("every", "int", 0, doc="steps between evaluations; 0 = only at the end (there is always one at the end)"),
    "batches": Key("batches", "int", 1, doc="global batches per evaluation"),
}

# call arguments: name -> (kind, default)
OPTIMIZER_ARGS: dict[str, dict[str, tuple[str, Any]]] = {
    "adamw": {"lr": ("float", 1e-3), "weight_decay": ("float", 0.01), "betas": ("floats2", (0.9, 0.999)), "eps": ("float", 1e-8)},
    "adam": {"lr": ("float", 1e-3), "weight_decay": ("float", 0.0), "betas": ("floats2", (0.9, 0.999)), "eps": ("float", 1e-8)},
    "sgd": {"lr": ("float", 1e-2), "momentum": ("float", 0.0), "weight_decay": ("float", 0.0)},
}


def optimizer_slots(name: str, momentum: float = 0.0) -> int:
    """Tensors of optimizer state per parameter (each the parameter's size): Adam's two moments,
    SGD's momentum buffer (none without momentum). The memory estimates (lowering/memory.py) and
    W0317 (zero = 1 with nothing to shard) use it."""
    if name in ("adam", "adamw"):
        return 2
    if name == "sgd":
        return 1 if momentum else 0
    raise ValueError(f"unknown optimizer {name!r}")


# call options torch refuses, or that mean nothing: name -> (holds(value, all options), what it must be)
OPTION_RANGES: dict[str, tuple[Any, str]] = {
    "lr": (lambda v, o: v > 0, "positive"),
    "eps": (lambda v, o: v > 0, "positive"),
    "weight_decay": (lambda v, o: v >= 0, "at least 0"),
    "momentum": (lambda v, o: v >= 0, "at least 0"),
    "betas": (lambda v, o: 0 <= v < 1, "a list of two numbers in [0, 1)"),
    "warmup": (lambda v, o: v >= 0, "at least 0"),
    "min_lr": (lambda v, o: 0 <= v <= o["lr"], "between 0 and the optimizer's lr"),
}
LR_SCHEDULE_ARGS: dict[str, dict[str, tuple[str, Any]]] = {
    "constant": {"warmup": ("int", 0)},
    "cosine": {"warmup": ("int", 0), "min_lr": ("float", 0.0)},
    "linear": {"warmup": ("int", 0), "min_lr": ("float", 0.0)},
}
# data sources; `path` (and `tokenizer` for text, jsonl, csv) are required: resolve/data.py says so.
# Relative paths are relative to the spec file's directory; `seed` none: train.seed.
DATA_ARGS: dict[str, dict[str, tuple[str, Any]]] = {
    "synthetic": {"seed": ("int", None)},
    "tokens": {"path": ("str", None), "dtype": ("str", None), "seed": ("int", None)},  # dtype none: .npy header, else uint16
    "text": {"path": ("str", None), "tokenizer": ("str", None), "seed": ("int", None)},
    "jsonl": {"path": ("str", None), "tokenizer": ("str", None), "text": ("str", "text"), "label": ("str", "label"),
              "seed": ("int", None)},
    "csv": {"path": ("str", None), "tokenizer": ("str", None), "text": ("str", "text"), "label": ("str", "label"),
            "seed": ("int", None)},
    # Parquet / Arrow files, a datasets save_to_disk directory or JSON lines (ppdsl.core.tables);
    # split none: "train" of a DatasetDict; packing: documents of a causal LM packed into windows;
    # messages: the field of conversations ({role, content} lists) for chat fine-tuning, rendered by
    # chat_template (a .jinja file) or the tokenizer's own template, the loss on the assistant's tokens;
    # target: the field of the targets of an encoder-decoder model (source/target pairs, `text` the source)
    "hf_dataset": {"path": ("str", None), "tokenizer": ("str", None), "split": ("str", None), "text": ("str", "text"),
                   "label": ("str", "label"), "packing": ("bool", True), "seed": ("int", None),
                   "messages": ("str", None), "chat_template": ("str", None), "target": ("str", None)},
    # a folder of class sub-folders of images, for a model fed images (ppdsl.core.image_folder);
    # processor none: the model's default image processor at its image size (runtime/data/images.py)
    "image_folder": {"path": ("str", None), "processor": ("str", None), "split": ("str", None), "seed": ("int", None)},
    # wav files and dir/transcripts.jsonl ({"audio": "a.wav", "text": "..."} per line) for a speech model
    # (ppdsl.core.audio_folder); processor: a saved HF feature extractor's directory (none: hf_pretrained's own)
    "audio_folder": {"path": ("str", None), "tokenizer": ("str", None), "processor": ("str", None), "seed": ("int", None)},
    # images and dir/captions.jsonl ({"image": "a.png", "text": "..."} per line) for an image-text model
    # (ppdsl.core.image_folder); processor: a saved HF image processor's directory (none: the model's default)
    "image_text_folder": {"path": ("str", None), "tokenizer": ("str", None), "processor": ("str", None),
                          "seed": ("int", None)},
}
DATA_REQUIRED: dict[str, tuple[str, ...]] = {
    "synthetic": (), "tokens": ("path",), "text": ("path", "tokenizer"),
    "jsonl": ("path", "tokenizer"), "csv": ("path", "tokenizer"), "hf_dataset": ("path", "tokenizer"),
    "image_folder": ("path",), "audio_folder": ("path", "tokenizer"), "image_text_folder": ("path", "tokenizer"),
}
# sources made of sources (runtime/data/mix.py): mix(source, source, ..., weights, seed), the sources
# positional, weights none: equal; holdout(fraction): train.eval.data, that fraction of train.data's items
DATA_MIX_ARGS: dict[str, dict[str, tuple[str, Any]]] = {
    "mix": {"weights": ("floats", None), "seed": ("int", None)},
    "holdout": {"fraction": ("float", None)},
}
DATA_PATH_ARGS = ("path", "tokenizer", "chat_template", "processor")  # resolved against the spec file's directory
TP_STYLE_ARGS: dict[str, dict[str, tuple[str, Any]]] = {
    "column": {"fused": ("int", 1), "gather_output": ("bool", False)},
    "row": {},
    "vocab": {"pad_to": ("int", None)},
    "replicate": {},
}
