"""A memory snapshot's pieces, and the checkpoint folder they turn back into.

A snapshot is a checkpoint whose storage is node memory: each rank's piece is its ``manifest``
(JSON) and its ``payload``, the bytes of exactly the rank file ``save_checkpoint`` writes (the same
tensors, with their checksums in the safetensors header: [Note: checksums] in
``checkpoint/layout.py``), followed on rank 0 by a safetensors file of the model's persistent
buffers, and by the manifest's details (JSON: [Note: details in the file]). No pickle anywhere: a
piece is JSON and safetensors, and turning one back into files runs no code of its own. Params are
not kept: after a step they are the fp32 master rows cast down, which ``load_checkpoint`` writes
back into them; frozen params are the model's as built.

Here: the manifest, a frozen record of its frame and its details ([Note: details in the file]),
and writing a piece; the layout of its safetensors parts is ``file_layout.py``, its checks
``checks.py``, and the checkpoint files a restore writes from it ``checkpoint_files.py``.

Example::

    manifest = write_piece(shard, extras, path, step=15, rank=1, world_size=2, details=details)
    link.send_piece(manifest.frame.wire(), path)            # only the frame travels as JSON
    read_manifest(manifest.frame, path) == manifest          # the details come back from the file
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hf_lowzero.checkpoint.layout import crc32
from hf_lowzero.snapshot import json_text
from hf_lowzero.snapshot.file_layout import FileLayout, piece_layouts
from hf_lowzero.snapshot.mapped import MappedFiles
from hf_lowzero.snapshot.segments import read_range, take_spare, unlink

FORMAT = "hf_lowzero.snapshot"
FORMAT_VERSION = 3  # 2: the details are a part of the piece ([Note: details in the file]); 3: RNG states as
# bytes ([Note: RNG states as bytes] in hf_lowzero/trainer/snapshot_files.py)
DETAILS = "details"
DETAILS_ALIGN = 16 << 10  # the details are padded to this many bytes, so a piece's size rarely changes
MARKER_FILE = "hf_lowzero_snapshot.json"  # in a checkpoint-N folder that came from memory


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


def _details(details: Mapping[str, Any]) -> bytes:
    raw = json_text.dumps(details).encode()  # [Note: lists encoded once] in json_text.py
    return raw + b" " * (-len(raw) % DETAILS_ALIGN)


@dataclass
class Piece:
    """One rank's part of a snapshot in memory: its ``manifest`` and its ``payload`` (the piece's
    bytes; ``manifest.frame.parts`` says where each part lies in it)."""

    manifest: Manifest
    payload: bytes | bytearray

    def part(self, name: str) -> memoryview:
        """The bytes of part ``name`` (``"shard"``, ``"extras"`` or ``"details"``)."""
        start, end = self.manifest.frame.parts[name]
        return memoryview(self.payload)[start:end]


def encode_piece(
    shard: dict[str, torch.Tensor],
    extras: dict[str, torch.Tensor],
    *,
    step: int,
    rank: int,
    world_size: int,
    details: Mapping[str, Any],
    shard_data: memoryview | None = None,
) -> Piece:
    """Rank ``rank``'s piece of the snapshot of ``step`` at ``world_size`` ranks: ``shard`` (its rank
    file's tensors, on the host) and ``extras`` (rank 0's persistent buffers, else empty) as
    safetensors bytes with their checksums, and ``details`` (JSON) as its last part ([Note: details
    in the file]). ``shard_data``: ``shard``'s bytes as one buffer in the file's data order, when
    they are staged so (``FileLayout.write_data``). The bytes are built in memory; ``write_piece``
    writes the same bytes into a file instead ([Note: one pass over the shard] in ``file_layout.py``)."""
    layouts = piece_layouts(shard, extras)
    raw_details = _details(details)
    payload = bytearray(sum(layout.size for _, layout in layouts) + len(raw_details))
    parts, offset = {}, 0
    for name, layout in layouts:
        tensors = shard if name == "shard" else extras
        view = memoryview(payload)[offset : offset + layout.size]
        _write_part(layout, tensors, shard_data if name == "shard" else None,
                    lambda at, data, view=view: view.__setitem__(slice(at, at + len(data)), data))  # fmt: skip
        parts[name] = (offset, offset + layout.size)
        offset += layout.size
    payload[offset:] = raw_details
    parts[DETAILS] = (offset, offset + len(raw_details))
    frame = Frame(step, rank, world_size, parts, crc32(raw_details))
    return Piece(Manifest(frame, details), payload)


def write_piece(
    shard: dict[str, torch.Tensor],
    extras: dict[str, torch.Tensor],
    path: str | Path,
    *,
    step: int,
    rank: int,
    world_size: int,
    details: Mapping[str, Any],
    spares: str | Path | None = None,
    files: MappedFiles | None = None,
    shard_data: memoryview | None = None,
    shard_bytes: tuple[torch.Tensor, ...] | None = None,
) -> Manifest:
    """Write the piece ``encode_piece`` would build into the new file ``path`` (a memory-backed
    segment: ``hf_lowzero.snapshot.segments``) in one pass over the tensors; returns its manifest.
    ``spares``: a folder whose spare file of the piece's size, if any, becomes ``path`` ([Note:
    spare files] in ``segments.py``); ``files``: the writer's kept mappings ([Note: kept mappings]
    in ``mapped.py``; None: the file is mapped for this write only); ``shard_data``: as for
    ``encode_piece``; ``shard_bytes``: ``shard``'s bytes as flat ``uint8`` tensors in the file's
    data order (the live shard's: [Note: written from the live shard] in ``stager.py``), copied
    into the file in one torch call and then checksummed there."""
    layouts = piece_layouts(shard, extras)
    raw_details = _details(details)
    size = sum(layout.size for _, layout in layouts) + len(raw_details)
    parts, offset = {}, 0
    recycled = spares is not None and take_spare(spares, size, path)
    fd = os.open(path, os.O_RDWR if recycled else os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        files = files if files is not None else MappedFiles(max_kept=0)  # [Note: kept mappings]
        with files.writing(fd, size) as mapped:
            for name, layout in layouts:
                tensors = shard if name == "shard" else extras
                if name == "shard" and shard_bytes is not None:
                    _copy_into(mapped, offset, layout, shard_bytes)
                else:
                    _write_part(layout, tensors, shard_data if name == "shard" else None,
                                lambda at, data, base=offset: _put(mapped, base + at, data))  # fmt: skip
                parts[name] = (offset, offset + layout.size)
                offset += layout.size
            _put(mapped, offset, raw_details)
        parts[DETAILS] = (offset, offset + len(raw_details))
    except BaseException:
        os.close(fd)
        unlink(path)
        raise
    os.close(fd)
    return Manifest(Frame(step, rank, world_size, parts, crc32(raw_details)), details)


def _write_part(layout: FileLayout, tensors: dict[str, torch.Tensor], data: memoryview | None, put: Any) -> None:
    if data is None:
        layout.write(tensors, put)
    elif len(data) != layout.data_size:
        raise ValueError(f"the staged data has {len(data)} bytes, its tensors {layout.data_size}")
    else:
        layout.write_data(data, put)


def _copy_into(mapped: Any, offset: int, layout: FileLayout, parts: tuple[torch.Tensor, ...]) -> None:
    """Copy ``parts`` (the tensors' bytes in data order) into the file part at ``offset`` of the
    mapping ``mapped``, then its header, with the checksums of the bytes as they landed."""
    start, end = offset + len(layout.header), offset + layout.size
    if sum(t.numel() for t in parts) != layout.data_size:
        raise ValueError(f"the shard's bytes are {sum(t.numel() for t in parts)}, its file's data {layout.data_size}")
    if layout.data_size:
        region = torch.frombuffer(mapped, dtype=torch.uint8, count=layout.data_size, offset=start)
        try:
            torch.cat(parts, out=region)
        finally:
            del region  # the mapping is closed later: no tensor may still export it
    _put(mapped, offset, layout.checksummed_header(memoryview(mapped)[start:end]))


def _put(mapped: Any, offset: int, data: bytes | memoryview) -> None:
    data = memoryview(data).cast("B")
    mapped[offset : offset + len(data)] = data
