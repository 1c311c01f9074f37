"""Weighted mixtures of file sources, ``mix(a, b, ..., weights = [...])``, and the held-out part of
the training data that ``eval { data = holdout(fraction) }`` evaluates on.

Mixture. Sample ``g`` of the run (``g = step * global_batch + i``, whatever the data-parallel
size) comes from part ``p`` where a uniform number ``u(seed, g)`` (splitmix64 of the position:
a pure function of (seed, step)) falls in ``p``'s slice of the normalised cumulative weights: each
sample is drawn from part ``p`` with probability ``w_p`` (HF ``interleave_datasets`` with
``probabilities``; Megatron's blend draws the same proportions). Each part keeps its own
position: the ``k``-th sample drawn from part ``p`` is that part's sample ``k`` in its own order
(``perm_e[k % n]`` of epoch ``e = k // n``, exactly what the part would read alone at position
``k``). ``k`` is the number of earlier draws of ``p``: the counts of the steps before are summed
once, vectorised, and kept (a resume at step ``s`` counts ``s * global_batch`` draws, about 30 ns
each), so a resumed run, another dp size and the single-process reference read the same samples.

The parts give the same kind of sample: token windows (``tokens``, ``text``, ``hf_dataset``
packed), padded documents (``hf_dataset(..., packing = false)``), classification examples,
conversations (``messages``: one each, or packed whole) or an encoder-decoder's source/target
pairs (``target``); labelled images, audio clips with transcripts and captioned images
(``image_folder``, ``audio_folder``, ``image_text_folder``) are held out of, not mixed.
``synthetic`` is neither; check says so (E0455, E0454, E0456). Conversations
keep their loss normalisation, per assistant token over the whole global batch: the mixture
counts the targets of every replica's rows of the step (each part counts its own samples) and
gives each microbatch that divisor (`runtime.data.chat`).

Held out. With ``eval { data = holdout(f) }`` each part's ``n`` items (windows, documents, examples,
conversations or their packed windows, pairs, images, clips, captioned images) are split once: the ``floor(f * n)`` items of smallest ``hash(seed, item)`` are held
out, the others trained on. Training reads the kept items, in an order of their own (a
permutation per epoch over them, seeded by the part's seed); the evaluation reads the held-out
ones in the same way (its batch ``k`` is what step ``k`` would read), with the mixture's weights.
A held-out item is never read by training. Each part must keep and hold out one item at least,
and the held-out items together one global batch, the kept ones too (ValueError, exit status 2).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch

from ppdsl.runtime.data.batch import READ_SLOTS, Batch, DataSource, Needs, Task
from ppdsl.runtime.parallel.rng import mix_seed

__all__ = ["Hold", "MixedData", "draw_parts", "form_of", "from_plan", "held_out", "parts_of"]

_DRAW_TAG = 0x6D6978  # "mix": the draws' stream
_HOLD_TAG = 0x686F6C64  # "hold": which items are held out
_CHUNK = 1 << 20  # positions hashed per numpy call


@dataclass(frozen=True)
class Hold:
    """Items held out for evaluation: `fraction` of each part's; `side`: which ones this source reads."""

    fraction: float
    side: Literal["train", "eval"]


def _uniform(seed: int, positions: Any) -> Any:
    """A float64 in [0, 1) per position (splitmix64 of the position and the seed; numpy, vectorised)."""
    import numpy as np

    with np.errstate(over="ignore"):
        z = positions.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(mix_seed(seed, _DRAW_TAG))
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def draw_parts(seed: int, weights: Sequence[float], start: int, stop: int) -> Any:
    """The part each global sample position in [start, stop) is drawn from (int64 numpy array)."""
    import numpy as np

    total = float(sum(weights))
    edges = np.cumsum(np.asarray(weights, dtype=np.float64)) / total
    which = np.searchsorted(edges, _uniform(seed, np.arange(start, stop, dtype=np.int64)), side="right")
    return np.minimum(which, len(weights) - 1).astype(np.int64)


class _Draws:
    """Which part each sample of a step comes from, and how many draws of each part came before."""

    def __init__(self, seed: int, weights: Sequence[float], global_batch: int) -> None:
        import numpy as np

        self.seed, self.weights, self.gb = seed, tuple(weights), global_batch
        self._before = np.zeros((1, len(weights)), dtype=np.int64)  # row s: draws of each part in steps < s

    def step(self, step: int) -> Any:
        return draw_parts(self.seed, self.weights, step * self.gb, (step + 1) * self.gb)

    def before(self, step: int) -> Any:
        import numpy as np

        known = self._before.shape[0] - 1
        if step > known:
            rows = [self._before]
            total = self._before[-1].copy()
            per_chunk = max(1, _CHUNK // self.gb)
            for s0 in range(known, step, per_chunk):
                s1 = min(step, s0 + per_chunk)
                which = draw_parts(self.seed, self.weights, s0 * self.gb, s1 * self.gb).reshape(s1 - s0, self.gb)
                counts = np.stack([(which == p).sum(axis=1) for p in range(len(self.weights))], axis=1)
                cum = total + np.cumsum(counts, axis=0)
                rows.append(cum)
                total = cum[-1].copy()
            self._before = np.concatenate(rows)
        return self._before[step]


def held_out(n: int, fraction: float, seed: int) -> tuple[Any, Any]:
    """(kept, held) item numbers of `n` items, each sorted: the floor(fraction * n) items of
    smallest hash(seed, item) held out."""
    import numpy as np

    h = int(fraction * n)
    score = _uniform(mix_seed(seed, _HOLD_TAG), np.arange(n, dtype=np.int64))
    order = np.argsort(score, kind="stable")
    return np.sort(order[h:]), np.sort(order[:h])


@dataclass
class MixedData(DataSource):
    """Parts (file sources with ``count()`` and ``read(items)``) drawn by weight, or one part with a
    held-out side: see the module docstring. A part's ``read(items)`` gives, for those samples,
    the tensors of `runtime.data.batch.READ_SLOTS` (a prefix of them), None where it has none; the
    first part assembles the batch (`DataSource.assemble_read`)."""

    parts: list[Any]
    weights: tuple[float, ...]
    names: tuple[str, ...]  # each part's name for messages: "hf_dataset a.parquet"
    seed: int
    seq_len: int
    batch_size: int
    microbatch_size: int
    dp: int
    task: Task
    needs: Needs
    hold: Hold | None = None
    masked: bool = False  # the samples carry an attention mask, which every rank needs
    _draws: Any = field(default=None, repr=False)
    _orders: Any = field(default=None, repr=False)

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.dp

    def _ready(self) -> None:
        if self._orders is not None:
            return
        from ppdsl.runtime.data.order import _Order

        orders: list[Callable[[Sequence[int]], list[int]]] = []
        held_total = kept_total = 0
        for part, name in zip(self.parts, self.names):
            n = part.count()
            if self.hold is None:
                orders.append(part._order.items)  # the part's own order: what it reads alone
                continue
            kept, held = held_out(n, self.hold.fraction, part.seed)
            if len(kept) == 0 or len(held) == 0:
                raise ValueError(f"{name}: holdout({self.hold.fraction:g}) of its {n} items "
                                 f"{'holds out none' if len(held) == 0 else 'keeps none for training'}")
            held_total += len(held)
            kept_total += len(kept)
            subset = kept if self.hold.side == "train" else held
            orders.append(_subset_order(subset, _Order(len(subset), part.seed)))
        if self.hold is not None and held_total < self.global_batch:
            raise ValueError(f"holdout({self.hold.fraction:g}) holds out {held_total} items of "
                             f"{', '.join(self.names)}, fewer than one global batch ({self.global_batch})")
        if self.hold is not None and kept_total < self.global_batch:  # as check's E0456 for token files
            raise ValueError(f"holdout({self.hold.fraction:g}) keeps {kept_total} items of {', '.join(self.names)} "
                             f"for training, fewer than one global batch ({self.global_batch})")
        self._orders = orders
        self._draws = _Draws(self.seed, self.weights, self.global_batch)

    def positions(self, step: int, dp_rank: int) -> list[tuple[int, int]]:
        """(part, that part's sample number) of each of this replica's rows of `step`."""
        import numpy as np

        self._ready()
        which = self._draws.step(step)
        k = np.empty_like(which)
        before = self._draws.before(step)
        for p in range(len(self.parts)):
            at = np.flatnonzero(which == p)
            k[at] = before[p] + np.arange(len(at))
        rows = range(dp_rank * self.batch_size, (dp_rank + 1) * self.batch_size)
        return [(int(which[r]), int(k[r])) for r in rows]

    def batch(self, step: int, dp_rank: int, device: torch.device | str = "cpu") -> Batch:
        first = self.parts[0]
        if not (self.needs.inputs or self.needs.labels or self.masked):
            return first.assemble_read([None] * len(READ_SLOTS), device)  # a middle stage: nothing is read
        pos = self.positions(step, dp_rank)
        out: list[torch.Tensor | None] = [None] * len(READ_SLOTS)  # what `read` gives
        for p, part in enumerate(self.parts):
            rows = [r for r, (q, _) in enumerate(pos) if q == p]
            if not rows:
                continue
            got = part.read(self._orders[p]([pos[r][1] for r in rows]))
            index = torch.tensor(rows, dtype=torch.long)
            for j, t in enumerate(got):
                if t is None:
                    continue
                if out[j] is None:
                    out[j] = torch.zeros((self.batch_size, *t.shape[1:]), dtype=t.dtype)
                out[j][index] = t  # type: ignore[index]
        batch = first.assemble_read(out, device)
        if not hasattr(self.parts[0], "counted"):
            return batch
        counted = 0  # conversations: the counted targets of the whole global batch
        for r in range(self.dp):
            pos = self.positions(step, r)
            for p, part in enumerate(self.parts):
                counted += part.counted(self._orders[p]([k for q, k in pos if q == p]))
        return replace(batch, token_divisor=self.parts[0].divisor(counted))


# the forms of the image, audio and image-text folders: held out of, never mixed (check: E0454)
HELD_NOT_MIXED = ("images", "audio clips", "captioned images")


def _subset_order(subset: Any, order: Any) -> Callable[[Sequence[int]], list[int]]:
    return lambda positions: [int(subset[i]) for i in order.items(positions)]


def form_of(source: Any) -> str | None:
    """The kind of sample a built source gives, for the rule that a mixture's parts agree: token
    windows, padded documents, examples, conversations or pairs; None for one that cannot be
    mixed or held out."""
    from ppdsl.runtime.data.chat import ChatData
    from ppdsl.runtime.data.docs import PackedDocuments, PaddedDocuments
    from ppdsl.runtime.data.examples import ExampleData
    from ppdsl.runtime.data.files import TokenData
    from ppdsl.runtime.data.image_text import CaptionedImages
    from ppdsl.runtime.data.images import ImageData
    from ppdsl.runtime.data.pairs import PairData
    from ppdsl.runtime.data.speech import AudioData

    if isinstance(source, PackedDocuments) and source.documents:
        return "document windows"  # windows with position ids (packing = "documents")
    if isinstance(source, ChatData):
        return "packed conversations" if source.packed else "conversations"
    for cls, form in ((TokenData, "token windows"), (PaddedDocuments, "padded documents"), (ExampleData, "examples"),
                      (PairData, "source/target pairs"), (ImageData, "images"), (AudioData, "audio clips"),
                      (CaptionedImages, "captioned images")):
        if isinstance(source, cls):
            return form
    return None


def parts_of(data: Any) -> list[Any]:
    """A mix's sources as DataPlans (`data` itself for any other source)."""
    from ppdsl.lowering.plan import DataPlan

    if data.kind != "mix":
        return [data]
    return [DataPlan(kind, tuple(tuple(kv) for kv in options)) for kind, options in data.options_dict["parts"]]


def from_plan(plan: Any, data: Any, needs: Needs, build: Callable[[Any], DataSource]) -> MixedData:
    """`data` (``mix(...)``; ``holdout(f)``: train.data's held-out side; train.data: its kept side
    where the evaluation holds out) built, each part by `build`. ValueError for what check refuses
    (E0454 to E0456)."""
    train = plan.train
    hold = None
    if data.kind == "holdout":
        hold, data = Hold(float(data.options_dict["fraction"]), "eval"), train.data
    elif train.eval is not None and train.eval.data.kind == "holdout":
        hold = Hold(float(train.eval.data.options_dict["fraction"]), "train")
    if hold is not None and not 0 < hold.fraction < 1:
        raise ValueError(f"holdout({hold.fraction:g}): the fraction held out must lie between 0 and 1")
    opts = data.options_dict
    if data.kind == "mix":
        parts = parts_of(data)
        weights = tuple(float(w) for w in (opts.get("weights") or [1.0] * len(parts)))
        seed = train.seed if opts.get("seed") is None else int(opts["seed"])
        if len(weights) != len(parts) or not all(w > 0 for w in weights):
            raise ValueError(f"mix(...): weights {list(weights)} must be one positive number per source ({len(parts)})")
    else:
        parts, weights, seed = [data], (1.0,), train.seed
    built = [build(part) for part in parts]
    names = tuple(f"{part.kind}({part.options_dict.get('path', '')!s})" for part in parts)
    forms = [form_of(b) for b in built]
    for name, form in zip(names, forms):
        if form is None:
            raise ValueError(f"{name} gives samples that cannot be {'mixed' if data.kind == 'mix' else 'held out'} "
                             "(synthetic data)")
    held_only = sorted(set(forms) & set(HELD_NOT_MIXED))  # type: ignore[arg-type]
    if data.kind == "mix" and held_only:  # (E0454)
        raise ValueError(f"mix(...): sources of {held_only[0]} cannot be mixed (they can be held out of)")
    if len(set(forms)) > 1:
        raise ValueError(f"mix(...): the sources give different kinds of samples ({', '.join(forms)})")  # type: ignore[arg-type]
    first = built[0]
    # every rank reads the samples where each stage needs them: a mask, or packed position ids
    masked = first.task == "classification" or bool(getattr(first, "mask", False) or getattr(first, "packed", False))
    return MixedData(parts=built, weights=weights, names=names, seed=seed, seq_len=first.seq_len,
                     batch_size=first.batch_size, microbatch_size=first.microbatch_size, dp=first.dp,
                     task=first.task, needs=needs, hold=hold, masked=masked)
