"""A memory snapshot's pieces, and the checkpoint folder they turn back into.

A snapshot is a checkpoint whose storage is node memory: each rank's piece is its ``manifest``
(JSON) and its ``payload``, the bytes of exactly the rank file ``save_checkpoint`` writes (the same
tensors, with their checksums in the safetensors header: [Note: checksums] in
``checkpoint/layout.py``), followed on rank 0 by a safetensors file of the model's persistent
buffers. No pickle anywhere: a piece is JSON and safetensors, and turning one back into files runs no
code of its own. Params are not kept: after a step they are the fp32 master rows cast down, which
``load_checkpoint`` writes back into them; frozen params are the model's as built.

Example::

    piece = encode_piece(shard, extras, manifest)                          # on the rank, in the background
    assert payload_error(piece.manifest, piece.payload, checksums=False) is None   # a holder, as it lands
    write_part("resume/checkpoint-15/zero_optimizer", manifest, "shard", data)   # at restore
    write_zero_metadata("resume/checkpoint-15/zero_optimizer", manifests)
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as safetensors_bytes

from hf_lowzero.checkpoint.layout import (
    EXTRAS_FILE,
    META_FILE,
    byte_chunk_checksums,
    file_checksums,
    rank_file_name,
)
from hf_lowzero.checkpoint.shards import atomic_write

FORMAT = "hf_lowzero.snapshot"
FORMAT_VERSION = 1
MARKER_FILE = "hf_lowzero_snapshot.json"  # in a checkpoint-N folder that came from memory
# Bytes per element of each safetensors dtype tag, to walk a payload's chunks without torch.
_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
             "U16": 2, "U32": 4, "U64": 8, "F8_E4M3": 1, "F8_E5M2": 1}  # fmt: skip


@dataclass
class Piece:
    """One rank's part of a snapshot: ``manifest`` (JSON-able) and ``payload`` (safetensors bytes;
    ``manifest["parts"]`` says where each file's bytes lie in it)."""

    manifest: dict[str, Any]
    payload: bytes

    @property
    def step(self) -> int:
        return self.manifest["step"]

    def part(self, name: str) -> memoryview:
        start, end = self.manifest["parts"][name]
        return memoryview(self.payload)[start:end]


def encode_piece(shard: dict[str, torch.Tensor], extras: dict[str, torch.Tensor], manifest: dict[str, Any]) -> Piece:
    """The piece of a rank: ``shard`` (its rank file's tensors, on the host) and ``extras`` (rank 0's
    persistent buffers, else empty) as safetensors bytes with their checksums, and ``manifest`` with
    the format fields and where each part lies. Costs one checksum pass and one copy of the bytes."""
    parts, blobs, offset = {}, [], 0
    for name, tensors in (("shard", shard), ("extras", extras)):
        if name == "extras" and not tensors:
            continue
        blob = safetensors_bytes(tensors, metadata=file_checksums(tensors))
        parts[name] = [offset, offset + len(blob)]
        offset += len(blob)
        blobs.append(blob)
    manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, **manifest, "parts": parts}
    return Piece(manifest, b"".join(blobs) if len(blobs) > 1 else blobs[0])


def payload_error(manifest: dict[str, Any], payload: bytes | memoryview, checksums: bool = True) -> str | None:
    """What is wrong with a piece (its format, its length, each tensor's extent and, with
    ``checksums``, each chunk's checksum), or None. Reads the safetensors headers with ``json`` and
    checks bytes with ``zlib``: no torch, no pickle. A holder checks a piece's structure as it lands;
    a restore checks every checksum before it uses a piece ([Note: complete snapshot])."""
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        return "not an hf_lowzero snapshot piece"
    if manifest.get("format_version") != FORMAT_VERSION:
        return f"snapshot format version {manifest.get('format_version')!r}, expected {FORMAT_VERSION}"
    view = memoryview(payload)
    ends = [end for _, end in manifest["parts"].values()]
    if not ends or max(ends) != len(view):
        return f"payload of {len(view)} bytes, the manifest describes {max(ends, default=0)}"
    for name, (start, end) in manifest["parts"].items():
        error = safetensors_error(view[start:end], checksums)
        if error is not None:
            return f"part {name!r}: {error}"
    return None


def safetensors_error(blob: bytes | memoryview, checksums: bool = True) -> str | None:
    """What is wrong with the bytes of a safetensors file of ours (see ``payload_error``), or None."""
    blob = memoryview(blob)
    if len(blob) < 8:
        return "truncated"
    (header_len,) = struct.unpack("<Q", blob[:8])
    try:
        header = json.loads(bytes(blob[8 : 8 + header_len]))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return f"unreadable header ({e})"
    stored_checksums = header.pop("__metadata__", None) or {}
    data = blob[8 + header_len :]
    for key, info in header.items():
        start, end = info["data_offsets"]
        if end > len(data):
            return f"{key!r} is truncated"
        stored = stored_checksums.get(key)
        if stored is None:
            return f"{key!r} has no checksum"
        if not checksums:
            continue
        expected = stored.split()
        actual = byte_chunk_checksums(data[start:end], _ITEMSIZE[info["dtype"]])
        if len(actual) != len(expected) or any(int(e, 16) != a for e, a in zip(expected, actual)):
            return f"{key!r} does not match its checksum"
    return None


def zero_metadata(manifests: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """``zero_meta.json`` of the snapshot whose ranks' manifests are ``manifests`` (every rank of
    it): rank 0's metadata, each whole param described by its owner, each file's size."""
    world_size = manifests[0]["world_size"]
    if sorted(manifests) != list(range(world_size)):
        raise ValueError(f"a snapshot of {world_size} ranks needs every rank's manifest, got ranks {sorted(manifests)}")
    meta = json.loads(json.dumps(manifests[0]["zero_meta"]))  # a copy
    files = {}
    for rank, manifest in manifests.items():
        meta["params"].update(manifest["records"])
        start, end = manifest["parts"]["shard"]
        files[rank_file_name(rank, world_size)] = end - start
    if "extras" in manifests[0]["parts"]:
        start, end = manifests[0]["parts"]["extras"]
        files[EXTRAS_FILE] = end - start
    meta["files"] = files
    return meta


def part_file_name(rank: int, part: str, world_size: int) -> str:
    """The file of a checkpoint's ``zero_optimizer/`` folder that part ``part`` of rank ``rank``'s piece is."""
    return rank_file_name(rank, world_size) if part == "shard" else EXTRAS_FILE


def write_part(zero_dir: str | Path, manifest: dict[str, Any], part: str, data: bytes | memoryview) -> Path:
    """Write one part of a piece (its bytes as ``Holder.part`` returns them) as its checkpoint file.
    Atomic, so ranks of one node may write the same file."""
    start, end = manifest["parts"][part]
    if len(data) != end - start:
        raise ValueError(f"part {part!r} of rank {manifest['rank']}: {len(data)} bytes, expected {end - start}")
    path = Path(zero_dir) / part_file_name(manifest["rank"], part, manifest["world_size"])
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda f: Path(f).write_bytes(data))
    return path


def write_zero_metadata(zero_dir: str | Path, manifests: dict[int, dict[str, Any]]) -> Path:
    """Write ``zero_meta.json`` of the snapshot whose manifests are ``manifests`` (every rank's)."""
    path = Path(zero_dir) / META_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda f: Path(f).write_text(json.dumps(zero_metadata(manifests), indent=1)))
    return path
