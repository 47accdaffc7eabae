"""A memory snapshot's pieces, and the checkpoint folder they turn back into.

A snapshot is a checkpoint whose storage is node memory: each rank's piece is its ``manifest``
(JSON) and its ``payload``, the bytes of exactly the rank file ``save_checkpoint`` writes (the same
tensors, with their checksums in the safetensors header: [Note: checksums] in
``checkpoint/layout.py``), followed on rank 0 by a safetensors file of the model's persistent
buffers, and by the manifest's details (JSON: [Note: details in the file]). No pickle anywhere: a
piece is JSON and safetensors, and turning one back into files runs no code of its own. Params are
not kept: after a step they are the fp32 master rows cast down, which ``load_checkpoint`` writes
back into them; frozen params are the model's as built.

Example::

    piece = encode_piece(shard, extras, manifest)                          # on the rank, in the background
    assert payload_error(piece.manifest, piece.payload, checksums=False) is None   # a holder, as it lands
    write_part("resume/checkpoint-15/zero_optimizer", manifest, "shard", data)   # at restore
    write_zero_metadata("resume/checkpoint-15/zero_optimizer", manifests)
"""

from __future__ import annotations

import functools
import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as safetensors_bytes

from hf_lowzero.checkpoint.layout import (
    CHECKSUM_CHUNK_NUMEL,
    EXTRAS_FILE,
    META_FILE,
    byte_chunk_checksums,
    crc32,
    rank_file_name,
)
from hf_lowzero.checkpoint.shards import atomic_write
from hf_lowzero.snapshot import json_text
from hf_lowzero.snapshot.mapped import MappedFiles
from hf_lowzero.snapshot.segments import read_range, take_spare, unlink

FORMAT = "hf_lowzero.snapshot"
FORMAT_VERSION = 3  # 2: the details are a part of the piece ([Note: details in the file]); 3: RNG states as
# bytes ([Note: RNG states as bytes] in hf_lowzero/trainer/snapshot_files.py)
DETAILS = "details"
FRAME_KEYS = ("format", "format_version", "step", "rank", "world_size", "parts", "details_crc32")
PUT_BLOCK = 1 << 20  # ``write_data`` copies this much at a time, right after checksumming it
DETAILS_ALIGN = 16 << 10  # the details are padded to this many bytes, so a piece's size rarely changes
MARKER_FILE = "hf_lowzero_snapshot.json"  # in a checkpoint-N folder that came from memory
# Bytes per element of each safetensors dtype tag, to walk a payload's chunks without torch.
_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
             "U16": 2, "U32": 4, "U64": 8, "F8_E4M3": 1, "F8_E5M2": 1}  # fmt: skip


# [Note: details in the file]
# A piece's manifest is its frame (format, version, step, rank, world size, where each part lies,
# the details' CRC-32: ``FRAME_KEYS``, a few hundred bytes), all a holder needs to check, keep and
# send a piece; and its details (the optimizer's state records, rank 0's checkpoint metadata, the
# RNG states, the trainer state with its log, the LR schedule), tens of KB that grow with the log
# and are needed only at a restore. The details are the last part of the piece's file, JSON padded
# with spaces to a multiple of ``DETAILS_ALIGN`` (so that a piece's size, and the spare files of
# that size, stay the same from one snapshot to the next). They travel with the tensors' bytes
# (``sendfile``), and on the way only the frame is JSON: parsing and re-encoding the whole
# manifest at every hop was most of a holder's CPU time per snapshot. ``read_manifest`` puts the
# two back together, checking the details' CRC-32.


def frame_of(manifest: dict[str, Any]) -> dict[str, Any]:
    """The frame of a piece's manifest ([Note: details in the file])."""
    return {key: manifest[key] for key in FRAME_KEYS if key in manifest}


def read_manifest(frame: dict[str, Any], path: str | Path) -> dict[str, Any]:
    """The whole manifest of the piece in file ``path``: ``frame`` and the details it holds.

    Raises:
        ValueError: The details do not match their checksum, or are not JSON.
    """
    start, end = frame["parts"][DETAILS]
    raw = read_range(path, start, end)
    if crc32(raw) != frame.get("details_crc32"):
        raise ValueError(
            f"the details of rank {frame['rank']}'s piece of step {frame['step']} do not match their checksum"
        )
    return {**json.loads(raw), **frame}


def _details(manifest: dict[str, Any]) -> bytes:
    details = {key: value for key, value in manifest.items() if key not in FRAME_KEYS}
    raw = json_text.dumps(details).encode()  # [Note: lists encoded once] in json_text.py
    return raw + b" " * (-len(raw) % DETAILS_ALIGN)


def _framed(manifest: dict[str, Any], parts: dict[str, list[int]], details: bytes) -> dict[str, Any]:
    """The whole manifest, with the format fields, the parts and the details' checksum."""
    return {"format": FORMAT, "format_version": FORMAT_VERSION, **manifest, "parts": parts,
            "details_crc32": crc32(details)}  # fmt: skip


@dataclass
class Piece:
    """One rank's part of a snapshot: ``manifest`` (JSON-able) and ``payload`` (safetensors bytes;
    ``manifest["parts"]`` says where each file's bytes lie in it)."""

    manifest: dict[str, Any]
    payload: bytes | bytearray

    @property
    def step(self) -> int:
        return self.manifest["step"]

    def part(self, name: str) -> memoryview:
        start, end = self.manifest["parts"][name]
        return memoryview(self.payload)[start:end]


def encode_piece(
    shard: dict[str, torch.Tensor],
    extras: dict[str, torch.Tensor],
    manifest: dict[str, Any],
    shard_data: memoryview | None = None,
) -> Piece:
    """The piece of a rank: ``shard`` (its rank file's tensors, on the host) and ``extras`` (rank 0's
    persistent buffers, else empty) as safetensors bytes with their checksums, and ``manifest`` with
    the format fields and where each part lies; the rest of ``manifest`` is also the piece's last
    part ([Note: details in the file]). ``shard_data``: ``shard``'s bytes as one buffer in the file's
    data order, when they are staged so (``FileLayout.write_data``). The bytes are built in memory;
    ``write_piece`` writes the same bytes into a file instead ([Note: one pass over the shard])."""
    layouts = piece_layouts(shard, extras)
    details = _details(manifest)
    payload = bytearray(sum(layout.size for _, layout in layouts) + len(details))
    parts, offset = {}, 0
    for name, layout in layouts:
        tensors = shard if name == "shard" else extras
        view = memoryview(payload)[offset : offset + layout.size]
        _write_part(layout, tensors, shard_data if name == "shard" else None,
                    lambda at, data, view=view: view.__setitem__(slice(at, at + len(data)), data))  # fmt: skip
        parts[name] = [offset, offset + layout.size]
        offset += layout.size
    payload[offset:] = details
    parts[DETAILS] = [offset, offset + len(details)]
    return Piece(_framed(manifest, parts, details), payload)


def write_piece(
    shard: dict[str, torch.Tensor],
    extras: dict[str, torch.Tensor],
    manifest: dict[str, Any],
    path: str | Path,
    spares: str | Path | None = None,
    files: MappedFiles | None = None,
    shard_data: memoryview | None = None,
    shard_bytes: tuple[torch.Tensor, ...] | None = None,
) -> dict[str, Any]:
    """Write the piece ``encode_piece`` would build into the new file ``path`` (a memory-backed
    segment: ``hf_lowzero.snapshot.segments``) in one pass over the tensors; returns its manifest.
    ``spares``: a folder whose spare file of the piece's size, if any, becomes ``path`` ([Note:
    spare files] in ``segments.py``); ``files``: the writer's kept mappings ([Note: kept mappings]
    in ``mapped.py``; None: the file is mapped for this write only); ``shard_data``: as for
    ``encode_piece``; ``shard_bytes``: ``shard``'s bytes as flat ``uint8`` tensors in the file's
    data order (the live shard's: [Note: written from the live shard] in ``stager.py``), copied
    into the file in one torch call and then checksummed there."""
    layouts = piece_layouts(shard, extras)
    details = _details(manifest)
    size = sum(layout.size for _, layout in layouts) + len(details)
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
                parts[name] = [offset, offset + layout.size]
                offset += layout.size
            _put(mapped, offset, details)
        parts[DETAILS] = [offset, offset + len(details)]
    except BaseException:
        os.close(fd)
        unlink(path)
        raise
    os.close(fd)
    return _framed(manifest, parts, details)


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


# [Note: one pass over the shard]
# A piece is safetensors files whose header holds each tensor's chunk checksums. Serializing with
# ``safetensors.save`` and then joining parts costs a checksum pass, a copy into the file's bytes
# and a copy to join; a snapshot then moved those bytes again to reach a holder. Here the header is
# laid out first, with a fixed-width slot of "00000000" per chunk (a CRC-32 is always 8 hex
# digits), so its length does not depend on the checksums. Then each chunk of each tensor is
# checksummed and copied to its place in one pass (the chunk is read while it is still in cache),
# through a mapping of the file the writer keeps ([Note: kept mappings] in ``mapped.py``), and the
# header goes last with its slots filled in. The data follows safetensors' own order of
# tensors (by dtype, then name), so a piece's part is byte for byte the data of the rank file
# ``save_checkpoint`` writes; the headers are equal as JSON.


@dataclass
class FileLayout:
    """Where everything lies in one safetensors file of ours: the header (with checksum slots) and
    each tensor's data."""

    header: bytes  # the 8-byte length and the JSON header with every checksum slot "00000000"
    slots: dict[str, int]  # key -> offset in ``header`` of its first checksum slot
    size: int  # bytes in the file
    spans: tuple[tuple[str, int, int, int], ...]  # (key, start, end, element size) in the data, in order

    @property
    def data_size(self) -> int:
        """Bytes of the tensors' data (the file less its header)."""
        return self.size - len(self.header)

    def write(self, tensors: dict[str, torch.Tensor], put: Any) -> None:
        """Checksum and write ``tensors`` chunk by chunk with ``put(offset, bytes)``, then the header."""
        header = bytearray(self.header)
        base = len(header)
        raws = {}  # key -> (its start in the data, its bytes)
        for key, start, _, _ in self.spans:
            flat = tensors[key].detach().reshape(-1)
            if not flat.is_contiguous() or flat.device.type != "cpu":
                raise ValueError(f"{key!r}: a piece is written from contiguous host tensors, got {flat.device}")
            raws[key] = (start, memoryview(flat.view(torch.uint8).numpy()))
        for key, slot, lo, hi in self.chunks:
            start, raw = raws[key]
            chunk = raw[lo - start : hi - start]
            _checksum_into(header, slot, chunk)
            put(base + lo, chunk)
        put(0, header)

    def write_data(self, data: memoryview, put: Any) -> None:
        """``write`` from the tensors' data as one buffer (``data_size`` bytes in data order: a
        packed staging buffer, [Note: packed staging] in ``stager.py``): the chunks' checksums, and
        the bytes with ``put`` in blocks of about a chunk, each right after its checksums (in cache)."""
        header = bytearray(self.header)
        base, done = len(header), 0
        for _, slot, lo, hi in self.chunks:
            _checksum_into(header, slot, data[lo:hi])
            if hi - done >= PUT_BLOCK:
                put(base + done, data[done:hi])
                done = hi
        if done < len(data):
            put(base + done, data[done:])
        put(0, header)

    @functools.cached_property
    def chunks(self) -> tuple[tuple[str, int, int, int], ...]:
        """Each checksum chunk of the data, in order: (its tensor's key, its slot's offset in
        ``header``, its start and its end in the data)."""
        out = []
        for key, start, end, element_size in self.spans:
            step = CHECKSUM_CHUNK_NUMEL * element_size
            out += [(key, self.slots[key] + 9 * i, lo, min(lo + step, end))
                    for i, lo in enumerate(range(start, end, step))]  # fmt: skip
        return tuple(out)

    def checksummed_header(self, data: memoryview) -> bytearray:
        """The header with the checksums of ``data`` (the tensors' ``data_size`` bytes, in data order)."""
        header = bytearray(self.header)
        for _, slot, lo, hi in self.chunks:  # one small tensor is one chunk: no per-tensor Python
            _checksum_into(header, slot, data[lo:hi])
        return header


def _checksum_into(header: bytearray, slot: int, chunk: memoryview) -> None:
    """Fill the checksum slot at ``slot`` of ``header`` with ``chunk``'s CRC-32 (8 hex digits)."""
    header[slot : slot + 8] = b"%08x" % crc32(chunk)


def piece_layouts(shard: dict[str, torch.Tensor], extras: dict[str, torch.Tensor]) -> list[tuple[str, FileLayout]]:
    """The parts of a piece and their layouts: ``shard``, then ``extras`` when there are any."""
    out = [("shard", file_layout(shard))]
    if extras:
        out.append(("extras", file_layout(extras)))
    return out


def file_layout(tensors: dict[str, torch.Tensor]) -> FileLayout:
    """The layout of the safetensors file of ``tensors`` ([Note: one pass over the shard])."""
    return _layout(tuple((key, tuple(t.shape), t.dtype) for key, t in tensors.items()))


@functools.lru_cache(maxsize=64)
def _layout(spec: tuple[tuple[str, tuple[int, ...], torch.dtype], ...]) -> FileLayout:
    # safetensors' own order and dtype names, read from a file of one element per tensor (made from
    # bytes: a factory would make fake tensors under the GPU-path simulation's FakeTensorMode).
    probe = safetensors_bytes({key: torch.frombuffer(bytearray(dtype.itemsize), dtype=dtype) for key, _, dtype in spec})
    probe_header = json.loads(probe[8 : 8 + int.from_bytes(probe[:8], "little")])
    probe_header.pop("__metadata__", None)
    order = sorted(probe_header, key=lambda key: probe_header[key]["data_offsets"][0])
    shapes = {key: (shape, dtype) for key, shape, dtype in spec}
    entries, spans, offset = {}, [], 0
    for key in order:
        shape, dtype = shapes[key]
        element_size = dtype.itemsize
        nbytes = math.prod(shape) * element_size
        dtype_name = probe_header[key]["dtype"]
        entries[key] = {"dtype": dtype_name, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        spans.append((key, offset, offset + nbytes, element_size))
        offset += nbytes
    # The checksum slots come first in the header, so their offsets are known as it is built.
    text, slots = '{"__metadata__":{', {}
    for i, key in enumerate(order):
        numel = math.prod(shapes[key][0])
        chunks = -(-numel // CHECKSUM_CHUNK_NUMEL)
        text += ("," if i else "") + json.dumps(key) + ':"'
        slots[key] = 8 + len(text.encode())
        text += " ".join(["00000000"] * chunks) + '"'
    text += "}" + "".join(f",{json.dumps(key)}:{json.dumps(entries[key], separators=(',', ':'))}" for key in order)
    text += "}"
    raw = text.encode()
    raw += b" " * (-len(raw) % 8)  # safetensors pads its header to 8 bytes
    header = len(raw).to_bytes(8, "little") + raw
    return FileLayout(header, slots, len(header) + offset, tuple(spans))


def payload_error(manifest: dict[str, Any], payload: bytes | memoryview, checksums: bool = True) -> str | None:
    """What is wrong with a piece (its format, its length, each tensor's extent and, with
    ``checksums``, each chunk's checksum), or None. Reads the safetensors headers with ``json`` and
    checks bytes with CRC-32: no torch, no pickle. A holder checks a piece's frame and length as it
    lands; a restore checks all of it before it uses a piece ([Note: complete snapshot])."""
    view = memoryview(payload)
    error = manifest_error(manifest, len(view))
    if error is not None:
        return error
    for name, (start, end) in manifest["parts"].items():
        if name == DETAILS:  # JSON, read at a restore ([Note: details in the file])
            error = (
                "does not match its checksum"
                if checksums and crc32(view[start:end]) != manifest["details_crc32"]
                else None
            )
        else:
            error = safetensors_error(view[start:end], checksums)
        if error is not None:
            return f"part {name!r}: {error}"
    return None


def piece_file_error(manifest: dict[str, Any], path: str | Path) -> str | None:
    """What is wrong with the structure of the piece in file ``path`` (``payload_error`` without the
    checksums), reading only its headers."""
    path = Path(path)
    if not path.is_file():
        return f"no piece at {path}"
    error = manifest_error(manifest, path.stat().st_size)
    if error is not None:
        return error
    with open(path, "rb") as f:
        for name, (start, end) in manifest["parts"].items():
            if name == DETAILS:  # JSON, checked when a restore reads it ([Note: details in the file])
                continue
            f.seek(start)
            head = f.read(8)
            if len(head) < 8:
                return f"part {name!r}: truncated"
            (header_len,) = struct.unpack("<Q", head)
            if header_len > end - start - 8:
                return f"part {name!r}: truncated"
            header, error = _parse_header(f.read(header_len))
            error = error or _extent_error(header, end - start - 8 - header_len)
            if error is not None:
                return f"part {name!r}: {error}"
    return None


def piece_length_error(manifest: dict[str, Any], path: str | Path) -> str | None:
    """What is wrong with the piece in file ``path`` as far as its frame and its length tell (no
    byte of it is read), or None: what a holder checks as a piece lands ([Note: complete snapshot]
    in ``hf_lowzero/ray/holder.py``)."""
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        return f"no piece at {path}"
    return manifest_error(manifest, size)


def manifest_error(manifest: dict[str, Any], size: int) -> str | None:
    """What is wrong with ``manifest`` as that of a piece of ``size`` bytes (its format, its version,
    its length), or None: checked before a piece's bytes are read or sent."""
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        return "not an hf_lowzero snapshot piece"
    if manifest.get("format_version") != FORMAT_VERSION:
        return f"snapshot format version {manifest.get('format_version')!r}, expected {FORMAT_VERSION}"
    ends = [end for _, end in manifest["parts"].values()]
    if not ends or max(ends) != size:
        return f"payload of {size} bytes, the manifest describes {max(ends, default=0)}"
    if DETAILS not in manifest["parts"] or not isinstance(manifest.get("details_crc32"), int):
        return "a piece without its details"
    return None


def safetensors_error(blob: bytes | memoryview, checksums: bool = True) -> str | None:
    """What is wrong with the bytes of a safetensors file of ours (see ``payload_error``), or None."""
    blob = memoryview(blob)
    if len(blob) < 8:
        return "truncated"
    (header_len,) = struct.unpack("<Q", blob[:8])
    header, error = _parse_header(bytes(blob[8 : 8 + header_len]))
    data = blob[8 + header_len :]
    error = error or _extent_error(header, len(data))
    if error is not None or not checksums:
        return error
    stored_checksums = header["__metadata__"]
    for key, info in header.items():
        if key == "__metadata__":
            continue
        start, end = info["data_offsets"]
        expected = stored_checksums[key].split()
        actual = byte_chunk_checksums(data[start:end], _ITEMSIZE[info["dtype"]])
        if len(actual) != len(expected) or any(int(e, 16) != a for e, a in zip(expected, actual)):
            return f"{key!r} does not match its checksum"
    return None


def _parse_header(raw: bytes) -> tuple[dict[str, Any], str | None]:
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return {}, f"unreadable header ({e})"
    if not isinstance(header, dict):
        return {}, "unreadable header (not a JSON object)"
    header["__metadata__"] = header.get("__metadata__") or {}
    return header, None


def _extent_error(header: dict[str, Any], data_len: int) -> str | None:
    """Each tensor within the data, with a checksum."""
    for key, info in header.items():
        if key == "__metadata__":
            continue
        start, end = info["data_offsets"]
        if end > data_len:
            return f"{key!r} is truncated"
        if header["__metadata__"].get(key) is None:
            return f"{key!r} has no checksum"
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
