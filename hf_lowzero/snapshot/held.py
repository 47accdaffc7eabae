"""What a node's holder holds of one run: the pieces (files in the node's memory) and the ranks'
marks, per step; which snapshot is complete and which may be restored (``StepMarks``: [Note:
complete snapshot] in ``protocol.py``), and what is dropped once a newer one is. No Ray here: the
holder actor (``hf_lowzero/ray/holder.py``) serves it to the run.

Example::

    held = HeldSnapshots(node_id, folder)
    held.keep(manifest.frame, path)                    # a piece landed whole (the holder owns its file now)
    held.mark(MarkRequest(step=15, ranks=(0, 1), world_size=2))
    held.index().steps[15].marks.complete              # True: every rank marked step 15
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from hf_lowzero.snapshot import segments
from hf_lowzero.snapshot.frame import Frame
from hf_lowzero.snapshot.protocol import HeldStep, HolderIndex, MarkRequest, StepMarks


@dataclass(frozen=True)
class HeldPiece:
    """A piece a holder keeps: its frame, and the file it is in."""

    frame: Frame
    path: str


@dataclass
class _Step:
    marks: StepMarks
    pieces: dict[int, HeldPiece] = field(default_factory=dict)  # rank -> its piece


class HeldSnapshots:
    """A node's pieces and marks of one run, safe to use from the holder's threads.

    Args:
        node_id: The node, for ``index()``.
        folder: The node's snapshot folder of the run, whose spare files a dropped piece joins
            ([Note: spare files] in ``segments.py``).
    """

    def __init__(self, node_id: str, folder: Path) -> None:
        self.node_id = node_id
        self.folder = folder
        self._lock = threading.Lock()
        self._steps: dict[int, _Step] = {}
        self._complete: int | None = None  # the newest complete step: older pieces are refused
        self._kept: int | None = None  # the oldest step held on purpose: the newest restorable one

    def keep(self, frame: Frame, path: str) -> bool:
        """Hold the piece in ``path`` (which this holder now owns); False when it is not newer than
        the newest complete snapshot (its file is removed).
        """
        with self._lock:
            if self._complete is not None and frame.step <= self._complete:
                stale, kept = path, False
            else:
                step = self._steps.setdefault(frame.step, _Step(StepMarks(frame.world_size)))
                same = step.pieces.get(frame.rank)  # the same piece again
                stale = same.path if same is not None else None
                step.pieces[frame.rank] = HeldPiece(frame, path)
                kept = True
        if stale is not None and (stale != path or not kept):
            segments.unlink(stale)
        return kept

    def mark(self, marks: MarkRequest) -> None:
        """Record ``marks``; once they complete a snapshot newer than any before, drop the pieces
        older than the newest restorable one ([Note: complete snapshot] in ``protocol.py``).
        """
        with self._lock:
            step = self._steps.setdefault(marks.step, _Step(StepMarks(marks.world_size)))
            step.marks = step.marks.with_marks(marks)
            if not step.marks.complete or (self._complete is not None and marks.step <= self._complete):
                return
            self._complete = marks.step
            if step.marks.restorable:  # a rollback point: older snapshots are no longer needed
                self._kept = marks.step
            keep = self._kept if self._kept is not None else marks.step
            dropped = [piece for s, older in self._steps.items() if s < keep for piece in older.pieces.values()]
            self._steps = {s: held for s, held in self._steps.items() if s >= keep}
            sizes = Counter(piece.frame.size for held in self._steps.values() for piece in held.pieces.values())
        for piece in dropped:  # [Note: spare files] in segments.py: as many as the pieces of a size held
            segments.recycle(piece.path, keep_at_most=sizes[piece.frame.size])
        if dropped:
            segments.drop_spares(self.folder, set(sizes))

    def piece(self, step: int, rank: int) -> HeldPiece:
        """Rank ``rank``'s piece of ``step`` (KeyError: not held)."""
        with self._lock:
            return self._steps[step].pieces[rank]

    def index(self) -> HolderIndex:
        """What this holder knows: per step, its marks and the ranks whose pieces it holds."""
        with self._lock:
            steps = {s: HeldStep(held.marks, frozenset(held.pieces)) for s, held in self._steps.items()}
            size = sum(piece.frame.size for held in self._steps.values() for piece in held.pieces.values())
        return HolderIndex(self.node_id, size, steps)

    def clear(self) -> None:
        """Forget every piece (the caller removes their files) and take no more: the run is over."""
        with self._lock:
            self._steps = {}
            self._complete = 1 << 62
