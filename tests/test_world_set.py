"""dsl/world_set.py: the rules over the worlds of an elastic launch (E0330, E0331), without launching."""

from __future__ import annotations

from pathlib import Path

from _run_helpers import TINY_CPU, tiny_cpu_spec

from ppdsl.dsl.world_set import WorldSet, check_world_set


def test_a_world_the_spec_does_not_hold_for_is_e0330_with_a_note_for_it() -> None:
    result = check_world_set(str(TINY_CPU), [], WorldSet((1, 3), 4))
    head, *notes = result.diagnostics
    assert not result.ok and head.code == "E0330" and head.span is None
    assert head.hint == "no --nproc makes every world of 1:3 node(s) valid (valid world sizes: multiples of 4 that divide 8: 4, 8)"
    assert head.message == "--nnodes 1:3 x --nproc 4 can make world sizes 4, 8, 12; the spec does not hold for 1 of them"
    [n] = notes
    assert n.code == "E0302" and n.severity.value == "note" and n.message.startswith("at 3 node(s) x 4 = world 12: ")
    assert result.sources[str(TINY_CPU)] == TINY_CPU.read_text()


def test_a_global_batch_that_changes_with_the_world_is_e0331_only_with_checkpoints(tmp_path: Path) -> None:
    for every, codes in ((3, ["E0331"]), (None, [])):
        spec = tiny_cpu_spec(tmp_path, f"s{every}", steps=6, every=every)
        spec.write_text(spec.read_text().replace("global_batch = 8", "global_batch = 4 * dp"))
        result = check_world_set(str(spec), ["mesh.tp=1"], WorldSet((1, 2), 2))
        assert [d.code for d in result.diagnostics] == codes
    assert result.ok and check_world_set(str(TINY_CPU), [], WorldSet((1, 2), 4)).ok
