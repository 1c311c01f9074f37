"""How a model's own forward is cut into a pipeline stage: the one set of mechanics the stage
adapter (core/families/own/stage.py) runs and check proves on meta before launch
(dsl/own_layout.py `prove_cut`), so that what check ran is what the stages run.

- `cut_block_list`: the block ``nn.ModuleList`` as long as the model's, holding the stage's
  blocks at their own indices and a parameter-free pass-through (``Skipped``) elsewhere, so
  ``enumerate(self.layers)``, ``self.layers[: n]`` and ``config.layer_types[i]`` mean what they
  mean in one process; a pass-through keeps the block's plain attributes (ModernBERT's
  ``attention_type``);
- `stand_in_modules`: each module before the blocks that the stage does not hold becomes a
  parameter-free stand-in (``ShapeOnly``) returning zeros of the right shape and dtype: the
  forward still builds its masks, positions and rotary tables itself (check's trace proved the
  blocks read no value of it);
- `hook_receive` on a non-first stage's first block: its hidden state becomes the activation
  received; `hook_stop` on a non-last stage's last block: ``StageOutput`` carries the block's
  output out of the forward, which `run_forward` catches;
- a boundary that carries more than the hidden state (T5's position bias, which block 0 computes
  and every block returns and the next reads): `hook_stop` takes those entries of the last
  block's output too, `pack_boundary` flattens them with the hidden state into the one tensor
  the executor sends, `unpack_boundary` splits it, and `hook_carry` makes the pass-through just
  before the first held block return them, so the model's own loop hands them on.

Each returns what undoes it (`undo`), for check's cut of the one meta model it describes.
torch is imported inside the functions (the stand-in classes are made on first use): importing
this module is torch-free, like the rest of what check imports.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["as_parameters", "carried_at", "classes", "cut_block_list", "drop_modules", "hook_carry", "hook_hidden_in",
           "hook_hidden_out", "hook_receive", "hook_stop", "later_stage_inputs", "model_inputs", "pack_boundary", "run_forward", "stand_in_modules", "undo",
           "unpack_boundary"]

Undo = list[Callable[[], None]]


@functools.cache
def classes() -> SimpleNamespace:
    """StageOutput, Skipped, ShapeOnly (defined once torch is wanted)."""
    import torch
    from torch import nn

    class StageOutput(Exception):
        """Raised by the hook on a non-last stage's last block: its output hidden state."""

        def __init__(self, hidden: torch.Tensor, carried: tuple[torch.Tensor, ...] = ()) -> None:
            super().__init__("stage output")
            self.hidden = hidden
            self.carried = carried  # what the next block reads of this one's output besides it

    class Skipped(nn.Module):
        """A block another stage holds: passes the hidden state through (never reached after this
        stage's blocks; before them, the first held block replaces whatever it passes)."""

        def __init__(self, outputs: int, like: nn.Module, plain: Sequence[tuple[int, Any]] = ()) -> None:
            super().__init__()
            self.outputs = outputs  # 0: a tensor; n: a tuple of n, the hidden state first (then Nones)
            self.plain = dict(plain)  # index -> a plain value the block returns there, as traced
            self.__dict__["_like"] = like  # not a submodule: this stage holds none of its parameters

        def __getattr__(self, name: str) -> Any:
            """What the model reads of a block besides its forward comes from the skeleton's
            block: plain attributes (``layer_idx``) and methods that return nothing (BigBird's
            ``set_attention_type`` on every layer). Its tensors and modules, and what a method
            returns, this stage does not hold: reading them fails (on meta too, so check's cut
            proof refuses such a forward, E0425)."""
            try:
                return super().__getattr__(name)
            except AttributeError:
                like = self.__dict__.get("_like")
                if like is None:
                    raise
            value = getattr(like, name)
            if isinstance(value, torch.Tensor):
                raise AttributeError(f"the forward reads '{name}' of a block another stage holds")
            if isinstance(value, nn.Module):  # asked whether it has one (Swin's ``downsample is not None``)
                return _Elsewhere(name)
            if not inspect.ismethod(value):
                return value

            def call(*args: Any, **kwargs: Any) -> None:
                if value(*args, **kwargs) is not None:
                    raise AttributeError(f"the forward uses what '{name}()' of a block another stage holds returns")
            return call

        def forward(self, hidden_states: torch.Tensor | None = None, *args: Any, **kwargs: Any) -> Any:
            hidden = hidden_states if hidden_states is not None else kwargs.get("hidden_states")
            return (hidden, *(self.plain.get(j) for j in range(1, self.outputs))) if self.outputs else hidden

    class _Elsewhere:
        """A submodule of a block another stage holds: it is there (not None), and nothing more:
        calling it or reading from it fails (on meta too: check's cut proof refuses, E0425)."""

        def __init__(self, name: str) -> None:
            self._name = name

        def _fail(self, *args: Any, **kwargs: Any) -> Any:
            raise AttributeError(f"the forward uses '{self._name}' of a block another stage holds")

        __call__ = _fail

        def __getattr__(self, name: str) -> Any:
            if name.startswith("__"):
                raise AttributeError(name)
            self._fail()

    class ShapeOnly(nn.Module):
        """A module before the blocks that this stage does not hold: zeros shaped like its output.
        Only sizes in: the shape the module itself returns for them (run on the skeleton's meta
        module). Token ids in (or anything into an ``nn.Embedding``): (*ids, width), the embedding width (``hidden`` for an embeddings module that
        is not one ``nn.Embedding``); images in (batch, C, H, W), or audio features into a
        convolution (Whisper's): what the module returns for them (run on meta; ViT's (batch,
        positions, hidden), Swin's (embeddings, (height, width))); features in: the same shape
        (norms), or ``out_features`` wide.
        The forward may read what the module holds without using its values (ViT reads its patch
        projection's weight dtype): `_Shadow` answers with empty tensors of the stage's dtype."""

        def __init__(self, like: nn.Module, hidden: int, positions: int | None = None,
                     device: torch.device | None = None) -> None:
            super().__init__()
            weight = next(like.parameters(), None)
            dtype = weight.dtype if weight is not None and weight.is_floating_point() else torch.float32
            # the output's dtype and device (the stage's), as an empty buffer: materialising the
            # stage casts it with the parameters (precision = fp64)
            self.register_buffer("like_dtype", torch.empty(0, dtype=dtype, device=device), persistent=False)
            self.embedding = isinstance(like, nn.Embedding)
            # a convolution, or a module of them (Speech2Text's subsampler): its output has other widths
            self.conv = any(isinstance(m, nn.modules.conv._ConvNd) for m in like.modules())
            self.composite = next(like.children(), None) is not None
            self.width = like.embedding_dim if self.embedding else \
                like.out_features if isinstance(like, nn.Linear) else None
            self.hidden = hidden
            self.positions = positions
            self.__dict__["_like"] = like  # not a submodule: this stage holds none of its parameters

        def __getattr__(self, name: str) -> Any:
            try:
                return super().__getattr__(name)
            except AttributeError:
                like = self.__dict__.get("_like")
                if like is None:
                    raise
            return _shadow(getattr(like, name), self.like_dtype)

        def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            x = next((t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)), None)
            if x is None:  # only sizes in (Marian's sinusoidal positions): the module's own shape for them
                shape = self.__dict__["_like"](*args, **kwargs).shape
                return torch.zeros(shape, dtype=self.like_dtype.dtype, device=self.like_dtype.device)
            if not x.is_floating_point() or self.embedding:  # token ids (BART reads its positions' shape off a float)
                return torch.zeros((*x.shape, self.width or self.hidden), dtype=self.like_dtype.dtype, device=x.device)
            if x.is_floating_point() and (x.dim() == 4 or self.conv or self.composite):  # images, audio
                # features into a convolution (Whisper's conv1 and conv2), or features into a module of
                # modules (Blip2's Q-Former): what the module itself returns for them
                return self._as_like(args, kwargs, x.device)
            if self.width is not None:
                return x.new_zeros((*x.shape[:-1], self.width))
            return torch.zeros_like(x)

        def _as_like(self, args: tuple[Any, ...], kwargs: dict[str, Any], device: torch.device) -> Any:
            """Zeros shaped as the skeleton's module returns for inputs of these shapes (run once per
            shape on meta): a tensor (ViT's patches + CLS, ConvNext's feature map) or a tuple with
            plain values kept (Swin's ``(embeddings, (height, width))``)."""
            from torch.utils._pytree import tree_map

            key = tuple((tuple(t.shape), t.dtype) for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor))
            cache = self.__dict__.setdefault("_out_like", {})
            if key not in cache:
                like = self.__dict__["_like"]
                # on meta, once per shape; a module with real tensors (the skeleton's buffers, a
                # BatchNorm's running statistics; the parameters where this rank's stage 0 holds
                # it) as a meta copy, so that running it changes nothing
                if any(t.device.type != "meta" for t in (*like.parameters(), *like.buffers())):
                    import copy

                    like = copy.deepcopy(like).to("meta")

                def blank(t: Any) -> Any:
                    return torch.empty(t.shape, dtype=t.dtype, device="meta") if isinstance(t, torch.Tensor) else t

                from .meta_values import meta_values

                with torch.no_grad(), meta_values():  # a module that reads a value (a mask's .all()) on its way
                    cache[key] = like(*tree_map(blank, args), **tree_map(blank, kwargs))
            dtype = self.like_dtype.dtype

            def zeros(t: Any) -> Any:
                if not isinstance(t, torch.Tensor):
                    return t
                return torch.zeros(t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device=device)

            return tree_map(zeros, cache[key])

    class _Shadow:
        """What a stand-in's module holds, without its values: submodules and plain attributes
        as the skeleton's, tensors empty (the stage's dtype and device); calling it fails."""

        def __init__(self, like: Any, dtype_of: torch.Tensor) -> None:
            self._like, self._dtype_of = like, dtype_of

        def __getattr__(self, name: str) -> Any:
            return _shadow(getattr(self._like, name), self._dtype_of)

    def _shadow(value: Any, dtype_of: torch.Tensor) -> Any:
        if isinstance(value, torch.Tensor):
            dtype = dtype_of.dtype if value.is_floating_point() else value.dtype
            return torch.empty(0, dtype=dtype, device=dtype_of.device)
        if isinstance(value, nn.Module):
            return _Shadow(value, dtype_of)
        if inspect.ismethod(value):
            raise AttributeError(f"the forward calls '{value.__name__}' of a module this stage does not hold")
        return value

    return SimpleNamespace(StageOutput=StageOutput, Skipped=Skipped, ShapeOnly=ShapeOnly)


def _replace(root: nn.Module, path: str, new: nn.Module, undo_: Undo) -> None:
    owner_path, _, leaf = path.rpartition(".")
    owner = root.get_submodule(owner_path) if owner_path else root
    old = owner._modules.get(leaf)
    owner._modules[leaf] = new
    undo_.append(lambda: owner._modules.__setitem__(leaf, old))


def cut_block_list(root: nn.Module, blocks: str, held: Mapping[int, nn.Module], like: Sequence[nn.Module],
                   outputs: int, plain: Sequence[Sequence[tuple[int, Any]]] = ()) -> Undo:
    """``root``'s block list at path ``blocks`` with ``held`` at their indices, pass-throughs
    shaped after ``like`` (the whole model's blocks) elsewhere, returning what a block returns
    (``outputs``: 0 a tensor, n a tuple of n whose first is the hidden state; ``plain``: per
    block, the plain values it returns, (index, value), as check's trace recorded them)."""
    from torch import nn

    skipped = classes().Skipped
    out: Undo = []
    _replace(root, blocks, nn.ModuleList([held[i] if i in held else skipped(outputs, like[i], plain[i] if plain else ())
                                          for i in range(len(like))]), out)
    return out


def stand_in_modules(root: nn.Module, paths: Sequence[str], like: nn.Module, hidden: int,
                     positions: int | None = None, device: Any = None) -> Undo:
    """Each of ``paths`` (modules before the blocks) a shape-only stand-in of ``like``'s
    (``positions``: the activation's length, what a stand-in fed images returns; ``device``: where
    its outputs are made when no tensor comes in, check's meta; a stage's stand-ins move to the
    stage's device with its parameters)."""
    shape_only = classes().ShapeOnly
    out: Undo = []
    for path in paths:
        _replace(root, path, shape_only(like.get_submodule(path), hidden, positions, device), out)
    return out


def drop_modules(root: nn.Module, paths: Sequence[str]) -> Undo:
    """Each of ``paths`` (modules after the blocks, on a non-last stage) gone from ``root``, as a
    stage that does not hold them has them (runtime/stage/split.py builds it without): a forward
    that reads one before the blocks (Qwen2-Audio's ``self.audio_tower.device``) fails on check's
    meta cut as it would on the stage."""
    out: Undo = []
    for path in paths:
        owner_path, _, leaf = path.rpartition(".")
        owner = root.get_submodule(owner_path) if owner_path else root
        if leaf not in owner._modules:
            continue
        before = dict(owner._modules)  # undone whole: a ModuleList's entries keep their order

        def restore(table: dict[str, Any] = owner._modules, before: dict[str, Any] = before) -> None:
            table.clear()
            table.update(before)
        del owner._modules[leaf]
        out.append(restore)
    return out


def hook_receive(block: nn.Module, received: Callable[[], torch.Tensor]) -> Undo:
    """The block's hidden-state input becomes ``received()`` (a non-first stage's first block)."""
    def receive(_stand_in: torch.Tensor) -> torch.Tensor:
        x = received()
        assert x is not None, "the stage's first block ran without a received activation"
        return x

    return hook_hidden_in(block, receive)


def hook_hidden_in(block: nn.Module, change: Callable[[torch.Tensor], torch.Tensor]) -> Undo:
    """The block's hidden-state input (its first tensor argument, or ``hidden_states=``) becomes
    ``change(it)``: the received activation (`hook_receive`), this rank's block of the sequence
    (sequence parallelism entering the first stage's blocks)."""
    import torch

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        stand_in = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs.get("hidden_states")
        x = change(stand_in)
        if stand_in is None:
            return args, {**kwargs, "hidden_states": x}
        # every argument that is the hidden state (Funnel passes it as query, key and value)
        return (tuple(x if a is stand_in else a for a in args),
                {k: x if v is stand_in else v for k, v in kwargs.items()})

    handle = block.register_forward_pre_hook(hook, with_kwargs=True)
    return [handle.remove]


def hook_hidden_out(block: nn.Module, change: Callable[[torch.Tensor], torch.Tensor]) -> Undo:
    """The block's output hidden state (the tensor it returns, or the first of its tuple) becomes
    ``change(it)``: the whole sequence again after the last stage's last block under sequence
    parallelism, for what runs after the blocks (the final norm, the head)."""
    import torch

    def hook(module: nn.Module, args: Any, output: Any) -> Any:
        if isinstance(output, torch.Tensor):
            return change(output)
        return (change(output[0]), *output[1:])

    handle = block.register_forward_hook(hook)
    return [handle.remove]


def hook_carry(block: nn.Module, received: Callable[[], Mapping[int, torch.Tensor]]) -> Undo:
    """The pass-through block just before a non-first stage's first block returns, at each index
    of ``received()``, the tensor received there (T5's position bias: the model's own loop hands
    it to the next block as in one process)."""
    def hook(module: nn.Module, args: Any, output: Any) -> Any:
        values = received()
        return tuple(values.get(j, v) for j, v in enumerate(output))

    handle = block.register_forward_hook(hook)
    return [handle.remove]


def hook_stop(block: nn.Module, carried: Sequence[int] = ()) -> Undo:
    """The forward stops after this block (a non-last stage's last): `run_forward` returns its
    output hidden state, and the entries ``carried`` of its output tuple the next block reads."""
    import torch

    stage_output = classes().StageOutput

    def hook(module: nn.Module, args: Any, output: Any) -> None:
        if isinstance(output, torch.Tensor):
            raise stage_output(output)
        raise stage_output(output[0], tuple(output[j] for j in carried))

    handle = block.register_forward_hook(hook)
    hook_id = handle.id  # the handle itself is not traceable by torch.compile

    def last(module: nn.Module, args: Any) -> None:
        # the stop raises, so every other forward hook must run before it: FSDP2's post-forward
        # (registered after this cut) reshards the block and hooks its backward's all-gather
        module._forward_hooks.move_to_end(hook_id)

    order = block.register_forward_pre_hook(last)
    return [handle.remove, order.remove]


def pack_boundary(hidden: torch.Tensor, carried: Sequence[torch.Tensor]) -> torch.Tensor:
    """What a stage sends: the hidden state alone, or with the tensors the next block reads of
    this one's output (floating: check's trace refuses others), flattened per sample into one
    (microbatch, n) tensor in the widest of their dtypes, so no value is rounded (a tensor
    broadcast over the batch is expanded to it; autograd sums its gradient back). The executor
    sends one tensor per boundary; `unpack_boundary` undoes this."""
    import torch

    if not carried:
        return hidden
    batch = hidden.shape[0]
    parts = [t.expand(batch, *t.shape[1:]) if t.shape[0] != batch else t for t in (hidden, *carried)]
    dtype = functools.reduce(torch.promote_types, (t.dtype for t in parts))
    return torch.cat([t.reshape(batch, -1).to(dtype) for t in parts], dim=1)


def carried_at(dims: Sequence[int], seq_len: int) -> tuple[int, ...]:
    """One sample's shape of a tensor a boundary carries besides the hidden state (check's trace
    writes -1 for the sequence length) at ``seq_len``."""
    return tuple(seq_len if d == -1 else d for d in dims)


def unpack_boundary(received: torch.Tensor, shapes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """The tensors of a boundary (``shapes``: each one's, the microbatch first) from what
    `pack_boundary` sent; one shape: ``received`` itself."""
    if len(shapes) == 1:
        return [received]
    sizes = [math.prod(s[1:]) for s in shapes]
    flat = received.reshape(received.shape[0], -1)
    return [part.reshape(received.shape[0], *s[1:]) for part, s in zip(flat.split(sizes, dim=1), shapes)]


def run_forward(model: nn.Module, inputs: Mapping[str, Any]) -> tuple[torch.Tensor, bool]:
    """(output, stopped): what the block `hook_stop` marked sends (`pack_boundary`) and True, or
    the model's logits and False."""
    try:
        out = model(**inputs)
    except classes().StageOutput as done:
        return pack_boundary(done.hidden, done.carried), True
    return (out.logits if hasattr(out, "logits") else out[0]), False


def model_inputs(model: nn.Module, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None = None,
                 token_type_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                 pixel_values: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                 input_features: torch.Tensor | None = None) -> dict[str, Any]:
    """The keyword arguments a stage passes the model's forward (`position_ids`: context
    parallelism's global positions, for a forward that takes them: check's E0246 proved it): the
    token ids where it takes them (an image-text model: with its images), else the images or the
    audio features (`ppdsl.core.model_inputs`); a seq2seq or speech model's decoder input from the ``labels``,
    by its own rule (`model_inputs.decoder_inputs`).
    The labels themselves are never passed: the loss is ppdsl's (`ppdsl.core.task_loss`)."""
    from ppdsl.core.model_inputs import DECODER_KINDS, decoder_inputs, input_kind

    accepted = inspect.signature(model.forward).parameters
    out: dict[str, Any] = {}
    if labels is not None and input_kind(accepted) in DECODER_KINDS:  # not Blip2's (an image-text model's)
        out["decoder_input_ids"] = decoder_inputs(model, labels)
    if "input_ids" in accepted or (pixel_values is None and input_features is None):
        out["input_ids"] = input_ids
        if pixel_values is not None and "pixel_values" in accepted:  # an image-text model: both
            out["pixel_values"] = pixel_values
    elif input_features is not None:
        out["input_features"] = input_features
    else:
        out["pixel_values"] = pixel_values
    if position_ids is not None:
        out["position_ids"] = position_ids
    if attention_mask is not None:
        out["attention_mask"] = attention_mask
    if token_type_ids is not None and "token_type_ids" in accepted:
        out["token_type_ids"] = token_type_ids
    if "use_cache" in accepted:
        out["use_cache"] = False
    return out


def later_stage_inputs(model: nn.Module, kind: str, inputs: Mapping[str, Any]) -> dict[str, Any]:
    """What a stage after the first passes the forward: the same, but an image-text model's
    images (`ppdsl.core.model_inputs.IMAGE_TEXT`): its vision tower and projector run in the
    first stage only, whose blocks send on the features merged into the token embeddings; a
    later stage's forward skips its image path (check's trace proved no block reads it). A
    forward that requires the images (Blip2's) still gets them: its image path runs on the
    stage's stand-ins, which return zeros of the shapes the held modules would."""
    import inspect

    from ppdsl.core.model_inputs import IMAGE_TEXT

    if kind != IMAGE_TEXT:
        return dict(inputs)
    try:
        pixels = inspect.signature(model.forward).parameters.get("pixel_values")
    except (TypeError, ValueError):
        pixels = None
    if pixels is not None and pixels.default is inspect.Parameter.empty:
        return dict(inputs)
    return {k: v for k, v in inputs.items() if k != "pixel_values"}


def as_parameters(model: nn.Module, pixels: torch.Tensor | None) -> torch.Tensor | None:
    """Images (or audio features) in the dtype of ``model``'s floating parameters (precision =
    fp64: float64), as the stages and the single-process reference pass them."""
    if pixels is None:
        return None
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), pixels.dtype)
    return pixels.to(dtype)


def undo(steps: Undo) -> None:
    """Undo what the functions above did, last first."""
    for step in reversed(steps):
        step()
