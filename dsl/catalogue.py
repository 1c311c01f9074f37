"""Every diagnostic code, declared once: its severity, its stage, its one-line title, and what it
depends on. Constructing a diagnostic looks its code up here (dsl/diagnostics.py), the table of
docs/diagnostics.md is generated from here, check's cascade (which errors hide which) reads it,
and the language server links each diagnostic to its section of the docs.

Regenerate the docs' table after a change: `python -m ppdsl.dsl.catalogue --write-docs`.
"""

from __future__ import annotations

import enum
import re
import sys
from pathlib import Path
from types import MappingProxyType
from typing import Mapping

import attrs


class Severity(str, enum.Enum):
    ERROR = "error"
    WARNING = "warning"
    NOTE = "note"


@attrs.frozen
class Hide:
    """Diagnostics of `codes` that a rule's failure makes meaningless: all of them, or (`within`) those
    that point inside that block of the spec."""

    codes: tuple[str, ...]
    within: str | None = None


@attrs.frozen
class Rule:
    code: str
    severity: Severity
    stage: str  # the stage(s) that report it, as docs/diagnostics.md's table shows them
    title: str  # the one-line summary of docs/diagnostics.md's table
    # spec keys whose value the rule is about: when that value itself is reported as unusable (by
    # a rule with `invalid_value`, pointing at the key), this rule is not reported
    depends_on: tuple[str, ...] = ()
    invalid_value: tuple[str, ...] = ()  # keys whose written value it can report as unusable
    hides: tuple[Hide, ...] = ()
    hides_entry: bool = False  # every other diagnostic inside the span it points at is its consequence

    @property
    def anchor(self) -> str:
        return self.code.lower()

    @property
    def doc(self) -> str:
        """Where it is documented, relative to the repository root."""
        return f"docs/diagnostics.md#{self.anchor}"


def E(code: str, stage: str, title: str, **kw: object) -> Rule:
    return Rule(code, Severity.ERROR, stage, title, **kw)  # type: ignore[arg-type]


def W(code: str, stage: str, title: str, **kw: object) -> Rule:
    return Rule(code, Severity.WARNING, stage, title, **kw)  # type: ignore[arg-type]


def N(code: str, stage: str, title: str, **kw: object) -> Rule:
    return Rule(code, Severity.NOTE, stage, title, **kw)  # type: ignore[arg-type]


# In the order of docs/diagnostics.md's table.
_RULES = (
    E("E0000", "read", "cannot read the spec file"),
    E("E0001", "read", "not a UTF-8 text file, or over 4 MiB"),
    E("E0002", "parse", "syntax error"),
    E("E0003", "parse", "brackets nested deeper than 64 levels"),
    E("E0004", "parse", "a number out of range"),
    E("E0005", "command line", "a bad `--set`, `--world` or `--device-memory`, or a schedule `ppdsl schedule --style` cannot build"),
    E("E0100", "resolve", "unknown block, or a name on a block other than `model`"),
    E("E0101", "resolve", "unknown key, or an entry in the wrong block"),
    E("E0102", "resolve", "a required block or key is missing"),
    E("E0103", "resolve", "a value of the wrong kind"),
    E("E0104", "resolve", "given twice"),
    E("E0105", "resolve", "unknown name, or defined in terms of itself"),
    E("E0106", "resolve", "missing or unsupported `ppspec` version"),
    E("E0107", "resolve", "unknown choice: style, precision, optimizer, option, ..."),
    E("E0108", "resolve", "an optimizer or LR-schedule option out of range (`lr <= 0`, a beta outside `[0, 1)`, ...)"),
    E("E0109", "resolve", "`first` or `last` names the block list, or a module inside it"),
    E("E0110", "rules", "`a / b` is not a whole number", hides_entry=True),
    # a mesh that does not fit the world, or a tp / pp that is no size, leaves dp meaningless
    E("E0201", "rules", "the world does not split into `tp * pp * cp * dp`", depends_on=("mesh.tp", "mesh.pp", "mesh.cp"),
      hides=(Hide(("E0302",)), Hide(("E0110",), within="mesh"))),
    E("E0202", "rules", "`tp`, `pp`, `ep`, `cp` or `chunks` is not a positive whole number",
      invalid_value=("mesh.tp", "mesh.pp", "mesh.ep", "mesh.cp", "pipeline.chunks"),
      hides=(Hide(("E0302",)), Hide(("E0110",), within="mesh"))),
    E("E0203", "rules, model", "vocabulary not divisible by `tp`", depends_on=("mesh.tp",)),
    E("E0204", "rules", "attention heads not divisible by `tp`", depends_on=("mesh.tp",)),
    E("E0205", "rules", "key/value heads not divisible by `tp`", depends_on=("mesh.tp",)),
    E("E0206", "rules", "feed-forward size not divisible by `tp`", depends_on=("mesh.tp",)),
    E("E0207", "rules", "hidden size not divisible by `tp`", depends_on=("mesh.tp",)),
    E("E0208", "rules", "a split classifier whose labels `tp` does not divide", depends_on=("mesh.tp",)),
    E("E0209", "model", "column split: `out_features` not divisible by `tp`"),
    E("E0210", "model", "row split: `in_features` not divisible by `tp`"),
    E("E0211", "model", "fused column split: the parts do not divide"),
    E("E0212", "model", "a row split whose input is not split"),
    E("E0213", "rules", "`sequence_parallel` with `tp = 1`", depends_on=("mesh.tp",)),
    E("E0214", "rules", "`sequence_parallel`: `seq_len` not divisible by `tp`", depends_on=("mesh.tp",)),
    E("E0215", "model", "`sequence_parallel`: a block, or its attention, is not split over `tp`"),
    E("E0216", "rules", "`seq_len` longer than the model's positions"),
    W("W0217", "rules", "`tp > 1` but no rule splits a module"),
    E("E0218", "model", "`sequence_parallel` with a `column(gather_output = true)` inside the blocks"),
    E("E0219", "model", "a column split's output reaches a layer that takes it whole"),
    N("N0219", "model", "the forward could not be traced: pairing checked per block only"),
    E("E0220", "model", "layers whose outputs meet before a row split are not split alike"),
    E("E0221", "model", "`fused` does not match the parts the forward splits the output into"),
    E("E0222", "model", "one of a tied pair of parameters split, the other not (or differently)"),
    E("E0223", "resolve", "`hf_plan = true` for a class that declares no tensor-parallel plan"),
    E("E0224", "model", "a column split's columns fall out of line with the groups the forward views them in"),
    W("W0223", "resolve", "`hf_plan`: entries of the HF plan with no ppdsl split style stay replicated"),
    E("E0240", "rules", "`ep` does not divide `dp` (expert parallelism borrows data-parallel ranks)",
      depends_on=("mesh.ep",)),
    E("E0241", "rules", "`ep > 1` with ZeRO, sequence parallelism or a split-backward schedule"),
    E("E0242", "model", "`ep > 1` for a model without experts (a dense model)"),
    E("E0243", "rules, model", "the experts of a MoE layer not divisible by `ep`", depends_on=("mesh.ep",)),
    E("E0244", "rules", "`cp > 1` with ZeRO, sequence parallelism, a split-backward schedule or `ep > 1`"),
    E("E0245", "rules", "`seq_len` not divisible by `2 * cp` (two chunks of each sequence per cp rank)",
      depends_on=("mesh.cp",)),
    E("E0246", "model", "`cp > 1` for a model whose attention or positions context parallelism cannot split"),
    E("E0301", "rules", "`pp > 1` without microbatches", depends_on=("mesh.pp",)),
    E("E0302", "rules", "the global batch does not split into replicas and microbatches",
      invalid_value=("pipeline.microbatches", "pipeline.microbatch_size")),
    E("E0303", "rules", "the style runs one chunk, but `chunks > 1`", depends_on=("pipeline.chunks",)),
    W("W0304", "schedule", "fewer microbatches than pipeline ranks: it runs, mostly idle"),
    E("E0304", "rules", "dualpipev: fewer microbatches than virtual stages (2 * pp)",
      depends_on=("mesh.pp", "pipeline.microbatches")),
    E("E0305", "rules", "the style needs `chunks >= 2`", depends_on=("pipeline.chunks",)),
    E("E0306", "rules", "interleaved: `microbatches` not a multiple of `pp`", depends_on=("mesh.pp", "pipeline.microbatches")),
    E("E0307", "rules", "a V style (zbv, dualpipev): `chunks` is not 2", depends_on=("pipeline.chunks",)),
    E("E0308", "rules, model", "fewer blocks than virtual stages", depends_on=("mesh.pp", "pipeline.chunks")),
    E("E0309", "model", "split ranges skip or repeat blocks"),
    E("E0310", "rules", "the number of split ranges is not `pp * chunks`", depends_on=("mesh.pp", "pipeline.chunks")),
    E("E0311", "model", "an empty split range"),
    E("E0312", "schedule", "the generated schedule is incomplete or deadlocks (a ppdsl bug)"),
    E("E0313", "resolve", "`balance = measured` without a `profile`"),
    E("E0314", "data", "the cost profile does not exist, cannot be read or is not a profile"),
    E("E0316", "data", "the cost profile is of another model or shape (`seq_len`, blocks, parameters)"),
    E("E0315", "rules", "ZeRO stage other than 0, 1 or 3"),
    W("W0317", "world", "`zero = 1` or `3` with nothing to shard: `dp = 1`, or (`zero = 1`) `sgd` without momentum"),
    W("W0318", "world", "`reshard_after_forward = true` without `zero = 3`: no weights are gathered, nothing to free"),
    E("E0320", "resolve", "`hang_timeout` is not a positive number of seconds or `off`"),
    W("W0320", "resolve", "`hang_timeout` below 5 s: a slow step may be taken for a hang"),
    W("W0325", "data", "`max_nonfinite` given with `on_nonfinite = stop`: it has no effect"),
    W("W0326", "data", "`on_nonfinite = stop` with `precision = fp16`: the loss scaler's first overflow stops the run"),
    E("E0332", "rules", "`compile = true` with a split-backward style (zbh1, zbv, interleaved_zb, dualpipev)",
      depends_on=("train.compile", "pipeline.style")),
    E("E0330", "run", "an elastic `--nnodes MIN:MAX`: the spec does not hold at every world size it can make"),
    E("E0331", "run", "an elastic `--nnodes MIN:MAX` with checkpoints: the global batch differs between its worlds"),
    N("N0400", "model", "model-level checks skipped: torch is not installed"),
    E("E0401", "model", "the model cannot be built"),
    W("W0401", "resolve", "`hf_pretrained`: `config.json` cannot be read"),
    E("E0402", "model", "a path or pattern names no module of the model"),
    W("W0403", "model", "the config's layer count differs from the model's"),
    E("E0404", "model", "a module with parameters is held by no stage"),
    E("E0405", "model", "a split style applied to the wrong kind of module"),
    E("E0407", "model", "a config value the model's family cannot run"),
    E("E0408", "model", "the model is too large to build for checking (blocks or parameters)"),
    E("E0409", "model", "`zero = 3` with a scalar (0-dim) parameter, which FSDP2 cannot shard"),
    E("E0410", "data", "a data file or tokenizer directory does not exist"),
    E("E0411", "data", "a data path is not a regular file (or directory), or cannot be read"),
    E("E0412", "data", "a malformed token file: size, `.npy` dtype or shape"),
    E("E0413", "data", "token ids beyond the model's vocabulary"),
    E("E0414", "data", "too little data for one global batch"),
    E("E0415", "data", "a tokenizer directory without a usable tokenizer"),
    E("E0416", "data", "malformed text, JSON-lines or CSV data, or a missing text / label field"),
    E("E0417", "data", "a label that is not a class id of the model"),
    E("E0418", "data", "the kind of data does not fit the model (token stream vs labelled examples)"),
    W("W0419", "data", "`metrics = tensorboard`, but the tensorboard package is not installed"),
    E("E0419", "resolve, data", "with `--no-model`: a file outside the spec's directory"),
    E("E0431", "data", "`hf_dataset` names Parquet or Arrow files, but pyarrow is not installed"),
    E("E0433", "data", "`hf_dataset(..., messages = ...)`: the tokenizer has no chat template and the spec names none"),
    N("N0481", "data", "`hf_dataset(..., messages = ...)`: conversations of check's sample longer than `seq_len`: their tails are cut"),
    E("E0450", "data", "`image_folder`: no class sub-folders, or a class sub-folder without image files"),
    E("E0451", "data", "`image_folder`: the number of class sub-folders differs from the model's `num_labels`"),
    E("E0452", "data", "`image_folder`: a file Pillow cannot decode as an image (or Pillow is not installed)"),
    E("E0453", "data", "`image_folder`: the processor directory holds no readable `preprocessor_config.json`, or its images are not the model's size"),
    E("E0454", "data", "`mix(...)`: fewer than two sources, weights that are not one positive number per source, or a part that is not a file source"),
    E("E0455", "data", "`mix(...)`: sources that give different kinds of samples (token windows, padded documents, examples, conversations, pairs)"),
    E("E0470", "data", "`train.packing`: a source without documents to pack that way (documents and none need a causal LM's `hf_dataset` documents or conversations; windows its documents or a token stream; not examples, pairs or images), or a conversation source's own `packing` argument"),
    E("E0471", "data", "`packing` given twice: a source's `packing` argument together with `train.packing`"),
    E("E0472", "model", "`train.packing = documents` for a model that cannot be told where each document starts (no position ids, positions that do not count from 0, attention outside transformers' interface, or document masks under flash attention)"),
    E("E0473", "data", "`train.packing = documents` with `cp > 1` (or a `cp` the world size decides): context parallelism's attention ignores document boundaries"),
    E("E0456", "data", "`holdout(fraction)`: outside `train.eval.data`, a fraction outside (0, 1), data it cannot hold out of, or no eval (or training) batch left"),
    E("E0467", "data", "`audio_folder`: no readable `transcripts.jsonl`, a malformed line, a missing `audio` / `text` field, or a missing audio file"),
    E("E0468", "data", "`audio_folder`: a file that is not a PCM `.wav` the standard library reads, or of another sample rate than the feature extractor's"),
    E("E0469", "data", "`audio_folder`: the feature extractor directory holds no readable `preprocessor_config.json`, or its features are not the model's shape"),
    E("E0479", "data", "`image_text_folder`: no readable `captions.jsonl`, a malformed line, a missing `image` / `text` field, an image that is missing or that Pillow cannot decode, or a caption (or the padding) tokenized into the image token"),
    E("E0420", "model", "own forward: a block receives state from another block or the embeddings, besides its hidden state"),
    E("E0421", "model", "own forward: a model whose input is neither token ids, images nor speech features with a decoder (`input_values`, ...)"),
    E("E0422", "model", "own forward: shared layers (one module at several block indices, or run twice)"),
    E("E0423", "model", "own forward: tensor parallelism it does not run (sequence parallelism beyond one token stack, a tp not known before launch)"),
    E("E0424", "model", "own forward: no block list found in the traced forward, or it cannot be traced"),
    E("E0425", "model", "own forward: the forward cut into two stages fails on meta, or its loss does not fit the labels"),
    E("E0429", "model", "a plan needs what check without the model cannot give (the own forward's layout, the block count), or a family"),
    E("E0427", "model", "own forward: `zero = 3` with a module every stage holds, on ranks holding several stages"),
    E("E0426", "model", "own forward: the split over tp fails at one rank's local shapes on meta, or splits a layer that is not a plain one"),
    E("E0432", "model", "a config value outside what the model's code runs (a dropout rate outside [0, 1], no vocabulary rows, no labels)"),
    E("E0428", "model", "the model's forward fails at the config written (a shape that does not fit: heads, rotary dimension)"),
    E("E0434", "model", "a nested config block (`key { ... }`) for a key that is not a sub-config of the model's config"),
    E("E0435", "model", "a model fed images: `seq_len` is written (its blocks' positions are traced from the config)"),
    E("E0436", "model", "inputs and data disagree: a model fed images with an option that needs tokens (context parallelism, token data), or `image_folder` for a model fed tokens"),
    E("E0438", "model", "an encoder-decoder model: an option it does not run yet (context parallelism, a data source other than `synthetic` and `hf_dataset` pairs, alone or mixed)"),
    E("E0439", "model", "an encoder-decoder model cannot make its decoder's input from the labels (no `decoder_start_token_id`)"),
    E("E0481", "model", "the width of the hidden state the blocks pass on cannot be told: no hidden size in the config, and the first module is not an embedding"),
    E("E0442", "model", "source/target pairs and the model disagree: `hf_dataset` without `target` for an encoder-decoder model, or `target` for a model that is not one"),
    E("E0465", "model", "a speech model (`input_features`): an option it does not run (context parallelism), data that gives token ids, or `audio_folder` for a model not fed speech"),
    E("E0466", "model", "a speech model: `seq_len` (the target's token length) beyond the config's `max_target_positions`"),
    E("E0475", "model", "an image-text model: `seq_len` leaves no text token after the image's placeholder tokens"),
    E("E0476", "model", "an image-text model: an option it does not run yet (context parallelism, a data source other than `synthetic` and `image_text_folder`)"),
    E("E0477", "model", "an image-text model: `image_token_id` is not a row of the language model's vocabulary"),
    E("E0478", "model", "an image-text model: its image features are not as wide as its token embeddings"),
    E("E0480", "model", "`image_text_folder` data for a model that does not take images with token ids"),
    W("W0437", "model", "own forward: modules with parameters the forward never runs on the inputs ppdsl feeds (not trained)"),
    W("W0430", "model", "torch or transformers installed outside the range ppdsl is tested with"),
    E("E0440", "memory", "a rank's peak memory is more than `train.device_memory` (or `--device-memory`)"),
    N("N0440", "memory", "world sizes left out of the verdict: a rank does not fit `train.device_memory` there"),
    N("N0441", "memory", "`train.device_memory` not proven: the model was not built (`--no-model`)"),
    W("W0440", "memory", "a rank needs more memory than any accelerator holds (288 GiB)"),
    E("E0501", "rules", "a `require` does not hold"),
    E("E0601", "world", "no world size satisfies every rule"),
)

RULES: Mapping[str, Rule] = MappingProxyType({r.code: r for r in _RULES})
assert len(RULES) == len(_RULES), "a code declared twice"


def rule(code: str) -> Rule:
    """The declaration of `code`; an undeclared code is a bug in ppdsl."""
    r = RULES.get(code)
    assert r is not None, f"diagnostic code {code} is not declared in dsl/catalogue.py"
    return r


def admits(code: str, severity: Severity) -> bool:
    """A diagnostic of `code` may have `severity`: the declared one, or `note` for an error a note
    explains (E0601's notes keep the code of the rule they name)."""
    r = RULES.get(code)
    return r is not None and (severity is r.severity or
                              (severity is Severity.NOTE and r.severity is Severity.ERROR))


def dependent_on(keys: set[str]) -> set[str]:
    """The codes of the rules about any of `keys`."""
    return {r.code for r in _RULES if keys.intersection(r.depends_on)}


# ---- docs/diagnostics.md's table ---------------------------------------------------------------

DOCS = Path(__file__).resolve().parent.parent / "docs" / "diagnostics.md"
TABLE_HEAD = "| code | severity | stage | in short |\n| --- | --- | --- | --- |\n"
_TABLE = re.compile(re.escape(TABLE_HEAD) + r"(?:\|.*\n)*")


def table_markdown() -> str:
    return TABLE_HEAD + "".join(f"| [{r.code}](#{r.anchor}) | {r.severity.value} | {r.stage} | {r.title} |\n"
                                for r in _RULES)


def with_table(doc: str) -> str:
    """`doc` (docs/diagnostics.md's text) with its catalogue table as generated from RULES."""
    assert _TABLE.search(doc), "docs/diagnostics.md has no catalogue table"
    return _TABLE.sub(lambda _: table_markdown(), doc, count=1)


def main(argv: list[str]) -> int:
    if argv != ["--write-docs"]:
        print("usage: python -m ppdsl.dsl.catalogue --write-docs", file=sys.stderr)
        return 2
    text = DOCS.read_text(encoding="utf-8")
    DOCS.write_text(with_table(text), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
