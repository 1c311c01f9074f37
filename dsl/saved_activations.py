"""The activations a training forward keeps for backward, measured on the meta device.

`trace_saved` runs the model's forward on meta tensors (nothing allocated) with gradients on,
in training mode, under ``torch.autograd.graph.saved_tensors_hooks``, and then the task loss on
its logits (`ppdsl.core.task_loss`). Every tensor autograd saves is counted once, by its storage
(a tensor saved by three projections, or a view of one already saved, adds nothing); parameters
and buffers are not activations and are left out. Each saved tensor is filed under

- the deepest module running when it was saved ("" for the model's own code outside any
  submodule, `LOSS` for the loss), and
- its producer: of the linear / Conv1D / embedding layers whose outputs reach it without passing
  through another such layer (a taint, as in `ppdsl.dsl.tp_dataflow`), the one that ran last,
  so that lowering can tell which saved tensors tensor parallelism splits: those a column-split
  layer produces. One producer stands for all of them because a plan check accepts never mixes
  split and whole inputs in one op (a residual stream's producers are all row-split or whole),
  and it keeps the record linear in the blocks (a residual stream reaches every earlier layer).

It runs at batch 1 and two sequence lengths (`lengths`): what a forward saves grows as
a * s + c * s^2 in the sequence length s (eager attention's scores are s^2), and linearly in
the batch, so `SavedActivations.bytes_at` gives it at any microbatch and sequence length,
torch-free (lowering/rank_memory.py). Sizes are those of the model's own dtype (fp32 as built).

torch is imported inside the functions only, like the rest of ``ppdsl.dsl``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    from torch import nn

__all__ = ["LOSS", "SavedActivations", "SavedGroup", "trace_saved", "trace_lengths"]

# A second run per length counts temporaries: every storage an op creates, alive until freed,
# that is neither saved for backward nor a parameter's gradient (a matmul's output before it is
# saved, a backward's gradients of activations, the loss's gradient the size of the logits). Each
# is charged to the module running when it was created (forward) or whose saved tensors backward
# had last unpacked, and to that module's ancestors; each module keeps the most bytes of its own
# temporaries alive at once. So a temporary one pipeline stage leaves alive (a tied weight's
# gradient waiting for the embedding's share) is not charged to the blocks that run meanwhile.

LOSS = "<loss>"  # the module key of what the task loss on the logits saves
LONGEST = 128  # the longer traced sequence (the shorter is half of it), within the model's positions


@attrs.frozen
class SavedGroup:
    """Bytes saved for backward by one module's own code, from one set of producer layers, at the
    two traced sequence lengths (batch 1)."""

    module: str  # the deepest module running ("" outside every submodule, LOSS for the loss)
    producer: str  # the layer that produced it last ("" for none: the token ids, a mask)
    short: int  # bytes at SavedActivations.lengths[0]
    long: int  # bytes at SavedActivations.lengths[1]


@attrs.frozen
class SavedActivations:
    """What one training forward (and its loss) saves for backward, by module and producers."""

    lengths: tuple[int, int]  # the two traced sequence lengths (batch 1)
    groups: tuple[SavedGroup, ...]
    # per module (and each of its ancestors but the root), the most bytes of the temporaries it
    # created alive at once (see above); `SavedGroup.producer` is "" in these
    temporaries: tuple[SavedGroup, ...] = ()

    def bytes_at(self, groups: Iterable[SavedGroup], batch: int, seq: int) -> float:
        """Bytes the `groups` save at this batch and sequence length: per group the a * s + c * s^2
        through its two traced points, times the batch."""
        s1, s2 = self.lengths
        total = 0.0
        for g in groups:
            if s1 == s2:  # traced at one length (images: the blocks' positions are fixed): linear
                total += max(0.0, g.long * seq / s2)
                continue
            c = (g.long / s2 - g.short / s1) / (s2 - s1)
            a = g.short / s1 - c * s1
            total += max(0.0, a * seq + c * seq * seq)
        return batch * total


@contextlib.contextmanager
def as_on_device() -> Iterator[None]:
    """Ops whose meta kernel differs from the device's, run on meta as a CPU runs them:

    - ``F.scaled_dot_product_attention``: on meta torch takes the math path, which saves the s^2
      attention weights; a CPU (and a GPU) runs a fused kernel where torch's own choice
      (``torch._fused_sdp_choice`` on empty CPU tensors of the same shapes) says so, which saves
      the output and its log-sum-exp (O(s)). Without it the trace counted the math path's
      scores for every SDPA model (decoder.ppspec rank 0: +15 % at seq 256).
    - ``grouped_mm`` (transformers' MoE experts): its meta kernel accepts bf16 only, a CPU runs it
      in fp32; on fp32 meta inputs it runs as one matmul with the first expert's weight, which
      saves what it saves (the input; the weight is a parameter) and gives its output's shape."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend
    from torch.overrides import TorchFunctionMode

    flash = int(SDPBackend.FLASH_ATTENTION)
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")

    def fused(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        a = {**dict(zip(names, args)), **kwargs}
        q, k, v, mask = a.get("query"), a.get("key"), a.get("value"), a.get("attn_mask")
        tensors = [t for t in (q, k, v, mask) if t is not None]
        if not all(isinstance(t, torch.Tensor) and t.is_meta for t in tensors) or len(tensors) < 3:
            return None
        if a.get("enable_gqa") and q.shape[-3] != k.shape[-3]:
            return None  # grouped heads: left to the math path
        like = [None if t is None else torch.empty_strided(t.shape, t.stride(), dtype=t.dtype) for t in (q, k, v, mask)]
        dropout, causal, scale = float(a.get("dropout_p", 0.0)), bool(a.get("is_causal", False)), a.get("scale")
        try:
            if torch._fused_sdp_choice(*like, dropout, causal, scale=scale) != flash:
                return None
        except RuntimeError:
            return None
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, dropout, causal, attn_mask=mask, scale=scale)[0]

    grouped = {f for f in (getattr(F, "grouped_mm", None), getattr(torch, "_grouped_mm", None)) if f is not None}

    def grouped_mm(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        x = args[0] if args else kwargs.get("mat_a")
        w = args[1] if len(args) > 1 else kwargs.get("mat_b")
        if not (isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor) and x.is_meta and w.dim() == 3
                and x.dim() == 2 and x.dtype != torch.bfloat16):
            return None
        return x @ w[0]

    class Fused(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
            if func is F.scaled_dot_product_attention or func in grouped:
                out = (fused if func is F.scaled_dot_product_attention else grouped_mm)(args, kwargs or {})
                if out is not None:
                    return out
            return func(*args, **(kwargs or {}))

    with Fused():
        yield


def trace_lengths(config: Mapping[str, object]) -> tuple[int, int]:
    """The two sequence lengths traced: `LONGEST` and half of it, below the model's positions."""
    limits = [v for k in ("n_positions", "max_position_embeddings", "max_seq_len")
              if isinstance(v := config.get(k), int) and v > 0]
    longest = max(2, min([LONGEST, *limits]))
    return longest // 2, longest


def trace_saved(model: nn.Module, config: Mapping[str, object], layer_paths: list[str],
                positions: int = 0, blocks: str = "") -> SavedActivations:
    """Trace ``model`` (built on meta) at both `trace_lengths`; a model fed images
    (`ppdsl.core.model_inputs`) once, at its image size, whose blocks see ``positions`` (check's
    trace, dsl/own_layout.py): both lengths are those positions. ``blocks``: the path of the
    model's stack of blocks, when known: the trace runs only the first blocks that hold every
    kind of block twice (`ppdsl.dsl.block_sample`), and each later block's figures are those of
    the block standing for it. Raises whatever the forward raises; the caller then keeps no
    figure (lowering falls back to its formula)."""
    from ppdsl.core.model_inputs import TEXT_KINDS, kind_of

    if kind_of(model) in (*TEXT_KINDS, None):
        lengths = trace_lengths(config)
    elif positions > 0:
        lengths = (positions, positions)
    else:
        raise ValueError("the positions the blocks see were not traced")
    from .block_sample import over_sampled_blocks

    def once(seq: int) -> tuple[dict[tuple[str, str], int], dict[str, int]]:
        return over_sampled_blocks(model, blocks, lambda: _trace_once(model, layer_paths, seq, config),
                                   lambda traced, reps: _repeated(*traced, blocks, reps))

    short, temp_short = once(lengths[0])
    long, temp_long = (short, temp_short) if lengths[0] == lengths[1] else once(lengths[1])
    keys = sorted(set(short) | set(long))
    return SavedActivations(lengths, tuple(SavedGroup(m, p, short.get((m, p), 0), long.get((m, p), 0))
                                           for m, p in keys),
                            tuple(SavedGroup(m, "", temp_short.get(m, 0), temp_long.get(m, 0))
                                  for m in sorted(set(temp_short) | set(temp_long))))


def _repeated(found: dict[tuple[str, str], int], temps: dict[str, int], blocks: str,
              reps: Mapping[int, int]) -> tuple[dict[tuple[str, str], int], dict[str, int]]:
    """The figures of a trace of the first blocks (`ppdsl.dsl.block_sample`), with each later
    block's copied from the block that stands for it, every block index in its paths moved by
    the distance between them; the modules after the blocks read the last block where the
    trace's read the last traced one."""
    from .block_sample import index_in, moved

    after = max(reps) + 1 - min(reps)
    found = {(m, moved(p, blocks, after) if index_in(m, blocks) is None else p): size for (m, p), size in found.items()}
    temps = dict(temps)
    for block, rep in reps.items():
        by = block - rep
        for (module, producer), size in list(found.items()):
            if index_in(module, blocks) == rep:
                found[(moved(module, blocks, by), moved(producer, blocks, by))] = size
        for module, size in list(temps.items()):
            if index_in(module, blocks) == rep:
                temps[moved(module, blocks, by)] = size
    return found, temps


def _trace_once(model: nn.Module, layer_paths: list[str], seq: int, config: Mapping[str, object]
                ) -> tuple[dict[tuple[str, str], int], dict[str, int]]:
    """One forward, loss and backward at batch 1 and length ``seq``: (module, producer) -> the
    bytes saved for backward, and module -> the most bytes of its temporaries alive at once (see
    above). Storages are numbered as created (a number is never reused, a storage's address is),
    and tensors are tagged with their producer by identity, weakly: nothing is kept alive that the
    forward frees, so the temporaries are those a device holds."""
    import itertools
    import weakref

    import torch
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten
    from torch.utils.weak import WeakTensorKeyDictionary

    from ppdsl.core.meta_values import meta_autocast, meta_values
    from ppdsl.core.task_loss import causal_lm_loss

    from .tp_dataflow import _call

    static = {t.untyped_storage()._cdata for t in (*model.parameters(), *model.buffers())}
    layers = set(layer_paths)
    uid_of: dict[int, int] = {}  # storage (its _cdata, while alive) -> a number never reused
    size: dict[int, int] = {}
    refs: dict[int, Any] = {}
    events: list[tuple[int, int, str]] = []  # (storage number, +1 created / -1 freed, module charged)
    saved: dict[int, str] = {}  # storage number -> the module that saved it
    found: dict[tuple[str, str], int] = {}  # (module, producer) -> bytes saved
    grads: set[int] = set()  # every storage that was a parameter's gradient (a tied one is replaced by the sum)
    numbers = itertools.count()
    shapes = {tuple(p.shape) for p in model.parameters()}
    backward = [False]
    stack: list[str] = [""]
    where = [""]
    none = (-1, "")
    tags = WeakTensorKeyDictionary()  # tensor -> (when, layer) of its last producer
    when = itertools.count()
    calling = [none]  # the producer of the inputs of the torch call running

    def freed(cdata: int, uid: int) -> None:
        if uid_of.get(cdata) == uid:
            del uid_of[cdata]
        refs.pop(uid, None)
        events.append((uid, -1, where[0]))

    def track(tree: Any) -> None:
        for t in tree_flatten(tree)[0]:
            if not isinstance(t, torch.Tensor) or t._is_view():  # a view allocates nothing
                continue
            st = t.untyped_storage()
            cdata = st._cdata
            if cdata in static or cdata in uid_of or st.nbytes() == 0:
                continue
            uid = next(numbers)
            uid_of[cdata], size[uid] = uid, st.nbytes()
            if backward[0] and tuple(t.shape) in shapes:
                # a parameter's gradient: a tied one's partial gradients are summed before it
                # gets them, and on a pipeline each copy's is that stage's gradient
                grads.add(uid)
            events.append((uid, 1, where[0]))
            refs[uid] = weakref.ref(st, lambda _, c=cdata, u=uid: freed(c, u))

    def tag_of(tree: Any) -> tuple[int, str]:
        return max((tags.get(x, none) for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)),
                   default=none)

    def put(tree: Any, value: tuple[int, str]) -> None:
        for leaf in tree_flatten(tree)[0]:
            if isinstance(leaf, torch.Tensor):
                tags[leaf] = value

    class Taint(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
            incoming = tag_of((args, kwargs))
            calling.append(incoming)
            try:
                result = func(*args, **(kwargs or {}))
            finally:
                calling.pop()
            if incoming != none:
                put(result, incoming)
            return result

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            # a view or an in-place op returns (an alias of) its input: nothing new is allocated
            if not any(r.alias_info is not None for r in func._schema.returns):
                track(out)
            return out

    def storage_of(t: Any) -> int:
        return (t._base if t._is_view() and t._base is not None else t).untyped_storage()._cdata

    def pack(t: Any) -> Any:
        track(t._base if t._is_view() and t._base is not None else t)  # a view of an input: its base
        cdata = t.untyped_storage()._cdata
        uid = uid_of.get(storage_of(t))
        if uid is not None and uid not in saved:
            saved[uid] = stack[-1]
            # what a backward saves again (a forward recomputed under grad: Reformer's reversible
            # blocks) lives only while that backward runs: a temporary's, not the forward's to keep
            if cdata not in static and not backward[0]:
                base = t._base if t._base is not None else t
                # an op's own output (softmax, exp) is saved before the call returns and is tagged
                tag = max(tags.get(t, none), tags.get(base, none)) if t in tags or base in tags else calling[-1]
                group = (stack[-1], tag[1])
                found[group] = found.get(group, 0) + t.untyped_storage().nbytes()
        return t

    def unpack(t: Any) -> Any:
        uid = uid_of.get(storage_of(t))
        if uid in saved:
            where[0] = saved[uid]
        return t

    def pre(path: str) -> Any:
        def hook(module: Any, args: Any) -> None:
            stack.append(path)
            where[0] = path
        return hook

    def post(path: str) -> Any:
        def hook(module: Any, args: Any, output: Any) -> None:
            stack.pop()
            where[0] = stack[-1]
            if path in layers:
                put(output, (next(when), path))
        return hook

    def accumulated(p: Any) -> None:
        uid = uid_of.get(p.grad.untyped_storage()._cdata)
        if uid is not None:
            grads.add(uid)

    handles = [p.register_post_accumulate_grad_hook(accumulated) for p in model.parameters() if p.requires_grad]
    for path, module in model.named_modules():
        if path:
            handles.append(module.register_forward_pre_hook(pre(path)))
            handles.append(module.register_forward_hook(post(path), always_call=True))
    was_training = model.training
    model.train()
    try:
        ids = torch.zeros((1, seq), dtype=torch.long, device="meta")
        with torch.enable_grad(), as_on_device(), meta_autocast(), meta_values(), Taint(), Count(), \
                torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            out = _call(model, seq, config)
            logits = getattr(out, "logits", out)
            stack.append(LOSS)
            where[0] = LOSS
            # a classifier's pooled logits save next to nothing
            lm = isinstance(logits, torch.Tensor) and logits.dim() == 3 and logits.is_floating_point()
            loss = causal_lm_loss(logits, ids) if lm else logits.float().sum()
            del out, logits
            stack.pop()
            backward[0] = True
            loss.backward()
            del loss
    finally:
        for h in handles:
            h.remove()
        for p in model.parameters():
            p.grad = None
        model.train(was_training)
    live: dict[str, int] = {}
    peak: dict[str, int] = {}
    created: dict[int, list[str]] = {}
    for uid, sign, module in events:
        if uid in saved or uid in grads:
            continue
        if sign > 0:
            parts = module.split(".")
            created[uid] = [".".join(parts[:i]) for i in range(1, len(parts) + 1)] if module else []
        for m in created.get(uid, ()):
            live[m] = live.get(m, 0) + sign * size[uid]
            peak[m] = max(peak.get(m, 0), live[m])
    return found, peak
