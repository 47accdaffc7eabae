"""A memory snapshot's pieces, and the checkpoint folder they turn back into.

A snapshot is a checkpoint whose storage is node memory: each rank's piece is its ``manifest``
(JSON) and its ``payload``, the bytes of exactly the rank file ``save_checkpoint`` writes (the same
tensors, with their checksums in the safetensors header: [Note: checksums] in
``checkpoint/layout.py``), followed on rank 0 by a safetensors file of the model's persistent
buffers, and by the manifest's details (JSON: [Note: details in the file]). No pickle anywhere: a
piece is JSON and safetensors, and turning one back into files runs no code of its own. Params are
not kept: after a step they are the fp32 master rows cast down, which ``load_checkpoint`` writes
back into them; frozen params are the model's as built.

Here: writing a piece. Its manifest, a frozen record of its frame and its details ([Note: details
in the file]), is ``frame.py`` (no torch: a holder reads it); the layout of its safetensors parts
is ``file_layout.py``, its checks ``checks.py``, and the checkpoint files a restore writes from it
``checkpoint_files.py``.

Example::

    manifest = write_piece(shard, extras, path, step=15, rank=1, world_size=2, details=details)
    link.send_piece(manifest.frame.wire(), path)            # only the frame travels as JSON
    read_manifest(manifest.frame, path) == manifest          # the details come back from the file
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hf_lowzero.checkpoint.layout import crc32
from hf_lowzero.snapshot import json_text
from hf_lowzero.snapshot.file_layout import FileLayout, piece_layouts
from hf_lowzero.snapshot.frame import DETAILS, Frame, Manifest
from hf_lowzero.snapshot.mapped import MappedFiles
from hf_lowzero.snapshot.segments import take_spare, unlink

DETAILS_ALIGN = 16 << 10  # the details are padded to this many bytes, so a piece's size rarely changes
MARKER_FILE = "hf_lowzero_snapshot.json"  # in a checkpoint-N folder that came from memory


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
