"""Draw a simulated schedule: a text grid, a self-contained SVG timeline, and stable JSON."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, TypeGuard
from xml.sax.saxutils import escape

from ppdsl.core.schedules.ir import Action, Op, Schedule
from ppdsl.core.schedules.simulate import SimResult, Slot

_LEGEND_TEXT = (
    "F forward, B backward (input gradient only when W exists), W weight gradient; "
    "the number is the microbatch. Uppercase: the first chunk (model part) a rank holds, "
    "lowercase: its second chunk, ':c' suffix: chunk c >= 2. "
    "dashes continue the action to their left, '.' is idle."
)


def render_text(schedule: Schedule, sim: SimResult, title: str | None = None, max_columns: int | None = None) -> str:
    """One row per rank, one column per time unit (the shortest action's duration, or
    makespan / `max_columns` when that is longer).

    Exact for the unit costs; with other costs, starts and lengths are rounded to columns (an
    action shorter than a column still takes one, and may hide its neighbour).
    `title`: the first line (default: style, sizes, bubble and makespan).
    """
    _require_same(schedule, sim)
    chunk = _local_chunks(schedule)
    unit = _time_unit(sim)
    if max_columns is not None:
        unit = max(unit, sim.makespan / max_columns)
    columns = max(1, math.ceil(sim.makespan / unit - 1e-9))
    slots = [sim.slots(r) for r in range(schedule.pp)]
    width = max([2] + [len(_label(s.action, chunk)) for rank in slots for s in rank])
    head = f"rank {schedule.pp - 1}"
    lines = [
        title or _title(schedule, sim),
        " " * len(head) + " | " + " ".join(_ruler(c, width) for c in range(columns)),
    ]
    for r, rank_slots in enumerate(slots):
        cells = ["."] * columns
        for slot in rank_slots:
            first = min(columns - 1, int(round(slot.start / unit)))
            span = max(1, int(round((slot.end - slot.start) / unit)))
            cells[first] = _label(slot.action, chunk)
            for c in range(first + 1, min(columns, first + span)):
                cells[c] = "-" * width
        lines.append(f"rank {r}".rjust(len(head)) + " | " + " ".join(c.ljust(width) for c in cells).rstrip())
    lines.append("")
    lines.append(f"legend: {_LEGEND_TEXT} One column = {unit:g} time unit(s).")
    lines.append(f"bubble: {sim.bubble:.4f} (idle / (ranks x makespan)), makespan {sim.makespan:g}")
    peaks = ", ".join(f"rank {r}: {p}" for r, p in enumerate(sim.peak_activations))
    lines.append(f"peak activations: {peaks}")
    if not sim.ok:
        lines.append(f"NOT RUNNABLE: {len(sim.problems)} problem(s)")
        lines += [f"  {p.kind}: {p.message}" for p in sim.problems[:10]]
    return "\n".join(lines) + "\n"


_PALETTE: Mapping[Op, tuple[str, ...]] = {
    Op.F: ("#2f6db3", "#8ab8e6", "#173f6e", "#c3dbf3"),
    Op.B: ("#e07b00", "#ffbb66", "#8f4e00", "#ffe0b8"),
    Op.W: ("#2e8b3e", "#92d3a0", "#174a20", "#cdebd3"),
}
_DARK = {0, 2}  # palette entries that need white text
_ROW_H = 26
_LEFT = 70
_TOP = 46


def render_svg(schedule: Schedule, sim: SimResult, title: str | None = None) -> str:
    """A self-contained SVG timeline: one ``rect class="action"`` per action that ran.
    `title`: the heading (default: style, sizes, bubble and makespan)."""
    _require_same(schedule, sim)
    title = title or _title(schedule, sim)
    chunk = _local_chunks(schedule)
    makespan = max(sim.makespan, 1e-9)
    scale = max(4.0, min(30.0, 1200.0 / makespan))
    plot_w = makespan * scale
    width = _LEFT + plot_w + 20
    legend_y = _TOP + schedule.pp * _ROW_H + 30
    height = legend_y + 30 + (18 if not sim.ok else 0)
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
        f'viewBox="0 0 {width:.0f} {height:.0f}" font-family="Helvetica, Arial, sans-serif">',
        f'<title>{escape(title)}</title>',
        f'<text x="{_LEFT}" y="20" font-size="15" font-weight="bold">{escape(title)}</text>',
    ]
    out += _axis(schedule.pp, makespan, scale)
    for r in range(schedule.pp):
        y = _TOP + r * _ROW_H
        label_y = y + _ROW_H / 2 + 4
        out.append(f'<text x="{_LEFT - 8}" y="{label_y:.1f}" font-size="12" text-anchor="end">rank {r}</text>')
        out += [_box(slot, y, scale, chunk) for slot in sim.slots(r)]
    out += _legend(legend_y, schedule.chunks)
    if not sim.ok:
        out.append(
            f'<text x="{_LEFT}" y="{legend_y + 40}" font-size="12" fill="#b00">'
            f"not runnable: {escape(sim.problems[0].message)}</text>"
        )
    out.append("</svg>")
    return "\n".join(out) + "\n"


def stack_svg(svgs: Sequence[str]) -> str:
    """Several ``render_svg`` drawings, one below the other, as one SVG."""
    sizes = [_svg_size(s) for s in svgs]
    width, height = max(w for w, _ in sizes), sum(h for _, h in sizes)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
           f'viewBox="0 0 {width:.0f} {height:.0f}">']
    y = 0.0
    for svg, (_, h) in zip(svgs, sizes):
        body = svg.strip().replace('<svg xmlns="http://www.w3.org/2000/svg" ', f'<svg y="{y:.0f}" ', 1)
        out.append(body)
        y += h
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _svg_size(svg: str) -> tuple[float, float]:
    head = svg[: svg.index(">")]
    return tuple(float(head.split(f'{k}="', 1)[1].split('"', 1)[0]) for k in ("width", "height"))  # type: ignore[return-value]


def to_json(schedule: Schedule, sim: SimResult) -> dict[str, Any]:
    """The stable JSON form: style, pp, microbatches, chunks, ranks[].actions[], bubble, peaks."""
    _require_same(schedule, sim)
    return {
        "style": schedule.style,
        "pp": schedule.pp,
        "microbatches": schedule.microbatches,
        "chunks": schedule.chunks,
        "ranks": [
            {
                "rank": r,
                "actions": [{"op": a.op.value, "microbatch": a.microbatch, "stage": a.stage} for a in actions],
            }
            for r, actions in enumerate(schedule.ranks)
        ],
        "bubble": sim.bubble,
        "peak_activations": list(sim.peak_activations),
        "makespan": sim.makespan,
        "split_backward": schedule.split_backward,
        "stage_ranks": list(schedule.stage_ranks),
    }


def schedule_from_json(d: Mapping[str, Any]) -> Schedule:
    """The Schedule of a ``to_json`` dict; ValueError naming the first malformed field."""
    if not isinstance(d, Mapping):
        raise ValueError(f"schedule JSON must be an object, got {type(d).__name__}")
    style = d.get("style")
    if not isinstance(style, str):
        raise ValueError("schedule JSON: 'style' must be a string")
    pp, m, chunks = (_positive_int(d, key) for key in ("pp", "microbatches", "chunks"))
    ranks = _ranks_from_json(d.get("ranks"), pp)
    split = d.get("split_backward", any(a.op is Op.W for acts in ranks for a in acts))
    if not isinstance(split, bool):
        raise ValueError("schedule JSON: 'split_backward' must be true or false")
    if "stage_ranks" in d:
        stage_ranks = d["stage_ranks"]
        if not isinstance(stage_ranks, list) or not all(_is_int(x) for x in stage_ranks):
            raise ValueError("schedule JSON: 'stage_ranks' must be a list of integers")
    else:
        stage_ranks = _placement_from_actions(ranks, pp * chunks)
    return Schedule(
        style=style,
        pp=pp,
        microbatches=m,
        chunks=chunks,
        split_backward=split,
        stage_ranks=tuple(stage_ranks),
        ranks=ranks,
    )


def _require_same(schedule: Schedule, sim: SimResult) -> None:
    if sim.schedule is not schedule and sim.schedule != schedule:
        raise ValueError("the simulation result belongs to a different schedule")


def _local_chunks(schedule: Schedule) -> dict[int, int]:
    """stage -> its index among the stages of its rank (0 = the rank's earliest stage)."""
    chunk: dict[int, int] = {}
    for r in range(schedule.pp):
        for i, s in enumerate(schedule.stages_of(r)):
            chunk[s] = i
    return chunk


def _label(a: Action, chunk: Mapping[int, int]) -> str:
    c = chunk[a.stage]
    if c == 0:
        return f"{a.op.value}{a.microbatch}"
    if c == 1:
        return f"{a.op.value.lower()}{a.microbatch}"
    return f"{a.op.value}{a.microbatch}:{c}"


def _time_unit(sim: SimResult) -> float:
    durations = [e - s for r in range(len(sim.starts)) for s, e in zip(sim.starts[r], sim.ends[r]) if e > s]
    return min(durations, default=1.0)


def _ruler(column: int, width: int) -> str:
    return str(column).ljust(width) if column % 5 == 0 else " " * width


def _title(schedule: Schedule, sim: SimResult) -> str:
    return (
        f"{schedule.style}  pp={schedule.pp}  m={schedule.microbatches}  v={schedule.chunks}  "
        f"bubble={sim.bubble:.4f}  makespan={sim.makespan:g}"
    )


def _box(slot: Slot, y: float, scale: float, chunk: Mapping[int, int]) -> str:
    a = slot.action
    c = chunk[a.stage]
    shade = c % len(_PALETTE[a.op])
    x, w = _LEFT + slot.start * scale, max(0.5, (slot.end - slot.start) * scale)
    fill = _PALETTE[a.op][shade]
    tip = f"{a} (chunk {c}) [{slot.start:g}, {slot.end:g})"
    parts = [
        f'<rect class="action" x="{x:.2f}" y="{y + 2}" width="{w:.2f}" height="{_ROW_H - 4}" '
        f'fill="{fill}" stroke="#ffffff" stroke-width="0.6"><title>{escape(tip)}</title></rect>'
    ]
    text = str(a.microbatch)
    size = min(11.0, w / max(1, len(text)) * 1.6)
    if size >= 6:
        color = "#ffffff" if shade in _DARK else "#111111"
        parts.append(
            f'<text x="{x + w / 2:.2f}" y="{y + _ROW_H / 2 + size / 3:.2f}" font-size="{size:.1f}" '
            f'text-anchor="middle" fill="{color}">{text}</text>'
        )
    return "".join(parts)


def _axis(pp: int, makespan: float, scale: float) -> list[str]:
    bottom = _TOP + pp * _ROW_H
    step = _tick_step(makespan)
    out = [f'<line x1="{_LEFT}" y1="{bottom}" x2="{_LEFT + makespan * scale:.2f}" y2="{bottom}" stroke="#444"/>']
    t = 0.0
    while t <= makespan + 1e-9:
        x = _LEFT + t * scale
        out.append(f'<line x1="{x:.2f}" y1="{bottom}" x2="{x:.2f}" y2="{bottom + 4}" stroke="#444"/>')
        out.append(f'<text x="{x:.2f}" y="{bottom + 15}" font-size="10" text-anchor="middle">{t:g}</text>')
        t += step
    return out


def _tick_step(makespan: float) -> float:
    for step in (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000):
        if makespan / step <= 25:
            return float(step)
    return 10.0 ** math.ceil(math.log10(makespan / 25))


def _legend(y: float, chunks: int) -> list[str]:
    out, x = [], float(_LEFT)
    names = {Op.F: "F forward", Op.B: "B backward", Op.W: "W weight grad"}
    for op in (Op.F, Op.B, Op.W):
        for c in range(min(chunks, 2)):
            label = names[op] + (f" (chunk {c})" if chunks > 1 else "")
            out.append(f'<rect class="legend" x="{x:.1f}" y="{y}" width="14" height="14" fill="{_PALETTE[op][c]}"/>')
            out.append(f'<text x="{x + 18:.1f}" y="{y + 11}" font-size="11">{escape(label)}</text>')
            x += 18 + 7 * len(label) + 14
    if chunks > 2:
        out.append(f'<text x="{x:.1f}" y="{y + 11}" font-size="11">chunks 2, 3: darker, paler shades</text>')
    return out


def _is_int(x: object) -> TypeGuard[int]:
    return isinstance(x, int) and not isinstance(x, bool)


def _positive_int(d: Mapping[str, Any], key: str) -> int:
    value = d.get(key)
    if not _is_int(value) or value < 1:
        raise ValueError(f"schedule JSON: {key!r} must be a positive integer, got {value!r}")
    return value


def _ranks_from_json(raw: object, pp: int) -> tuple[tuple[Action, ...], ...]:
    if not isinstance(raw, list):
        raise ValueError("schedule JSON: 'ranks' must be a list")
    by_rank: dict[int, tuple[Action, ...]] = {}
    for entry in raw:
        if not isinstance(entry, Mapping) or not _is_int(entry.get("rank")):
            raise ValueError("schedule JSON: each entry of 'ranks' needs an integer 'rank'")
        r = entry["rank"]
        if not 0 <= r < pp or r in by_rank:
            raise ValueError(f"schedule JSON: rank {r} is out of range 0..{pp - 1} or repeated")
        actions = entry.get("actions")
        if not isinstance(actions, list):
            raise ValueError(f"schedule JSON: rank {r} needs a list 'actions'")
        by_rank[r] = tuple(_action_from_json(a, r) for a in actions)
    if len(by_rank) != pp:
        raise ValueError(f"schedule JSON: 'ranks' lists {len(by_rank)} ranks, expected pp = {pp}")
    return tuple(by_rank[r] for r in range(pp))


def _action_from_json(raw: object, rank: int) -> Action:
    if not isinstance(raw, Mapping):
        raise ValueError(f"schedule JSON: rank {rank} has an action that is not an object")
    op, mb, stage = raw.get("op"), raw.get("microbatch"), raw.get("stage")
    if op not in ("F", "B", "W") or not _is_int(mb) or not _is_int(stage):
        raise ValueError(
            f"schedule JSON: rank {rank} has a bad action {dict(raw)!r} "
            "(needs op 'F'|'B'|'W' and integer microbatch and stage)"
        )
    return Action(Op(op), mb, stage)


def _placement_from_actions(ranks: tuple[tuple[Action, ...], ...], num_stages: int) -> list[int]:
    placement: dict[int, int] = {}
    for r, actions in enumerate(ranks):
        for a in actions:
            placement.setdefault(a.stage, r)
    missing = [s for s in range(num_stages) if s not in placement]
    if missing:
        raise ValueError(f"schedule JSON: no 'stage_ranks', and stages {missing} appear on no rank")
    return [placement[s] for s in range(num_stages)]
