"""The snapshot protocol's records and what a node's holder holds, without Ray: the one definition
of a complete snapshot ([Note: complete snapshot] in hf_lowzero/snapshot/protocol.py), shared by
the holders (hf_lowzero/snapshot/held.py) and a restore (``run_marks``), and the requests as they
cross the wire."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest

from hf_lowzero.snapshot.frame import Frame
from hf_lowzero.snapshot.held import HeldSnapshots
from hf_lowzero.snapshot.protocol import (
    HeldStep,
    HolderIndex,
    Landed,
    LandRequest,
    MarkRequest,
    StepMarks,
    run_marks,
)

SIZE = 64


def _frame(step: int, rank: int, world_size: int = 2) -> Frame:
    return Frame(step, rank, world_size, {"shard": (0, SIZE - 16), "details": (SIZE - 16, SIZE)}, 1234)


def _land(held: HeldSnapshots, folder: Path, step: int, rank: int) -> tuple[bool, Path]:
    """A rank's piece of ``step`` written into ``folder`` and handed to ``held``."""
    path = folder / f"step{step}-rank{rank}.piece"
    path.write_bytes(bytes([step % 256]) * SIZE)
    return held.keep(_frame(step, rank), str(path)), path


def test_requests_cross_the_wire_as_the_json_they_always_were():
    frame = _frame(15, 1)
    land = LandRequest(frame, "/dev/shm/x.piece", "node-b", ("node-a", "node-b"), verified=True)
    assert land.wire() == {
        "op": "land",
        "manifest": {"format": "hf_lowzero.snapshot", "format_version": 3, "step": 15, "rank": 1, "world_size": 2,
                     "parts": {"shard": [0, 48], "details": [48, 64]}, "details_crc32": 1234},
        "path": "/dev/shm/x.piece", "buddy": "node-b", "nodes": ["node-a", "node-b"], "verified": True, "mark": True,
    }  # fmt: skip
    assert LandRequest.from_wire(json.loads(json.dumps(land.wire()))) == land
    assert land.marks() == MarkRequest(15, (1,), 2, True)
    mark = MarkRequest(15, (0, 1), 2, None)
    assert mark.wire() == {"op": "mark", "step": 15, "ranks": [0, 1], "world_size": 2, "verified": None}
    assert MarkRequest.from_wire(json.loads(json.dumps(mark.wire()))) == mark
    landed = Landed(None, 0.25, 0.5)
    assert Landed.from_wire(json.loads(json.dumps(landed.wire()))) == landed
    assert Landed.from_wire({"error": "refused"}) == Landed("refused")  # an endpoint's own answer
    assert pickle.loads(pickle.dumps(land)) == land  # Ray calls pickle them
    with pytest.raises(ValueError, match="format version 2"):
        LandRequest.from_wire({**land.wire(), "manifest": {**frame.wire(), "format_version": 2}})


def test_a_snapshot_is_complete_once_every_rank_marked_it_and_restorable_unless_it_failed_its_checks():
    marks = StepMarks(3)
    assert not marks.complete
    marks = marks.with_marks(MarkRequest(7, (0, 2), 3)).with_marks(MarkRequest(7, (1,), 3))
    assert marks.complete and marks.restorable
    failed = marks.with_marks(MarkRequest(7, (0,), 3, verified=False))
    assert failed.complete and not failed.restorable
    assert not failed.with_marks(MarkRequest(7, (1,), 3, verified=True)).restorable  # a failure is not forgotten
    merged = StepMarks(2, frozenset({0}), True).merged(StepMarks(2, frozenset({1})))
    assert merged == StepMarks(2, frozenset({0, 1}), True)


def test_a_restore_sees_the_marks_of_every_holder_together():
    # Holder b missed rank 1's mark of step 6 (it was unreachable then): together the run's holders
    # still make step 6 complete; step 7 is complete but failed its checks; step 8 is torn.
    a = HolderIndex("node-a", 0, {6: HeldStep(StepMarks(2, frozenset({0, 1})), frozenset({0})),
                                  7: HeldStep(StepMarks(2, frozenset({0, 1}), False), frozenset({0})),
                                  8: HeldStep(StepMarks(2, frozenset({0})), frozenset({0}))})  # fmt: skip
    b = HolderIndex("node-b", 0, {6: HeldStep(StepMarks(2, frozenset({0})), frozenset({1})),
                                  7: HeldStep(StepMarks(2, frozenset({0, 1}), False), frozenset({1}))})  # fmt: skip
    marks = run_marks([a, b])
    assert {s for s, m in marks.items() if m.complete} == {6, 7}
    assert max(s for s, m in marks.items() if m.restorable) == 6
    assert (a.pieces(6), b.pieces(6), b.pieces(8)) == (frozenset({0}), frozenset({1}), frozenset())


def test_a_holder_keeps_the_newest_complete_snapshot_and_what_is_newer(tmp_path):
    held = HeldSnapshots("node-a", tmp_path)
    paths = {}
    for step in (4, 5):
        for rank in (0, 1):
            kept, paths[step, rank] = _land(held, tmp_path, step, rank)
            assert kept
    held.mark(MarkRequest(4, (0, 1), 2))
    held.mark(MarkRequest(5, (0,), 2))  # step 5 is not complete yet: step 4 stays
    both = frozenset({0, 1})
    steps = {4: HeldStep(StepMarks(2, both), both), 5: HeldStep(StepMarks(2, frozenset({0})), both)}
    assert held.index() == HolderIndex("node-a", 4 * SIZE, steps)
    held.mark(MarkRequest(5, (1,), 2))  # step 5 completes: step 4's files become spares of their size
    assert set(held.index().steps) == {5}
    assert not paths[4, 0].exists() and len(list(tmp_path.glob(f"spare-{SIZE}-*"))) == 2
    assert held.piece(5, 1).path == str(paths[5, 1])
    with pytest.raises(KeyError):
        held.piece(4, 0)
    kept, late = _land(held, tmp_path, 5, 0)  # a piece of a step already complete is refused
    assert not kept and not late.exists()


def test_a_snapshot_that_failed_its_checks_does_not_replace_the_rollback_point(tmp_path):
    held = HeldSnapshots("node-a", tmp_path)
    for step, verified in [(4, True), (5, False), (6, True)]:
        for rank in (0, 1):
            _land(held, tmp_path, step, rank)
        held.mark(MarkRequest(step, (0, 1), 2, verified))
        if step == 5:  # complete, but not a rollback point: step 4 is kept with it
            assert set(held.index().steps) == {4, 5}
    assert set(held.index().steps) == {6}  # a newer one that passed: both go


def test_the_same_piece_again_replaces_the_file_it_was_in(tmp_path):
    held = HeldSnapshots("node-a", tmp_path)
    _, first = _land(held, tmp_path, 3, 0)
    again = tmp_path / "again.piece"
    again.write_bytes(b"x" * SIZE)
    assert held.keep(_frame(3, 0), str(again))
    assert not first.exists() and held.piece(3, 0).path == str(again)
    held.clear()
    assert held.index().steps == {} and not held.keep(_frame(9, 0), str(again))
