"""What is wrong with a snapshot's piece, read without torch and without pickle: its frame against
its length (what a holder checks as a piece lands), its safetensors headers and each tensor's
extent, and each chunk's checksum (what a restore checks before it uses a piece: [Note: complete
snapshot] in ``protocol.py``). A frame that is not one of ours is refused before, by
``Frame.from_wire``.

Example::

    payload_error(manifest.frame, payload)            # None, or what is wrong
    piece_length_error(frame, "/dev/shm/.../step00000015-rank00001.piece")
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

from hf_lowzero.checkpoint.layout import byte_chunk_checksums, crc32
from hf_lowzero.snapshot.frame import DETAILS, Frame

# Bytes per element of each safetensors dtype tag, to walk a payload's chunks without torch.
_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
             "U16": 2, "U32": 4, "U64": 8, "F8_E4M3": 1, "F8_E5M2": 1}  # fmt: skip


def payload_error(frame: Frame, payload: bytes | memoryview, checksums: bool = True) -> str | None:
    """What is wrong with the piece ``payload`` whose frame is ``frame`` (its length, each tensor's
    extent and, with ``checksums``, each chunk's checksum), or None. Reads the safetensors headers with ``json`` and
    checks bytes with CRC-32: no torch, no pickle. A holder checks a piece's frame and length as it
    lands; a restore checks all of it before it uses a piece ([Note: complete snapshot])."""
    view = memoryview(payload)
    error = frame.size_error(len(view))
    if error is not None:
        return error
    for name, (start, end) in frame.parts.items():
        if name == DETAILS:  # JSON, read at a restore ([Note: details in the file])
            error = (
                "does not match its checksum" if checksums and crc32(view[start:end]) != frame.details_crc32 else None
            )
        else:
            error = safetensors_error(view[start:end], checksums)
        if error is not None:
            return f"part {name!r}: {error}"
    return None


def piece_file_error(frame: Frame, path: str | Path) -> str | None:
    """What is wrong with the structure of the piece in file ``path`` (``payload_error`` without the
    checksums), reading only its headers."""
    path = Path(path)
    if not path.is_file():
        return f"no piece at {path}"
    error = frame.size_error(path.stat().st_size)
    if error is not None:
        return error
    with open(path, "rb") as f:
        for name, (start, end) in frame.parts.items():
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


def piece_length_error(frame: Frame, path: str | Path) -> str | None:
    """What is wrong with the piece in file ``path`` as far as its frame and its length tell (no
    byte of it is read), or None: what a holder checks as a piece lands ([Note: complete snapshot]
    in ``protocol.py``)."""
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        return f"no piece at {path}"
    return frame.size_error(size)


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
