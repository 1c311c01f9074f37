"""Tensor-parallel rules are sound: what `ppdsl check` accepts trains the model one process would.

Two halves:

- **refusal** (fast, no processes): a seeded sample of decoder layouts, each projection of a
  block (wq, wk, wv, wo, w1, w2) given one of {no rule, column, row, column(gather_output),
  replicate}, sometimes a per-layer override or a `fused = 3`, is checked with the model built
  on meta; check must accept exactly the layouts an independent oracle (Megatron's pairing,
  written out below) calls valid, so every broken split rule is refused.
- **acceptance** (distributed, gloo): a few layouts check accepts, including a per-layer
  override, a gathered output, GPT-2's fused c_attn with the tied embedding split, are lowered
  as `ppdsl run` would and verified against the single-process reference
  (`runtime.verify.world.verify_in_process`): losses, gradients and parameters agree. The default run
  verifies 5 layouts in one spawned world of 4; `-m slow` adds a larger sample (random
  check-accepted layouts x schedule styles x tp) behind the `slow` marker.
"""

from __future__ import annotations

import importlib.util
import random
from typing import Any

import pytest

from ppdsl.dsl.check import check_text

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")

PROJECTIONS = ("attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.w1", "feed_forward.w2")
STYLES = ("none", "column", "row", "gather", "replicate")
_TEXT = {"column": "column", "row": "row", "gather": "column(gather_output = true)", "replicate": "replicate"}

DECODER = """ppspec 1
model decoder {{
  source = python("ppdsl.models.decoder:build_decoder")
  config {{ vocab_size = 128, dim = 96, n_layers = {layers}, n_heads = 4, max_seq_len = 32 }}
}}
mesh {{
  tp = {tp}
  pp = {pp}
}}
tensor_parallel {{
{rules}
}}
pipeline {{
  style = {style}
  chunks = {chunks}
  microbatches = 4
}}
train {{
  global_batch = {batch}
  seq_len = 16
  steps = 2
  optimizer = adamw(lr = 1e-3)
}}
"""

GPT2 = """ppspec 1
model gpt2 {{
  source = hf("GPT2LMHeadModel")
  config {{ n_layer = 2, n_embd = 64, n_head = 4, vocab_size = 128, n_positions = 32,
           resid_pdrop = 0.0, embd_pdrop = 0.0, attn_pdrop = 0.0 }}
}}
mesh {{
  tp = 2
  pp = {pp}
}}
tensor_parallel {{
{rules}
}}
pipeline {{
  style = 1f1b
  microbatches = 2
  blocks = transformer.h
  first = [transformer.wte, transformer.wpe]
  last = [transformer.ln_f, lm_head]
}}
train {{
  global_batch = {batch}
  seq_len = 16
  steps = 2
}}
"""


def decoder_spec(rules: list[str], *, tp: int = 2, pp: int = 2, style: str = "1f1b", chunks: int = 1,
                 layers: int = 2) -> str:
    dp = 4 // (tp * pp) if tp * pp <= 4 else 1
    return DECODER.format(rules="\n".join(f"  {r}" for r in rules) or "  output : replicate", tp=tp, pp=pp,
                          style=style, chunks=chunks, layers=layers, batch=4 * dp)


def layout_rules(layout: dict[str, str], overrides: dict[str, str], fused: str | None) -> list[str]:
    rules = [f"layers[*].{p} : {_TEXT[s]}" for p, s in layout.items() if s != "none"]
    if fused is not None:
        rules.append(f"layers[*].{fused} : column(fused = 3)")
    rules += [f"layers[0].{p} : {_TEXT[s] if s != 'none' else 'replicate'}" for p, s in overrides.items()]
    return rules


def oracle(styles: dict[str, tuple[str, bool]]) -> bool:
    """Megatron's pairing for one decoder block (projection -> (style, fused = 3?)), written out
    independently of check: a column split (not gathered) leaves its output split; only a row
    split takes a split input, and it must get nothing else; q, k and v meet before wo, w1
    feeds w2; none of these projections is fused."""
    if any(f for _, f in styles.values()):
        return False
    style = {p: s for p, (s, _) in styles.items()}
    split = {p: s == "column" for p, s in style.items()}
    for producers, consumer in ((("attention.wq", "attention.wk", "attention.wv"), "attention.wo"),
                                (("feed_forward.w1",), "feed_forward.w2")):
        if any(style[p] == "row" for p in producers):
            return False  # their input is the residual stream: whole
        n_split = sum(split[p] for p in producers)
        if style[consumer] == "row":
            if n_split != len(producers):
                return False
        elif n_split:
            return False
        if split[consumer]:
            return False  # wo / w2 feed the residual stream and the next norm, which need it whole
    return True


def _sample_layouts(n: int, seed: int) -> list[tuple[dict[str, str], dict[str, str], str | None]]:
    rng = random.Random(seed)
    valid_shapes = [
        dict(zip(PROJECTIONS, ("column", "column", "column", "row", "column", "row"))),
        dict(zip(PROJECTIONS, ("none", "none", "none", "none", "column", "row"))),
        dict(zip(PROJECTIONS, ("column", "column", "column", "row", "replicate", "gather"))),
        dict(zip(PROJECTIONS, ("gather", "replicate", "none", "gather", "column", "row"))),
    ]
    out = []
    for i in range(n):
        if i % 3:  # a valid layout, sometimes with one projection of layer 0 overridden
            layout = dict(rng.choice(valid_shapes))
            overrides = {rng.choice(PROJECTIONS): rng.choice(STYLES)} if i % 3 == 1 else {}
        else:
            layout = {p: rng.choice(STYLES) for p in PROJECTIONS}
            overrides = {}
        fused = rng.choice(PROJECTIONS[:3]) if rng.random() < 0.08 else None
        out.append((layout, overrides, fused))
    return out


def _in_force(layout: dict[str, str], overrides: dict[str, str], fused: str | None) -> list[dict[str, tuple[str, bool]]]:
    """Per layer (2 of them), projection -> (style, fused): the last rule naming it wins."""
    layer = {p: (st, False) for p, st in layout.items()}
    if fused is not None:
        layer[fused] = ("column", True)
    first = {**layer, **{p: ("replicate" if st == "none" else st, False) for p, st in overrides.items()}}
    return [first, layer]


def test_check_refuses_exactly_the_broken_layouts() -> None:
    """60 seeded layouts: check's verdict equals the oracle's, and a refusal is a pairing code."""
    disagreements = []
    for layout, overrides, fused in _sample_layouts(60, seed=10):
        result = check_text(decoder_spec(layout_rules(layout, overrides, fused)), world=4, model=True)
        expected = all(oracle(styles) for styles in _in_force(layout, overrides, fused))
        codes = sorted({d.code for d in result.diagnostics if d.severity == "error"})
        if result.ok != expected:
            disagreements.append((layout, overrides, fused, expected, codes))
        if not result.ok:
            assert set(codes) <= {"E0212", "E0219", "E0220", "E0221"}, (layout, overrides, fused, codes)
    assert not disagreements, "\n".join(map(str, disagreements))


# --------------------------------------------------------------------------------------------
# Accepted layouts train the one-process model
# --------------------------------------------------------------------------------------------

QKVO = ["layers[*].attention.wq : column", "layers[*].attention.wk : column", "layers[*].attention.wv : column",
        "layers[*].attention.wo : row"]
MLP = ["layers[*].feed_forward.w1 : column", "layers[*].feed_forward.w2 : row"]

ACCEPTED = {
    "decoder_megatron_tp2_pp2": decoder_spec(["tok_embeddings : vocab", *QKVO, *MLP, "output : column"]),
    "decoder_layer0_kept_whole": decoder_spec([*QKVO, *MLP] + [
        f"layers[0].attention.{p} : replicate" for p in ("wq", "wk", "wv", "wo")]),
    "decoder_gathered_output_tp4": decoder_spec(["layers[*].attention.wo : column(gather_output = true)", *MLP],
                                                tp=4, pp=1),
    "gpt2_fused_tied_tp2_pp2": GPT2.format(pp=2, batch=4, rules="\n".join(f"  {r}" for r in (
        "transformer.wte : vocab", "lm_head : column", "transformer.h[*].attn.c_attn : column(fused = 3)",
        "transformer.h[*].attn.c_proj : row", "transformer.h[*].mlp.c_fc : column",
        "transformer.h[*].mlp.c_proj : row"))),
    "gpt2_fused_gathered_tp2_dp2": GPT2.format(pp=1, batch=8, rules="\n".join(f"  {r}" for r in (
        "transformer.h[*].attn.c_attn : column(fused = 3, gather_output = true)",
        "transformer.h[*].mlp.c_fc : column", "transformer.h[*].mlp.c_proj : row"))),
}


def _plans(specs: dict[str, str]) -> list[tuple[str, dict[str, Any]]]:
    from ppdsl.lowering.lower import lower

    out = []
    for name, text in specs.items():
        result = check_text(text, f"<{name}>", world=4, model=True)
        assert result.ok, (name, [d.message for d in result.diagnostics])
        out.append((name, lower(result.spec, 4, result.model_info).to_json()))
    return out


def verify_worker(rank: int, world: int, plans: list[tuple[str, dict[str, Any]]]) -> list[tuple[str, bool, str]]:
    import torch

    from ppdsl.lowering.plan import Plan
    from ppdsl.runtime.parallel.groups import build_process_groups, tie_pp_ranks_of
    from ppdsl.runtime.verify.world import verify_in_process

    out = []
    for name, data in plans:
        plan = Plan.from_json(data)
        groups = build_process_groups(plan.mesh, "cpu", tie_pp_ranks_of(plan.schedule.stage_ranks))
        report = verify_in_process(plan, groups, torch.device("cpu"), plan.train.steps)
        if report is not None:  # rank 0 holds the report
            out.append((name, report.ok, report.render()))
    return out


def _verify_all(specs: dict[str, str], timeout: float) -> None:
    from dist_harness import run_distributed  # imports torch: this module is collected without it (skipped)

    results = run_distributed(verify_worker, 4, _plans(specs), timeout=timeout)
    assert [name for name, _, _ in results[0]] == list(specs)
    failed = [(name, text) for name, ok, text in results[0] if not ok]
    assert not failed, "\n\n".join(f"{name}:\n{text}" for name, text in failed)


@pytest.mark.distributed
def test_accepted_layouts_verify() -> None:
    _verify_all(ACCEPTED, timeout=420)


@pytest.mark.distributed
@pytest.mark.slow
def test_accepted_sample_verifies() -> None:
    """Check-accepted layouts from the random sample, over schedule styles and tp."""
    specs: dict[str, str] = {}
    grid = [("1f1b", 1, 2, 2), ("interleaved", 2, 2, 2), ("zbv", 2, 2, 2), ("1f1b", 1, 4, 1), ("gpipe", 1, 2, 1)]
    accepted = []
    for layout, overrides, fused in _sample_layouts(200, seed=11):
        rules = layout_rules(layout, overrides, fused)
        if any("column" in r or "row" in r for r in rules) and check_text(decoder_spec(rules), world=4, model=True).ok:
            accepted.append(rules)
    for i, rules in enumerate(accepted[:10]):
        style, chunks, tp, pp = grid[i % len(grid)]
        specs[f"sample{i}_{style}_tp{tp}"] = decoder_spec(rules, tp=tp, pp=pp, style=style, chunks=chunks, layers=4)
    _verify_all(specs, timeout=1200)
