"""A snapshot piece's frame and manifest, without torch: all a holder needs to check, keep and send
a piece (``hf_lowzero/ray/holder.py``: a Ray actor per node, which imports this and no torch).

Writing a piece (its tensors' bytes) is ``format.py``.

Example::

    frame = Frame.from_wire(request["manifest"])             # ValueError: not a piece of ours
    read_manifest(frame, path).details["zero_meta"]          # the details come back from the file
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hf_lowzero.checkpoint.layout import crc32
from hf_lowzero.snapshot.segments import read_range

FORMAT = "hf_lowzero.snapshot"
FORMAT_VERSION = 3  # 2: the details are a part of the piece ([Note: details in the file]); 3: RNG states as
# bytes ([Note: RNG states as bytes] in hf_lowzero/trainer/snapshot_files.py)
DETAILS = "details"


# [Note: details in the file]
# A piece's manifest is its frame (``Frame``: step, rank, world size, where each part lies, the
# details' CRC-32; with the format and its version, a few hundred bytes of JSON on the wire), all
# a holder needs to check, keep and send a piece; and its details (the optimizer's state records,
# rank 0's checkpoint metadata, the RNG states, the trainer state with its log, the LR schedule),
# tens of KB that grow with the log and are needed only at a restore. The details are the last
# part of the piece's file, JSON padded with spaces to a multiple of ``DETAILS_ALIGN`` (so that a
# piece's size, and the spare files of that size, stay the same from one snapshot to the next).
# They travel with the tensors' bytes (``sendfile``), and on the way only the frame is JSON:
# parsing and re-encoding the whole manifest at every hop was most of a holder's CPU time per
# snapshot. ``read_manifest`` puts the two back together, checking the details' CRC-32.


@dataclass(frozen=True)
class Frame:
    """A piece's frame ([Note: details in the file]): rank ``rank``'s piece of the snapshot of
    ``step`` taken at ``world_size`` ranks, where each part lies in its bytes, and its details'
    CRC-32. It crosses the wire as JSON (``wire``, ``from_wire``), and Ray calls pickled.

    Example::

        frame = Frame.from_wire(request["manifest"])    # ValueError: not a piece of ours
        frame.size_error(os.stat(path).st_size)         # None: the file is as long as the frame says
    """

    step: int
    rank: int
    world_size: int
    parts: Mapping[str, tuple[int, int]]  # part name ("shard", "extras", "details") -> (start, end) in the piece
    details_crc32: int

    @property
    def size(self) -> int:
        """Bytes in the piece."""
        return max(end for _, end in self.parts.values())

    def part_size(self, name: str) -> int:
        """Bytes in part ``name``."""
        start, end = self.parts[name]
        return end - start

    def size_error(self, size: int) -> str | None:
        """What is wrong with this frame as that of a piece of ``size`` bytes, or None."""
        return None if size == self.size else f"payload of {size} bytes, the manifest describes {self.size}"

    def wire(self) -> dict[str, Any]:
        """The frame as the JSON object a request carries."""
        return {"format": FORMAT, "format_version": FORMAT_VERSION, "step": self.step, "rank": self.rank,
                "world_size": self.world_size, "parts": {name: list(span) for name, span in self.parts.items()},
                "details_crc32": self.details_crc32}  # fmt: skip

    @classmethod
    def from_wire(cls, wire: Any) -> Frame:
        """The frame a request carried (``wire``'s inverse).

        Raises:
            ValueError: Not the frame of a piece of ours: another format or version, a field missing
                or of the wrong type, or no details.
        """
        if not isinstance(wire, dict) or wire.get("format") != FORMAT:
            raise ValueError("not an hf_lowzero snapshot piece")
        if wire.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"snapshot format version {wire.get('format_version')!r}, expected {FORMAT_VERSION}")
        try:
            parts = {str(name): (int(start), int(end)) for name, (start, end) in wire["parts"].items()}
            frame = cls(int(wire["step"]), int(wire["rank"]), int(wire["world_size"]), parts, wire["details_crc32"])
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"not an hf_lowzero snapshot piece ({e!r})") from e
        if DETAILS not in parts or not isinstance(frame.details_crc32, int):
            raise ValueError("a piece without its details")
        return frame


@dataclass(frozen=True)
class Manifest:
    """A piece's whole manifest: its ``frame`` and its ``details``, the JSON object the piece's last
    part holds ([Note: details in the file]): ``records`` (each whole param's state record), rank
    0's ``zero_meta``, and the Trainer's state (``trainer/snapshot_files.py``).
    """

    frame: Frame
    details: Mapping[str, Any]

    def as_json(self) -> dict[str, Any]:
        """The manifest as one JSON object, the frame's fields beside the details' (what
        ``write_trainer_files`` in ``hf_lowzero/trainer/snapshot_files.py`` reads)."""
        return {**self.details, **self.frame.wire()}


def read_manifest(frame: Frame, path: str | Path) -> Manifest:
    """The whole manifest of the piece in file ``path``: ``frame`` and the details it holds.

    Raises:
        ValueError: The details do not match their checksum, or are not JSON.
    """
    start, end = frame.parts[DETAILS]
    raw = read_range(path, start, end)
    if crc32(raw) != frame.details_crc32:
        raise ValueError(f"the details of rank {frame.rank}'s piece of step {frame.step} do not match their checksum")
    return Manifest(frame, json.loads(raw))
