"""The layout of one safetensors file of ours, laid out before its bytes: the header with a
fixed-width checksum slot per chunk, and where each tensor's data lies ([Note: one pass over the
shard]). A snapshot's piece is such files (``format.py``); the bytes equal those of the rank file
``save_checkpoint`` writes.

Example::

    layout = file_layout(shard)                 # cached per (key, shape, dtype) spec
    layout.write(shard, put)                    # put(offset, bytes): the chunks, then the checksummed header
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import save as safetensors_bytes

from hf_lowzero.checkpoint.layout import CHECKSUM_CHUNK_NUMEL, crc32

PUT_BLOCK = 1 << 20  # ``write_data`` copies this much at a time, right after checksumming it


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
