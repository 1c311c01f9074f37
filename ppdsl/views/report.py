"""`ppdsl plan`: per-rank table of coordinates, stages, layers, parameters, memory and traffic.

Estimates (stated in the rendered table): each rank's memory, `lowering.rank_memory` (the one
estimate `ppdsl check` also proves against `train.device_memory`): the largest of the step's
phases (forward / backward, gradient sync, optimizer step) over the model state under the spec's
ZeRO stage and optimizer (weights, gradients, optimizer state; lowering/memory.py, shared with
`ppdsl tune`) and the activations (what check's meta trace saw the forward save for backward,
else 34 * b * s * h bytes / tp per block) of the microbatches in flight.
"""

from __future__ import annotations

import re
from typing import Any

import attrs

from ppdsl.lowering.memory import (
    value_bytes, cp_traffic_bytes, dp_collectives, dp_traffic_bytes, ep_traffic_bytes, optimizer_slots,
)
from ppdsl.lowering.boundaries import boundary_bytes, uniform_boundaries
from ppdsl.lowering.plan import Plan
from ppdsl.lowering.rank_memory import RankMemory, activation_legend, hidden_size, in_blocks, rank_memory
from ppdsl.core.schedules.simulate import simulate


@attrs.frozen
class RankRow:
    rank: int
    dp: int
    pp: int
    tp: int
    stages: tuple[int, ...]
    blocks: tuple[tuple[int, int], ...]
    modules: tuple[str, ...]
    params: int | None
    memory_bytes: int | None  # the step's peak: the largest of its phases (lowering.rank_memory)
    p2p_bytes: int
    tp_bytes: int
    dp_bytes: int | None
    ep_bytes: int = 0  # the experts' all-to-all (mesh.ep > 1)
    cp: int = 0  # the rank's context-parallel coordinate
    cp_bytes: int = 0  # the keys' and values' all-gather (mesh.cp > 1)
    experts: int = 0  # experts of each MoE layer this rank holds (mesh.ep > 1)
    weight_bytes: int | None = None  # in the step (zero 3: whole weights of its stages + its shard)
    grad_bytes: int | None = None
    optimizer_bytes: int | None = None
    activation_bytes: int = 0  # the activations at the forward / backward phase's peak
    rest_bytes: int | None = None  # model state between steps (zero 3: only shards)
    replica_bytes: int | None = None  # memory_bytes of the same rank with zero = 0 (dp replicas)


@attrs.frozen
class PlanReport:
    plan: Plan
    rows: tuple[RankRow, ...]
    bubble: float
    peak_activations: tuple[int, ...]
    traced: bool = False  # activations from check's meta trace (ModelInfo.saved), not the formula

    def to_json(self) -> dict[str, Any]:
        return {"plan": self.plan.to_json(), "bubble": self.bubble, "peak_activations": list(self.peak_activations),
                "ranks": [attrs.asdict(r) for r in self.rows]}

    def render(self) -> str:
        p = self.plan
        m = p.mesh
        cp = f" x cp {m.cp}" if m.cp > 1 else ""
        lines = [f"plan for {p.spec_file}: world {m.world} = dp {m.dp}{cp} x pp {m.pp} x tp {m.tp}; "
                 f"{p.schedule.style}, {p.schedule.microbatches} microbatches of {p.train.microbatch_size}, "
                 f"{len(p.stages)} virtual stages over {p.num_blocks} blocks of {p.blocks}",
                 f"schedule bubble {self.bubble:.4f} (unit costs); peak in-flight microbatches per pp rank "
                 f"{list(self.peak_activations)}"]
        if p.predicted is not None:
            lines.extend(p.predicted.lines())
        if p.experts:
            e = p.experts[0].experts
            lines.append(f"expert parallel: ep {m.ep} (from dp {m.dp}): each rank holds {e // m.ep} of the {e} experts "
                         f"of each of the {len(p.experts)} MoE layers, tokens exchanged by all-to-all (dropless)")
        if m.cp > 1:
            s = p.train.seq_len
            lines.append(f"context parallel: cp {m.cp}: each rank holds 2 of the {2 * m.cp} chunks of every sequence "
                         f"({s // m.cp} of {s} tokens; rank i: chunks i and {2 * m.cp - 1}-i), keys and values "
                         "all-gathered over cp in each " + (f"of the {len(p.context_attention)} attention modules"
                                                            if p.context_attention else "attention module"))
        data = p.train.data
        sources = [dict(o) for _, o in data.options_dict.get("parts", ())] if data.kind == "mix" else [data.options_dict]
        if any(o.get("packing") == "documents" for o in sources):
            lines.append("packed documents: positions restart at each document, attention stays inside it ("
                         + ("ppdsl's document masks: the model's mask builders do not read the position ids"
                            if p.model.document_masks else "the model's own mask builders, from the position ids")
                         + ")")
        if p.own_forward is not None:
            lines.append(f"the model's own forward ({p.model.task}); layout from its traced forward: blocks "
                         f"{p.blocks}, first {', '.join(p.stages[0].first) or '-'}, "
                         f"last {', '.join(p.stages[-1].last) or '-'}"
                         + (f", on every stage {', '.join(p.stages[0].shared)} (gradients summed over pp)"
                            if p.stages[0].shared else ""))
            if p.own_forward.inputs == "pixels":
                lines.append(f"inputs: images {' x '.join(map(str, p.own_forward.input_shape))} (pixel_values); the "
                             + (f"blocks see {p.train.seq_len} positions, the activation's length (traced)"
                                if uniform_boundaries(p) else "hidden state changes shape between blocks (traced)"))
            if p.own_forward.inputs == "speech":
                lines.append(f"inputs: audio features {' x '.join(map(str, p.own_forward.input_shape))} (input_features) "
                             f"and {p.train.data.options_dict.get('target_len')} target ids (labels, seq_len); the "
                             f"encoder's blocks see {p.train.seq_len} positions, the activation's length (traced)")
            if p.own_forward.inputs == "image_text":
                from ppdsl.core.model_inputs import image_text_shape

                image, tokens, token = image_text_shape(tuple(p.own_forward.input_shape))
                lines.append(f"inputs: images {' x '.join(map(str, image))} (pixel_values) and {p.train.seq_len} token ids "
                             f"(input_ids), the first {tokens} the image token {token}; the vision tower runs in stage 0")
        if p.boundaries:
            lines.append("stage boundaries (one microbatch, sent on; its gradient comes back): " + ", ".join(
                f"{b.stage}->{b.stage + 1} " + " + ".join(f"{t.name}{f' output {t.output}' if t.output else ''} "
                                                        f"{tuple(t.shape)}" for t in b.tensors)
                for b in p.boundaries))
        lines.append("")
        zero = p.train.zero if m.dp > 1 else 0
        reshard = zero == 3 and p.train.reshard_after_forward
        cpc = m.cp > 1
        head = ("rank", "dp", *(("cp",) if cpc else ()), "pp", "tp", "stages", "blocks", "params", "weights", "grads", "optim", "activ",
                "memory", *(("replicas",) if zero else ()), *(("at rest",) if zero == 3 else ()),
                "p2p/step", "tp/step", *(("ep/step",) if m.ep > 1 else ()), *(("cp/step",) if cpc else ()), "dp/step")
        table = [head]
        for r in self.rows:
            table.append((str(r.rank), str(r.dp), *((str(r.cp),) if cpc else ()), str(r.pp), str(r.tp),
                          ",".join(map(str, r.stages)),
                          " ".join(f"{a}-{b - 1}" for a, b in r.blocks) + (" +" + "+".join(_short(x) for x in r.modules) if r.modules else ""),
                          _num(r.params), _bytes(r.weight_bytes), _bytes(r.grad_bytes), _bytes(r.optimizer_bytes),
                          _bytes(r.activation_bytes), _bytes(r.memory_bytes),
                          *((_bytes(r.replica_bytes),) if zero else ()), *((_bytes(r.rest_bytes),) if zero == 3 else ()),
                          _bytes(r.p2p_bytes), _bytes(r.tp_bytes), *((_bytes(r.ep_bytes),) if m.ep > 1 else ()),
                          *((_bytes(r.cp_bytes),) if cpc else ()), _bytes(r.dp_bytes)))
        widths = [max(len(row[i]) for row in table) for i in range(len(head))]
        for row in table:
            lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        lines.append("")
        lines.extend(self._legend(zero, reshard))
        if m.ep > 1:
            lines.append("ep/step = the experts' all-to-all (tokens there and back, forward and backward), routing taken "
                         "as uniform; params and memory count only the rank's experts; dp/step sums expert gradients "
                         "over the dp / ep ranks holding the same experts")
        if cpc:
            lines.append("cp/step = the keys' and values' all-gather over cp (and its gradients' all-reduce); "
                         "activations and p2p count the rank's seq_len / cp tokens; dp/step averages the gradients "
                         "over dp * cp ranks")
        if p.tp:
            lines.append(f"tensor parallel: {len(p.tp)} modules replaced "
                         f"({', '.join(sorted({t.style for t in p.tp}))})")
            lines.extend(f"  {rule}" for rule in _tp_rules(p.tp, p.blocks))
        return "\n".join(lines)

    def _legend(self, zero: int, reshard: bool = False) -> list[str]:
        p = self.plan
        o = p.train.optimizer
        slots = optimizer_slots(o.name, o.momentum)
        state = {2: f"{o.name}: 2 moments", 1: "sgd: 1 momentum buffer", 0: "sgd without momentum: none"}[slots]
        how = {0: "zero 0: every dp replica holds all of it" if p.mesh.dp > 1 else
               "dp = 1: every cp rank holds all of it" if p.mesh.cp > 1 else "dp = 1: no data parallelism",
               1: "zero 1: optimizer state sharded over dp",
               3: "zero 3: weights, grads and optimizer state sharded over dp (FSDP2)"}[zero]
        fp64 = p.train.precision == "fp64"
        lines = [f"memory = the step's peak, the largest of its phases: forward / backward ({'fp64' if fp64 else 'fp32'} "
                 f"weights + optimizer state ({state}) + the activations of the microbatches in flight and the grads "
                 f"made by then), grad sync, optimizer step (with its temporaries); docs/memory.md; {how}",
                 f"activ = the activations at the forward / backward peak: {activation_legend(self.traced, fp64)}"]
        if zero == 3 and reshard:
            lines.append("zero 3 + reshard_after_forward: in the step a rank holds its weight shard, the whole weights "
                         "of its roots (first / last modules) and of 2 blocks at a time (one computing, one "
                         "prefetched), and the whole grads of its stages; at rest = between steps, only the shards "
                         "(1/dp of weights, grads and optimizer state)")
        elif zero == 3:
            lines.append("zero 3: in the step a rank holds the whole weights (and its weight shard) and the whole grads "
                         "of its stages; at rest = between steps, only the shards (1/dp of weights, grads and "
                         "optimizer state)")
        if zero:
            lines.append("replicas = the same rank's memory with zero = 0 (every dp rank holding everything)")
        if zero == 3 and reshard:
            w = "3 (F, B, W; 2 on the first stage)" if p.schedule.split_backward else "2 (F, B)"
            lines.append(f"traffic counts bytes sent per step; dp/step = {dp_collectives(zero, True)}: each block's "
                         f"weights {w} times per microbatch, the roots' and the grads once per step")
        else:
            lines.append(f"traffic counts bytes sent per step; dp/step = {dp_collectives(zero)}, once per step")
        return lines


def _tp_rules(tp: Any, blocks: str) -> list[str]:
    """The split rules behind the replacements, once per block-relative path (`hf_plan` rules
    shown as derived): ``model.layers[*].self_attn.q_proj : column``."""
    seen: dict[str, str] = {}
    for t in tp:
        path = re.sub(rf"^{re.escape(blocks)}\.\d+\.", f"{blocks}[*].", t.path)
        style = t.style + ("(fused = %d)" % t.fused if t.fused > 1 else "") + \
            ("(gather_output = true)" if t.gather_output else "")
        if t.kv_parts:  # inferred: the layer stays whole, each rank computes its rows of each part
            style += "    # whole on every rank, parts " + ", ".join(
                f"{w} ({h} kv head{'s' if h > 1 else ''} replicated)" if h else f"{w} split" for w, h in t.kv_parts)
        seen.setdefault(path, style)
    return [f"{path} : {style}" for path, style in seen.items()]


def _short(path: str) -> str:
    return path.rsplit(".", 1)[-1]


def _num(n: int | None) -> str:
    if n is None:
        return "?"
    for unit, size in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def _bytes(n: int | None) -> str:
    if n is None:
        return "?"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n}B"


def plan_report(plan: Plan, model_info: Any = None, hidden: int | None = None) -> PlanReport:
    sim = simulate(plan.schedule)
    peaks = sim.peak_activations
    t = plan.train
    if hidden is None and plan.own_forward is not None and plan.own_forward.width:
        hidden = plan.own_forward.width  # the traced activation's width (a vision tower's sub-config)
    # the built model's config holds what an hf_pretrained directory's config.json adds
    cfg = {**(model_info.config if model_info is not None else {}), **plan.model.config_dict}
    h = hidden_size(plan, model_info, hidden)
    m, mbs = plan.mesh, plan.schedule.microbatches
    seq = t.seq_len // m.cp  # context parallelism: the rank's tokens of each sequence
    value = value_bytes(t.precision)
    act_msg = t.microbatch_size * seq * h * value  # one hidden-state tensor
    rows = []
    memory: dict[int, RankMemory] = {}  # by pipeline coordinate: the other coordinates hold the same
    counts: dict = {}
    for rank in range(m.world):
        c = m.coords(rank)
        stages = plan.stages_of(c["pp"])
        if c["pp"] not in memory:
            memory[c["pp"]] = rank_memory(plan, model_info, c["pp"], peaks, h, counts)
        mem = memory[c["pp"]]
        params, experts, state, act, replicas, reshard = (mem.params, mem.experts, mem.state, mem.activations,
                                                          mem.replicas, mem.reshard)
        blocks_held = sum(s.num_blocks for s in stages)
        crossings = sum(1 for s in stages if s.stage + 1 < len(plan.stages) and plan.stages[s.stage + 1].rank != c["pp"])
        crossings += sum(1 for s in stages if s.stage > 0 and plan.stages[s.stage - 1].rank != c["pp"])
        # what each held stage sends on to another rank, and the gradient it sends back to one
        sent = [s.stage for s in stages if s.stage + 1 < len(plan.stages) and plan.stages[s.stage + 1].rank != c["pp"]]
        sent += [s.stage - 1 for s in stages if s.stage > 0 and plan.stages[s.stage - 1].rank != c["pp"]]
        p2p = mbs * sum(boundary_bytes(plan, b, act_msg) for b in sent)
        tp_bytes = 4 * blocks_held * mbs * act_msg * (m.tp - 1) // m.tp if m.tp > 1 else 0
        dp_bytes = dp_traffic_bytes(params, m.replicas, t.zero, reshard, value) if params is not None else (
            None if m.replicas > 1 else 0)
        if params is not None and experts:  # expert gradients over their dp / ep replicas only
            local = experts // m.ep
            dp_bytes = (dp_traffic_bytes(params - local, m.dp, t.zero, value=value)
                        + dp_traffic_bytes(local, m.dp // m.ep, t.zero, value=value))
        moe_layers = sum(1 for e in plan.experts for s in stages if in_blocks(plan, s, e.path))
        top_k = next((cfg[k] for k in ("num_experts_per_tok", "top_k", "moe_topk") if isinstance(cfg.get(k), int)), 1)
        ep_bytes = ep_traffic_bytes(moe_layers, mbs, t.microbatch_size * t.seq_len, top_k, h, m.ep,
                                    t.activation_checkpointing, value)
        attention = sum(1 for a in plan.context_attention for s in stages if in_blocks(plan, s, a))
        cp_bytes = cp_traffic_bytes(attention, mbs, t.microbatch_size * t.seq_len, _kv_width(cfg, h) // (
            m.tp if plan.tp else 1), m.cp, t.activation_checkpointing, value)
        modules = tuple(x for s in stages for x in (*s.first, *s.last))
        rows.append(RankRow(
            rank, c["dp"], c["pp"], c["tp"], tuple(s.stage for s in stages),
            tuple((s.block_start, s.block_stop) for s in stages), modules, params,
            memory_bytes=mem.peak, p2p_bytes=p2p, tp_bytes=tp_bytes,
            dp_bytes=dp_bytes, weight_bytes=None if state is None else state.weights,
            grad_bytes=None if state is None else state.grads, optimizer_bytes=None if state is None else state.optimizer,
            activation_bytes=act, rest_bytes=None if state is None else state.at_rest, replica_bytes=replicas,
            ep_bytes=ep_bytes, experts=plan.experts[0].experts // m.ep if plan.experts else 0, cp=c["cp"],
            cp_bytes=cp_bytes))
    return PlanReport(plan, tuple(rows), sim.bubble, tuple(peaks), getattr(model_info, "saved", None) is not None)


def _kv_width(cfg: dict[str, Any], hidden: int) -> int:
    """Features of one token's keys (as of its values): kv heads x head dim, from the config."""
    heads = next((cfg[k] for k in ("num_attention_heads", "n_head", "num_heads") if isinstance(cfg.get(k), int)), 0)
    kv = next((cfg[k] for k in ("num_key_value_heads", "multi_query_group_num") if isinstance(cfg.get(k), int)), heads)
    head_dim = cfg.get("head_dim") if isinstance(cfg.get("head_dim"), int) else (hidden // heads if heads else hidden)
    return int(kv * head_dim) if heads else hidden
