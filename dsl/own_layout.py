"""Where a model's own forward can be cut into pipeline stages: a trace of one forward on meta.

For an HF class no family claims, the stages run the model's own ``forward``
(core/families/own/): each stage holds the whole skeleton with the block list cut to its range.
That is right only when the forward is ``first modules -> block 0 -> ... -> block n-1 -> last
modules`` with nothing but the hidden state passed from block to block. `trace_layout` runs the
forward once on meta tensors (nothing allocated) and finds, or refuses with the reason:

- the block list: the ``nn.ModuleList`` whose entries each run once, in order, each taking the
  previous one's output as its hidden state (the largest such list: MoE expert lists lie inside;
  an encoder-decoder model's, the encoder's: its decoder runs whole among the ``last`` modules,
  fed the encoder's output on the last stage);
- ``first`` / ``last``: the modules with parameters beside the path to the blocks (children of
  the root, of ``model``, ...) that run before the first block / after the last one (or never);
- ``shared``: the modules beside the blocks whose parameters reach a block other than through its
  hidden state, by a value computed from parameters alone (no token's value in it): DeBERTa-v2's
  ``encoder.rel_embeddings`` (its weight, read directly) and ``encoder.LayerNorm`` over it, which
  every block takes as ``rel_embeddings``. Every stage holds them and computes that value itself;
  their gradients are summed over the pipeline ranks like a tied embedding's;
- ``uncuttable`` (E0420 where pp may exceed 1; the model runs whole at pp = 1): a block
  receives, besides its hidden state, a tensor that an earlier block computed, or a module before
  the blocks from the tokens (a later stage could not compute it), unless the block before it
  returned that tensor: then it is ``carried`` (T5's position bias), and a stage boundary sends
  it with the hidden state;
- refusals (``refusal``; check's code for each in parentheses): ``cross_block_state`` (E0420) the
  hidden state is changed between blocks; ``not_tokens`` (E0421) models whose input is neither token
  ids nor images (Whisper's input_features; `ppdsl.core.model_inputs`: an image model's input,
  the pixels, is tagged like the token ids);
  ``shared_layers`` (E0422) one module at several indices, a list entry run twice, a module
  outside the block list run by the blocks; ``untraceable`` (E0424) no block list could be
  found, or the forward could not be traced; ``cut_fails`` (E0425) the forward, cut into two
  stages at a middle block the way the stages cut it, fails on meta or its loss does not fit
  the labels (`prove_cut`); ``decoder_inputs`` (E0439) an encoder-decoder model that cannot make
  its decoder's input from the labels (T5 without ``decoder_start_token_id``).

`ppdsl.dsl.own_cut_proof.prove_cut` then runs the cut itself, with the mechanics the stage adapter runs
(`ppdsl.core.own_cut`): stage 0 (the embeddings and blocks[:k], stopping after block k-1),
stage 1 (blocks[k:] and the head, fed a meta hidden state of the activation's shape, the
modules before the blocks shape-only stand-ins) and the task's loss (`ppdsl.core.task_loss`)
on its logits, so that what check accepts is what the stages run.

Masks, rotary tables and positions that the blocks receive are fine as long as no parameter's
value reaches them: a tensor only shaped like one (``new_zeros``, ``zeros_like``, ...) does not
carry its source, as the stages' shape-only stand-ins reproduce it.

torch is imported inside the functions only, like `ppdsl.dsl.tp_dataflow`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs

from ppdsl.core.meta_values import meta_autocast, meta_values, scalar_reads, without_values
from ppdsl.core.module_paths import above

if TYPE_CHECKING:
    from torch import nn

__all__ = ["OwnLayout", "trace_layout"]

_TOKENS = "tokens"  # the tag of the input ids and of every value computed from them

# tensor functions whose result has only the shape / dtype of their input, not its values
_SHAPE_ONLY = frozenset({
    "new_zeros", "new_ones", "new_full", "new_empty", "new_tensor", "zeros_like", "ones_like", "full_like",
    "empty_like", "size", "dim", "numel", "__len__", "type_as",
})


@attrs.frozen
class OwnLayout:
    """The layout the own forward runs, or why it cannot (``refusal`` set, the rest empty)."""

    blocks: str = ""
    first: tuple[str, ...] = ()
    last: tuple[str, ...] = ()
    # modules every stage holds: their parameters reach the blocks, not from the tokens (above)
    shared: tuple[str, ...] = ()
    block_output: str = "tensor"  # "tensor" | "tuple": what a block returns (its hidden state first)
    tuple_len: int = 1  # a tuple's length
    # what the forward takes (ppdsl.core.model_inputs): "tokens" | "pixels" | ..., one sample's input shape
    # ((C, H, W) for pixels; () for tokens, whose length is the spec's seq_len; an image-text model:
    # (C, H, W, image tokens, image token id), `model_inputs.image_text_shape`), and the positions
    # of the hidden state entering the first block as traced (pixels: the activation length the
    # stages send, ViT's patches + CLS; tokens: the traced length, not used)
    inputs: str = "tokens"
    input_shape: tuple[int, ...] = ()
    positions: int = 0
    width: int = 0  # the features of that hidden state: the activation's width (0: not traced)
    # one sample's hidden state entering each block, as traced (batch dimension dropped): what a
    # stage boundary before block i carries (Swin's and ConvNext's change between blocks; a token
    # model's length is the trace's, the spec's seq_len replaces it)
    block_shapes: tuple[tuple[int, ...], ...] = ()
    # a model fed images: per block, the plain values among what it returns, (index, value) (Swinv2's
    # and FocalNet's output dimensions, which the forward reads of every block): a block another
    # stage holds returns them as traced (the images are the run's, so are the values)
    block_plain: tuple[tuple[tuple[int, Any], ...], ...] = ()
    # modules with parameters beside the blocks that the forward never runs on the inputs ppdsl
    # feeds (an image-text model's vision tower, given token ids only): held by the last stage,
    # never trained (check's W0437)
    idle: tuple[str, ...] = ()
    # an image-text model traced on token ids alone: why its image path cannot run (W0437 says it)
    image_refused: str = ""
    # parameters held by the modules above the blocks themselves (the root's: Blip2's query_tokens;
    # LLaVA-NeXT's model.image_newline) that the forward reads once the blocks have begun: the first
    # stage holds those parameters, so none may be (check's E0404)
    above_late: tuple[str, ...] = ()
    # why the forward cannot be cut between blocks (check's E0420 where pp may be more than 1),
    # though it runs whole at pp = 1: a block reads a tensor an earlier block computed, other than
    # through the outputs of the block before it
    uncuttable: str = ""
    # per block, what it reads of the block before it besides the hidden state, each (that block's
    # output index, one sample's shape, -1 where it is the sequence length): T5's position bias,
    # computed by block 0 and returned by every block (1, (heads, -1, -1)). A stage boundary before
    # block i carries these after the hidden state (`lowering.boundaries`), and their gradients back
    carried: tuple[tuple[tuple[int, tuple[int, ...]], ...], ...] = ()
    # why the forward cannot run: cross_block_state | not_tokens | shared_layers | untraceable | cut_fails |
    # decoder_inputs | image_width
    # (check says which diagnostic each is: dsl/own_check.py)
    refusal: str | None = None
    reason: str = ""
    # the tp plan the class declares, as HF writes it: its config's base_model_tp_plan (keys under
    # base_prefix) and the class's own _tp_plan (the head); ppdsl reads it for `hf_plan = true`
    hf_tp_base: tuple[tuple[str, str], ...] = ()
    hf_tp_head: tuple[tuple[str, str], ...] = ()
    base_prefix: str = ""

    @property
    def block_outputs(self) -> int:
        """0: a block returns a tensor; n: a tuple of n (as `OwnForward.block_outputs`)."""
        return self.tuple_len if self.block_output == "tuple" else 0

    @property
    def ok(self) -> bool:
        return self.refusal is None


class _Refused(Exception):
    def __init__(self, refusal: str, reason: str) -> None:
        super().__init__(reason)
        self.refusal, self.reason = refusal, reason


def trace_layout(model: nn.Module, config: Any, tokens_only: bool = False) -> OwnLayout:
    """The own-forward layout of ``model`` (built on meta), never raising. ``tokens_only``: an
    image-text model traced on its token ids alone (`text_only_layout`)."""
    try:
        return _trace(model, config, tokens_only)
    except _Refused as exc:
        return OwnLayout(refusal=exc.refusal, reason=exc.reason)
    except Exception as exc:  # any failure of library code: not known to be splittable
        from ppdsl.core.build import exc_text

        return OwnLayout(refusal="untraceable", reason=f"its forward could not be traced on the meta device: {exc_text(exc)}")


def text_only_layout(model: nn.Module, config: Any, refused: OwnLayout) -> OwnLayout:
    """An image-text model whose image path ppdsl cannot run (``refused``: why): its layout on
    token ids alone, the vision modules idle (W0437 names them and this reason)."""
    layout = trace_layout(model, config, tokens_only=True)
    return attrs.evolve(layout, image_refused=refused.reason) if layout.ok else layout


def _image_tokens(model: nn.Module, pixels: Any, config: Any) -> tuple[int, int]:
    """(image tokens per image, their id) of an image-text model: the features its own
    ``get_image_features`` yields for one image of the config's size (on meta: LLaVA's vision
    tower's patches after the feature-select strategy), and the config's ``image_token_id``
    (``image_token_index`` in older configs), which the input ids hold where the features go."""
    import torch

    token = next((getattr(model.config, k) for k in ("image_token_id", "image_token_index")
                  if isinstance(getattr(model.config, k, None), int)), None)
    get = getattr(model, "get_image_features", None)
    if token is None or get is None:
        raise _Refused("untraceable", f"{type(model).__name__} has no " + (
            "image_token_id in its config" if token is None else "get_image_features") +
            ": ppdsl cannot tell where its image's features go among the tokens")
    from ppdsl.core.meta_values import meta_values

    with torch.no_grad(), meta_values():  # Blip2's Q-Former reads a value (.item()) on its way
        out = get(pixel_values=pixels)
    feats = getattr(out, "pooler_output", out)
    parts = list(feats) if isinstance(feats, (list, tuple)) else [feats]
    if not parts or not all(isinstance(f, torch.Tensor) and f.dim() >= 2 for f in parts):
        raise _Refused("untraceable", f"{type(model).__name__}.get_image_features gives no features to count")
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    hidden, width = getattr(embed, "embedding_dim", None), parts[0].shape[-1]
    if isinstance(hidden, int) and width != hidden:  # HF's own check is a value check, off on meta
        raise _Refused("image_width", f"{type(model).__name__}'s image features are {width} wide, its token embeddings "
                                      f"{hidden}: its forward puts the features in the embeddings' place")
    total = sum(f.numel() // f.shape[-1] for f in parts)
    return total // pixels.shape[0], int(token)


def _trace(model: nn.Module, config: Any, tokens_only: bool = False) -> OwnLayout:
    import torch
    from torch import nn
    from torch.overrides import TorchFunctionMode
    from torch.utils._pytree import tree_flatten

    from ppdsl.core import model_inputs

    from .tp_dataflow import _seq_len

    name = type(model).__name__
    kind = model_inputs.kind_of(model)
    if tokens_only and kind == model_inputs.IMAGE_TEXT:
        kind = model_inputs.TOKENS
    if kind is None:
        raise _Refused("not_tokens", f"{name}'s forward takes neither input_ids, pixel_values nor input_features with "
                                     "decoder_input_ids: its input is neither tokens, images nor speech")
    try:
        inputs = model_inputs.meta_inputs(model, 1, _seq_len(dict(config)), config, kind=kind)
    except ValueError as exc:
        raise _Refused("not_tokens", f"{name} takes {model_inputs.INPUT_NAMES[kind]}, but {exc}") from None
    image: tuple[int, ...] = ()
    if kind == model_inputs.IMAGE_TEXT:  # (C, H, W, image tokens, their id): model_inputs.image_text_shape
        import torch.fx.experimental._config as fx_config

        with fx_config.patch(meta_nonzero_assume_all_nonzero=True), meta_autocast():
            image = (*inputs["pixel_values"].shape[1:], *_image_tokens(model, inputs["pixel_values"], config))
    if kind in model_inputs.DECODER_KINDS:
        _prove_decoder_inputs(model)
    lists = {p: m for p, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)
             and next(m.parameters(), None) is not None}
    for path, m in lists.items():
        if len({id(c) for c in m}) < len(m):
            raise _Refused("shared_layers", f"'{path}' holds one module at several indices (shared layers)")
    entry_of = {id(c): (path, i) for path, m in lists.items() for i, c in enumerate(m)}

    clock = [0]
    calls: dict[tuple[str, int], list[tuple[int, int]]] = {}  # list entry -> [(start, end)] per call
    hidden_in: dict[tuple[str, int], int] = {}  # list entry -> id of its hidden-state input
    hidden_out: dict[tuple[str, int], int] = {}  # list entry -> id of its output hidden state
    hidden_shape: dict[tuple[str, int], tuple[int, ...]] = {}  # list entry -> its hidden-state input's shape
    outputs_tuple: dict[str, int] = {}  # list -> 0 (its entries return tensors) or their tuples' length
    plain_out: dict[tuple[str, int], tuple[tuple[int, Any], ...]] = {}  # list entry -> its plain outputs
    other_inputs: dict[tuple[str, int], list[tuple[int, frozenset[str]]]] = {}  # (id, sources) of each
    out_index: dict[tuple[str, int], dict[int, int]] = {}  # list entry -> id of a tensor it returns -> its index
    out_shape: dict[tuple[str, int], dict[int, tuple[int, ...]]] = {}  # list entry -> index -> that tensor's shape
    out_dtype: dict[tuple[str, int], dict[int, str]] = {}  # list entry -> index -> the dtype of a tensor not floating
    module_calls: dict[str, list[tuple[int, int]]] = {}  # sibling path -> [(start, end)]
    tags: dict[int, frozenset[str]] = {}
    alive: list[Any] = []
    inside: list[tuple[str, int]] = []

    def leaves(tree: Any) -> list[Any]:
        return [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]

    def tag(tree: Any, value: frozenset[str]) -> None:
        for t in leaves(tree):
            alive.append(t)
            tags[id(t)] = tags.get(id(t), frozenset()) | value

    def hidden_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if args and isinstance(args[0], torch.Tensor):
            return args[0]
        return kwargs.get("hidden_states")

    reads = scalar_reads()
    # the parameters of the modules above each candidate block list (the root's included), and
    # the clock of each op reading one
    above_params = {id(p): f"{a}.{n}" if a else n for path in lists for a in above(path)
                    for n, p in model.get_submodule(a)._parameters.items() if p is not None}
    above_reads: dict[str, list[int]] = {}

    class Taint(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            done, value = without_values(func, args, reads)  # meta tensors hold no values: the plain path
            if done:
                return value
            args = value
            for t in leaves((args, kwargs)) if above_params else ():
                if id(t) in above_params:
                    above_reads.setdefault(above_params[id(t)], []).append(clock[0])
            result = func(*args, **kwargs)
            if getattr(func, "__name__", "") in _SHAPE_ONLY:
                return result
            incoming = frozenset().union(*(tags.get(id(t), frozenset()) for t in leaves((args, kwargs))))
            if inside:
                incoming |= {f"block {inside[-1][1]}"}
            if incoming and not _passes_through(func, args, result):
                tag(result, incoming)
            return result

    def entry_pre(key: tuple[str, int]) -> Any:
        def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            clock[0] += 1
            calls.setdefault(key, []).append((clock[0], -1))
            hidden = hidden_of(args, kwargs)
            if len(calls[key]) == 1:
                hidden_in[key] = id(hidden) if hidden is not None else -1
                if isinstance(hidden, torch.Tensor):
                    hidden_shape[key] = tuple(hidden.shape)
                # where each other input came from, as known on entry (a later op may tag the
                # same object): a parameter outside the lists carries its own tag
                other_inputs[key] = [(id(t), tags.get(id(t), frozenset())) for t in leaves((args, kwargs))
                                     if t is not hidden]
            inside.append(key)
        return hook

    def entry_post(key: tuple[str, int]) -> Any:
        def hook(module: Any, args: Any, kwargs: Any, output: Any) -> None:
            clock[0] += 1
            start, _ = calls[key][-1]
            calls[key][-1] = (start, clock[0])
            inside.pop()
            out = output if isinstance(output, torch.Tensor) else (output[0] if isinstance(output, (tuple, list)) and
                                                                   output else None)
            if out is not None:
                alive.append(out)
                hidden_out.setdefault(key, id(out))
            outputs_tuple[key[0]] = 0 if isinstance(output, torch.Tensor) else len(output)
            if isinstance(output, (tuple, list)):
                plain_out.setdefault(key, tuple((j, v) for j, v in enumerate(output) if j and _plain(v)))
                if key not in out_index:
                    extra = [(j, v) for j, v in enumerate(output) if j and isinstance(v, torch.Tensor)]
                    alive.extend(v for _, v in extra)
                    out_index[key] = {id(v): j for j, v in extra}
                    out_shape[key] = {j: tuple(int(d) for d in v.shape) for j, v in extra}
                    out_dtype[key] = {j: str(v.dtype).removeprefix("torch.") for j, v in extra if not v.is_floating_point()}
        return hook

    handles = []
    for path, m in lists.items():
        for i, child in enumerate(m):
            handles.append(child.register_forward_pre_hook(entry_pre((path, i)), with_kwargs=True))
            handles.append(child.register_forward_hook(entry_post((path, i)), with_kwargs=True))
    siblings = {p: m for p, m in model.named_modules() if p and id(m) not in entry_of}

    def sibling_pre(path: str) -> Any:
        def hook(module: Any, args: Any) -> None:
            clock[0] += 1
            module_calls.setdefault(path, []).append((clock[0], -1))
        return hook

    def sibling_post(path: str) -> Any:
        def hook(module: Any, args: Any, output: Any) -> None:
            clock[0] += 1
            start, _ = module_calls[path][-1]
            module_calls[path][-1] = (start, clock[0])
            if next(module.parameters(), None) is not None:
                tag(output, frozenset({f"module {path}"}))
        return hook

    for path, m in siblings.items():
        handles.append(m.register_forward_pre_hook(sibling_pre(path)))
        handles.append(m.register_forward_hook(sibling_post(path)))
    # a value's sources: the parameters outside the layer lists it was computed from (those in a
    # list are the "block i" its ops run in) and whether the tokens reach it
    for pname, param in model.named_parameters():
        if not any(pname.startswith(path + ".") for path in lists):
            tag(param, frozenset({f"parameter {pname}"}))
    was_training = model.training
    model.eval()
    try:
        for given in ("decoder_input_ids", model_inputs.INPUT_NAMES[kind]):  # the token ids or the pixels
            if given in inputs:
                tag(inputs[given], frozenset({_TOKENS}))
        import torch.fx.experimental._config as fx_config

        with torch.no_grad(), fx_config.patch(meta_nonzero_assume_all_nonzero=True), meta_autocast(), Taint():
            model(**inputs, **({"use_cache": False} if "use_cache" in model_inputs.forward_parameters(model) else {}))
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)

    blocks = _block_list(lists, calls, hidden_in, hidden_out, first_stack=kind in model_inputs.DECODER_KINDS,
                         last_stack=kind == model_inputs.IMAGE_TEXT)
    n = len(lists[blocks])
    beside = _beside(model, blocks)
    shared: set[str] = set()
    uncuttable = ""
    carried: list[dict[int, tuple[int, ...]]] = [{} for _ in range(n)]  # block -> index in the previous one's output -> shape
    for i in range(n):
        for tensor_id, known in other_inputs[(blocks, i)]:
            sources = sorted(s for s in known if s != f"block {i}" and s != _TOKENS)
            j = out_index.get((blocks, i - 1), {}).get(tensor_id) if i else None
            if j is not None and any(s.startswith("block ") for s in sources):
                not_floating = out_dtype[(blocks, i - 1)].get(j)
                if not_floating:  # the boundary sends floating values (in the hidden state's dtype)
                    uncuttable = uncuttable or (f"block {i} of '{blocks}' reads output {j} of block {i - 1}, a tensor of "
                                                f"{not_floating}: a stage boundary carries floating tensors only")
                carried[i][j] = out_shape[(blocks, i - 1)][j]  # the block before returned it: a boundary carries it
                continue
            holders = {_holder(s, beside) for s in sources}
            if sources and _TOKENS not in known and None not in holders:
                shared |= holders  # from parameters alone: every stage computes it
                continue
            if any(not s.startswith("parameter ") for s in sources):  # a parameter names no computation
                sources = [s for s in sources if not s.startswith("parameter ")]
            if sources:
                source, _, name = sources[0].partition(" ")
                what = {"module": f"a tensor computed by the module '{name}'",
                        "parameter": f"the parameter '{name}' of a module outside the blocks"}.get(
                    source, f"a tensor computed by {sources[0]}")
                uncuttable = uncuttable or (f"block {i} of '{blocks}' receives, besides its hidden state, {what}: "
                                            f"a stage holding block {i} alone could not compute it")
    carried_shapes: tuple[tuple[tuple[int, tuple[int, ...]], ...], ...] = ()
    if any(carried) and not uncuttable:
        seq = int(inputs["input_ids"].shape[1]) if "input_ids" in inputs else 0
        carried_shapes, uncuttable = _carried_shapes(model, config, kind, blocks, carried, seq)
    start, end = calls[(blocks, 0)][0][0], calls[(blocks, n - 1)][0][1]
    first, last, idle = [], [], []
    for path in beside:
        module = model.get_submodule(path)
        if next(module.parameters(), None) is None or path in shared:
            continue  # parameter-free (every stage keeps a copy) or shared (every stage holds it)
        runs = [c for p, cs in module_calls.items() if p == path or p.startswith(path + ".") for c in cs]
        if any(s < end and e > start for s, e in runs):
            raise _Refused("shared_layers", f"the blocks of '{blocks}' run '{path}', a module outside the block list "
                                    "(a layer shared by the blocks)")
        before = any(e < start for s, e in runs)
        after = any(s > end for s, e in runs)
        if before and after:
            raise _Refused("shared_layers", f"'{path}' runs both before and after the blocks of '{blocks}': one module "
                                    "cannot be held by the first and the last stage")
        (first if before else last).append((min((s for s, _ in runs), default=end + 1), path))
        if not runs and not _tied_to_running(model, path, module_calls):
            idle.append(path)
    entering = hidden_shape.get((blocks, 0), ())
    return OwnLayout(blocks, tuple(p for _, p in sorted(first)), tuple(p for _, p in sorted(last)),
                     tuple(p for p in beside if p in shared),
                     "tuple" if outputs_tuple.get(blocks) else "tensor", outputs_tuple.get(blocks) or 1,
                     inputs=kind, input_shape=tuple(inputs[model_inputs.INPUT_NAMES[kind]].shape[1:])
                     if kind in (model_inputs.PIXELS, model_inputs.SPEECH) else image,
                     positions=int(entering[1]) if len(entering) >= 2 else 0,
                     width=int(entering[-1]) if len(entering) >= 3 else 0,
                     block_shapes=tuple(tuple(int(d) for d in hidden_shape.get((blocks, i), ())[1:]) for i in range(n)),
                     block_plain=tuple(plain_out.get((blocks, i), ()) for i in range(n))
                     if kind == model_inputs.PIXELS and any(plain_out.get((blocks, i)) for i in range(n)) else (),
                     idle=tuple(idle), uncuttable=uncuttable, carried=carried_shapes,
                     above_late=tuple(sorted(p for p, at in above_reads.items() if max(at) >= start and
                                             p.rpartition(".")[0] in above(blocks))),
                     **_declared_tp_plan(model, composite=kind == model_inputs.IMAGE_TEXT))


def _carried_shapes(model: nn.Module, config: Any, kind: str, blocks: str, carried: list[dict[int, tuple[int, ...]]],
                    seq: int) -> tuple[tuple[tuple[int, tuple[int, ...]], ...], str]:
    """(per block, (index, one sample's shape) of each tensor it takes from the previous block's
    output; -1 marks the sequence length), or ((), why not): the forward runs a second time on meta
    at batch 2 and another length, so that a dimension that is the batch, the sequence or fixed is
    told apart (the trace ran at batch 1; a dimension of 1 then is broadcast over the batch)."""
    other = seq - 1 if seq > 2 else seq + 1
    wanted = {(i - 1, j) for i, taken in enumerate(carried) for j in taken}
    try:
        shapes = block_output_shapes(model, blocks, wanted, other if seq else 1, config, kind)
    except Exception as exc:
        from ppdsl.core.build import exc_text

        return (), f"what the blocks of '{blocks}' take from the block before could not be measured at another " \
                   f"length: {exc_text(exc)}"
    out = []
    for i, taken in enumerate(carried):
        row = []
        for j, first in sorted(taken.items()):
            second = shapes.get((i - 1, j), ())
            what = f"output {j} of block {i - 1} of '{blocks}', which block {i} reads"
            if len(second) != len(first) or not first or first[0] != 1 or second[0] not in (1, 2):
                return (), f"{what}, has no batch dimension first (shapes {first} and {second} at batch 1 and 2)"
            dims = []
            for a, b in zip(first[1:], second[1:]):
                if a == b:
                    dims.append(a)
                elif seq and (a, b) == (seq, other):
                    dims.append(-1)
                else:
                    return (), f"{what}, changes with the sequence other than as its length ({first} and {second})"
            row.append((j, tuple(dims)))
        out.append(tuple(row))
    return tuple(out), ""


def block_output_shapes(model: nn.Module, blocks: str, wanted: set[tuple[int, int]], seq: int, config: Any,
                        kind: str) -> dict[tuple[int, int], tuple[int, ...]]:
    """(block, output index) -> the shape of that tensor of the block's output, for each of
    ``wanted``, in one forward of ``model`` (on meta) at batch 2 and length ``seq``."""
    import torch
    import torch.fx.experimental._config as fx_config

    from ppdsl.core import model_inputs

    shapes: dict[tuple[int, int], tuple[int, ...]] = {}
    handles = []
    for i, entry in enumerate(model.get_submodule(blocks)):
        def hook(module: Any, args: Any, output: Any, i: int = i) -> None:
            for j, v in enumerate(output if isinstance(output, (tuple, list)) else ()):
                if (i, j) in wanted and isinstance(v, torch.Tensor):
                    shapes.setdefault((i, j), tuple(int(d) for d in v.shape))
        handles.append(entry.register_forward_hook(hook))
    was_training = model.training
    model.eval()
    try:
        inputs = model_inputs.meta_inputs(model, 2, seq, config, kind=kind)
        with torch.no_grad(), fx_config.patch(meta_nonzero_assume_all_nonzero=True), meta_autocast(), meta_values():
            model(**inputs, **({"use_cache": False} if "use_cache" in model_inputs.forward_parameters(model) else {}))
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return shapes


def _plain(value: Any) -> bool:
    """An int or a (nested) tuple of ints: a value a block returns that no tensor carries."""
    if isinstance(value, (tuple, list)):
        return bool(value) and all(_plain(v) for v in value)
    return isinstance(value, int)


def _prove_decoder_inputs(model: nn.Module) -> None:
    """A seq2seq model makes its decoder's input from the labels by its own rule, as the stages
    do, and every id it puts there (``decoder_start_token_id`` first, the pad id for -100) is a
    row of the decoder's embedding (Marian's default start id, 58100, is not in a small
    vocabulary: the run would fail on its first step). Run on a CPU probe: meta holds no ids."""
    import torch
    from torch import nn

    from ppdsl.core import model_inputs

    try:
        ids = model_inputs.decoder_inputs(model, torch.tensor([[3, -100]]))  # a target, then an ignored one
    except ValueError as exc:
        raise _Refused("decoder_inputs", str(exc)) from None
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    embedding = getattr(decoder, "embed_tokens", None)
    rows = embedding.num_embeddings if isinstance(embedding, nn.Embedding) else None
    bad = sorted({int(v) for v in ids.flatten().tolist() if v < 0 or (rows is not None and v >= rows)})
    if bad:
        raise _Refused("decoder_inputs", f"its decoder's input holds token {bad[0]} (decoder_start_token_id first, "
                                         f"pad_token_id for ignored labels), outside the decoder's {rows} embedding rows")


def _tied_to_running(model: nn.Module, path: str, module_calls: dict[str, list[tuple[int, int]]]) -> bool:
    """Every parameter of the module at ``path`` is also a parameter of a module that runs
    (T5's and BART's ``shared``: its weight is the encoder's and decoder's embeddings' and the
    head's): it is trained through them."""
    running = {id(p) for q, cs in module_calls.items() if cs and not (q == path or q.startswith(path + "."))
               for p in model.get_submodule(q).parameters(recurse=False)}
    return all(id(p) in running for p in model.get_submodule(path).parameters())


def _holder(source: str, beside: list[str]) -> str | None:
    """The module beside the blocks (`_beside`) that holds a source (``module X`` / ``parameter
    X.weight``), or None (a block, the tokens)."""
    kind, _, name = source.partition(" ")
    if kind not in ("module", "parameter"):
        return None
    return next((p for p in beside if name == p or name.startswith(p + ".")), None)


def _declared_tp_plan(model: nn.Module, composite: bool = False) -> dict[str, Any]:
    """The class's plan (`OwnLayout.hf_tp_base`, `hf_tp_head`). ``composite`` (an image-text
    model): its config declares no base plan, its language model's sub-config does; the built
    model gathers the sub-models' plans under their paths (LLaVA's
    ``model.language_model.layers.*.self_attn.q_proj``), which are read as the head's are."""
    def items(plan: Any) -> tuple[tuple[str, str], ...]:
        return tuple((str(k), str(v)) for k, v in plan.items()) if isinstance(plan, dict) else ()

    base = items(getattr(getattr(model, "config", None), "base_model_tp_plan", None))
    head = dict(items(getattr(type(model), "_tp_plan", None)))
    if composite and not base:
        head.update(items(getattr(model, "_tp_plan", None)))
    return dict(hf_tp_base=base, hf_tp_head=tuple(head.items()), base_prefix=_base_prefix(model))


def _base_prefix(model: nn.Module) -> str:
    """Where the base model (the one ``base_model_tp_plan`` is written for) lives: the class's
    ``base_model_prefix``, or, where no such attribute exists (4.x Gemma 3 names
    ``language_model`` and holds ``model``), the one child that is itself a pretrained model."""
    prefix = str(getattr(model, "base_model_prefix", "") or "")
    if not prefix or prefix in model._modules:
        return prefix
    from transformers import PreTrainedModel

    bases = [name for name, child in model.named_children() if isinstance(child, PreTrainedModel)]
    return bases[0] if len(bases) == 1 else prefix


def _passes_through(func: Any, args: tuple[Any, ...], result: Any) -> bool:
    """An op that returns its input object unchanged (dropout in eval, ``.to`` the same dtype):
    its value did not change, so it gains no tag. An in-place op (``add_``) changes it."""
    name = getattr(func, "__name__", "")
    return not name.endswith("_") and any(result is a for a in args)


def _block_list(lists: dict[str, Any], calls: dict[tuple[str, int], list[tuple[int, int]]],
                hidden_in: dict[tuple[str, int], int], hidden_out: dict[tuple[str, int], int],
                first_stack: bool = False, last_stack: bool = False) -> str:
    """The block list: every entry run once, in order, each fed the previous one's output (the
    longest such; ``first_stack``, an encoder-decoder model: the one that runs first, the
    encoder's, the decoder then running whole after it, among the modules the last stage holds;
    ``last_stack``, an image-text model: the one that runs last, the language model's, fed the
    token embeddings with the image's features merged in; its vision tower runs before it)."""
    chained, twice = [], []
    for path, m in lists.items():
        runs = [calls.get((path, i), []) for i in range(len(m))]
        if any(len(r) > 1 for r in runs):
            twice.append(path)
            continue
        if not all(runs) or any(runs[i][0][0] > runs[i + 1][0][0] for i in range(len(m) - 1)):
            continue
        if all(hidden_in.get((path, i + 1)) == hidden_out.get((path, i)) for i in range(len(m) - 1)):
            chained.append(path)
    outer = [p for p in chained if not any(p.startswith(q + ".") for q in chained if q != p)]
    if outer and first_stack:
        return min(outer, key=lambda p: calls[(p, 0)][0][0])
    if outer and last_stack:
        return max(outer, key=lambda p: calls[(p, 0)][0][0])
    if outer:
        return max(outer, key=lambda p: (len(lists[p]), -len(p)))
    shared = [p for p in twice if not any(p.startswith(q + ".") for q in twice if q != p)]
    if shared:
        raise _Refused("shared_layers", f"the entries of '{shared[0]}' run more than once per forward (shared layers)")
    unchained = [p for p, m in lists.items() if len(m) > 1 and all(calls.get((p, i)) for i in range(len(m)))]
    if unchained:
        raise _Refused("cross_block_state", f"the entries of '{unchained[0]}' run in turn, but the hidden state is changed "
                                "between them (or not passed from one to the next)")
    raise _Refused("untraceable", "no nn.ModuleList of layers runs in sequence in its forward")


def _beside(model: nn.Module, blocks: str) -> list[str]:
    """The modules beside the path to the block list, in registration order: the root's children
    but the one leading to the blocks, that one's children but the next, ..."""
    out: list[str] = []
    parts = blocks.split(".")
    for depth in range(len(parts)):
        prefix = ".".join(parts[:depth])
        module = model.get_submodule(prefix) if prefix else model
        for name, _child in module.named_children():
            path = f"{prefix}.{name}" if prefix else name
            if name != parts[depth]:
                out.append(path)
    return out
