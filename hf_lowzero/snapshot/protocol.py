"""The snapshot protocol's records: what a rank asks its node's holder (``LandRequest``), what
holders tell each other (``MarkRequest``), what a rank is answered (``Landed``), and what a holder
knows (``HolderIndex``: per step, its ``StepMarks`` and the pieces it holds). ``StepMarks`` is the
one definition of a complete snapshot, for the holders and for a restore alike ([Note: complete
snapshot]).

Requests travel as JSON on the holders' standing connections ([Note: piece transfer] in
``transfer.py``): ``wire()`` and ``from_wire()`` are the only places that know their keys. An
index travels through a Ray call, pickled.

Example::

    link.post(LandRequest(manifest.frame, str(path), buddy, nodes, verified=None).wire())   # a rank
    landed = Landed.from_wire(link.answer())                                                # later
    marks = run_marks(indexes)                          # a restore: every holder of the run together
    step = max(s for s, m in marks.items() if m.restorable)

# [Note: complete snapshot]
# Rank r's step S is marked on every holder of the run only after both its pieces (own node, buddy
# node) landed whole: the rank wrote its file before it asked (a rank that dies while writing asks
# nothing), the own holder checked the frame (format, version) and the file's length, and the
# buddy received exactly that many bytes ([Note: one request per snapshot] in
# ``hf_lowzero/ray/holder.py``). S is complete when every rank of S marked it (``StepMarks.complete``);
# only a complete snapshot is ever restored, so a failure while a snapshot is being taken (a torn
# snapshot) resumes the previous one. The rest is checked when a restore fetches the pieces, before
# any is used: every part's header, every tensor's extent and every chunk's checksum, once per
# restore instead of once per snapshot on holders whose CPU training needs (reading the headers as
# each piece landed, on both nodes, was a sixth of the holders' CPU per snapshot for the main job),
# and a piece that fails sends every rank to storage together (``hf_lowzero/ray/restore.py``), never
# into a restart loop. A holder keeps the newest complete snapshot and anything newer in progress,
# and drops the rest as soon as a newer one completes (``held.py``). When the run checks its
# integrity, each mark says whether the step passed its checks; only those snapshots are rollback
# points ([Note: rollback] in ``hf_lowzero/ray/integrity.py``), so the newest complete one that
# passed (``StepMarks.restorable``) is kept until a newer one that passed completes, and it is the
# one a restore resumes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from hf_lowzero.snapshot.frame import Frame


@dataclass(frozen=True)
class MarkRequest:
    """Ranks ``ranks`` of a snapshot of ``step`` at ``world_size`` ranks have both their pieces
    landed ([Note: complete snapshot]); ``verified``: the step passed its integrity checks (None:
    the run checks none). What a holder sends the run's other holders, batched per node.
    """

    step: int
    ranks: tuple[int, ...]
    world_size: int
    verified: bool | None = None

    def wire(self) -> dict[str, Any]:
        """The request as the JSON object a connection carries."""
        return {"op": "mark", "step": self.step, "ranks": list(self.ranks), "world_size": self.world_size,
                "verified": self.verified}  # fmt: skip

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> MarkRequest:
        """The request a connection carried (``wire``'s inverse)."""
        return cls(int(wire["step"]), tuple(int(r) for r in wire["ranks"]), int(wire["world_size"]), wire["verified"])


@dataclass(frozen=True)
class LandRequest:
    """A rank's one request per snapshot to its node's holder ([Note: one request per snapshot] in
    ``hf_lowzero/ray/holder.py``): keep the piece whose frame is ``frame``, written into ``path`` on
    the holder's node, copy it to node ``buddy``'s holder (None: no copy), and mark it on the
    holders of ``nodes`` (the run's nodes); ``verified`` as in ``MarkRequest``; ``mark`` False: land
    only, never mark (the tests' torn snapshot).
    """

    frame: Frame
    path: str
    buddy: str | None
    nodes: tuple[str, ...]
    verified: bool | None = None
    mark: bool = True

    def marks(self) -> MarkRequest:
        """The mark of this piece's rank, once both its pieces landed."""
        return MarkRequest(self.frame.step, (self.frame.rank,), self.frame.world_size, self.verified)

    def wire(self) -> dict[str, Any]:
        """The request as the JSON object a connection carries."""
        return {"op": "land", "manifest": self.frame.wire(), "path": self.path, "buddy": self.buddy,
                "nodes": list(self.nodes), "verified": self.verified, "mark": self.mark}  # fmt: skip

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> LandRequest:
        """The request a connection carried (``wire``'s inverse).

        Raises:
            ValueError: Its frame is not that of a piece of ours (``Frame.from_wire``).
        """
        return cls(Frame.from_wire(wire["manifest"]), str(wire["path"]), wire.get("buddy"), tuple(wire["nodes"]),
                   wire.get("verified"), bool(wire.get("mark", True)))  # fmt: skip


@dataclass(frozen=True)
class Landed:
    """A holder's answer to a ``LandRequest``: what went wrong (None: both pieces landed and are
    marked everywhere), and where the time went, in seconds: ``send_s`` (the copy to the buddy
    node) and ``mark_s`` (the marks).
    """

    error: str | None
    send_s: float = 0.0
    mark_s: float = 0.0

    def wire(self) -> dict[str, Any]:
        """The answer as the JSON object a connection carries."""
        return {"error": self.error, "send_s": self.send_s, "mark_s": self.mark_s}

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> Landed:
        """The answer a connection carried; an endpoint's own refusal (``{"error": ...}``) too."""
        return cls(wire.get("error"), float(wire.get("send_s", 0.0)), float(wire.get("mark_s", 0.0)))


@dataclass(frozen=True)
class StepMarks:
    """Which ranks of a snapshot of ``world_size`` ranks marked it, and whether its step passed its
    integrity checks (None: not checked; False: it failed them).
    """

    world_size: int
    marked: frozenset[int] = frozenset()
    verified: bool | None = None

    @property
    def complete(self) -> bool:
        """Every rank marked it: the one definition of a complete snapshot ([Note: complete snapshot])."""
        return self.marked == frozenset(range(self.world_size))

    @property
    def restorable(self) -> bool:
        """Complete, and not of a step that failed its integrity checks ([Note: rollback] in
        ``hf_lowzero/ray/integrity.py``): a snapshot a restore may resume.
        """
        return self.complete and self.verified is not False

    def merged(self, other: StepMarks) -> StepMarks:
        """These marks and ``other``'s together (a failed check is never forgotten)."""
        verified = False if False in (self.verified, other.verified) else other.verified
        return StepMarks(self.world_size, self.marked | other.marked, self.verified if verified is None else verified)

    def with_marks(self, marks: MarkRequest) -> StepMarks:
        """These marks and those of ``marks``."""
        return self.merged(StepMarks(marks.world_size, frozenset(marks.ranks), marks.verified))


@dataclass(frozen=True)
class HeldStep:
    """What a holder knows of one step: its marks, and the ranks whose pieces it holds."""

    marks: StepMarks
    pieces: frozenset[int] = frozenset()


@dataclass(frozen=True)
class HolderIndex:
    """What a holder knows: per step, its marks and the pieces it holds; and the bytes it holds."""

    node_id: str
    bytes: int
    steps: Mapping[int, HeldStep]

    def pieces(self, step: int) -> frozenset[int]:
        """The ranks whose pieces of ``step`` this holder holds."""
        held = self.steps.get(step)
        return held.pieces if held is not None else frozenset()


def run_marks(indexes: Iterable[HolderIndex]) -> dict[int, StepMarks]:
    """Each step's marks on a run's holders together: a mark is sent to every holder of the run,
    and one that was unreachable then lacks it.
    """
    marks: dict[int, StepMarks] = {}
    for index in indexes:
        for step, held in index.steps.items():
            marks[step] = marks[step].merged(held.marks) if step in marks else held.marks
    return marks
