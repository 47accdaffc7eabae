"""The checkpoint format, written and checked here only: file names and which rank owns each,
tensor keys, the metadata's format tag and version, and the per-chunk checksums of every tensor.

A sharded optimizer checkpoint directory (``hf_lowzero.save_checkpoint``)::

    zero_meta.json                               format, world size, shapes, groups, scaler (last)
    zero_model_extras.safetensors                frozen params and persistent buffers (rank 0)
    zero_shard_rank00000_of_00002.safetensors    rank 0's rows of master weights and state
    zero_shard_rank00001_of_00002.safetensors    rank 1's rows

Every safetensors file holds, in its own metadata, the checksums of its tensors ([Note: checksums]).
Inside a Trainer ``checkpoint-N/`` folder that directory is ``zero_optimizer/``, next to the
Trainer's own files (model weights, ``trainer_state.json``, ``scheduler.pt``, ``rng_state_<rank>.pth``).

Example::

    >>> rank_file_name(1, 2)
    'zero_shard_rank00001_of_00002.safetensors'
    >>> owner_rank("checkpoint-10/zero_optimizer/zero_shard_rank00001_of_00002.safetensors")
    1
    >>> owner_rank("checkpoint-10/trainer_state.json")
    0
    >>> chunk_span(300_000, 300_010, 600_000)   # elements [262144, 524288) cover the slice
    (262144, 524288)

# [Note: checksums]
# Each tensor carries a CRC-32 per chunk of CHECKSUM_CHUNK_NUMEL elements of its flattened bytes,
# in the safetensors metadata of its own file under the tensor's key, so data and checksums are
# written in one atomic file write. A reader verifies exactly the chunks it reads: loading at
# another world size reads a slice of a saved row widened to chunk boundaries (at most one chunk
# more at each end, ``chunk_span``), so each rank still reads only the saved rows that overlap its
# new ones, and every byte it uses is checked. Whole tensors (the extras) verify every chunk.
# CRC-32 runs at about 6 GB/s with ISA-L's carry-less multiply (the ``isal`` package, the same
# checksum as zlib's), 1.4 GB/s with zlib's table; either is a small part of writing the bytes to
# disk, and with ISA-L a small part of a memory snapshot too.
"""

from __future__ import annotations

import re
from pathlib import PurePath
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # a snapshot holder reads this module's names and CRC-32s, and imports no torch
    import torch

try:  # the same CRC-32 as zlib's, 4x faster ([Note: checksums])
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - isal is a dependency; a platform without its wheel falls back
    from zlib import crc32

FORMAT = "hf_lowzero.zero"
FORMAT_VERSION = 3  # 3: whole-parameter ownership (owners, whole and packed state); 2: checksums; 1: neither
META_FILE = "zero_meta.json"
EXTRAS_FILE = "zero_model_extras.safetensors"
TRAINER_SUBDIR = "zero_optimizer"  # the sharded optimizer inside a Trainer checkpoint-N folder
PARTIAL_SUFFIX = ".partial"  # a save in progress (see [Note: atomic save])
OLD_SUFFIX = ".old"  # the previous checkpoint, between a save's two renames
CHECKSUM_CHUNK_NUMEL = 1 << 18  # 1 MiB of fp32 per checksum
# The packed state classes (tensor subclasses, ``module:qualname``) a checkpoint may name: loading
# imports one only when its name is here, checked before any import ([Note: loading runs no code]).
PACKED_STATE_CLASSES: tuple[str, ...] = (
    "torchao.optim.subclass_8bit:OptimState8bit",
    "torchao.optim.subclass_4bit:OptimState4bit",
    "torchao.optim.subclass_fp8:OptimStateFp8",
)

_RANK_FILE = "zero_shard_rank{rank:05d}_of_{world_size:05d}.safetensors"
# Files written by one rank only: its optimizer shard, and the Trainer's per-rank RNG state.
_RANK_OWNED = re.compile(r"^(?:zero_shard_rank(?P<shard>\d+)_of_\d+\.safetensors|rng_state_(?P<rng>\d+)\.pth)$")


def rank_file_name(rank: int, world_size: int) -> str:
    return _RANK_FILE.format(rank=rank, world_size=world_size)


def owner_rank(path: str | PurePath) -> int:
    """The rank that writes (and, under Ray, reports) ``path``: a rank's own shard or RNG state
    belongs to that rank, every other file of a checkpoint to rank 0."""
    match = _RANK_OWNED.match(PurePath(path).name)
    if match is None:
        return 0
    return int(match.group("shard") or match.group("rng"))


def partial_dir(path: PurePath) -> PurePath:
    return path.with_name(path.name + PARTIAL_SUFFIX)


def old_dir(path: PurePath) -> PurePath:
    return path.with_name(path.name + OLD_SUFFIX)


def master_key(name: str) -> str:
    return f"master/{name}"  # this rank's real (unpadded) elements of the master weights (fp32 or bf16)


def state_key(name: str, key: str) -> str:
    return f"state/{name}/{key}"  # this rank's elements of an optimizer state tensor (exp_avg, ...)


def extra_key(name: str) -> str:
    return f"extra/{name}"  # a frozen param or persistent buffer, whole, in EXTRAS_FILE


def format_header() -> dict[str, Any]:
    """The fields of ``zero_meta.json`` that say what it is; checked by :func:`format_error`."""
    return {"format": FORMAT, "format_version": FORMAT_VERSION}


def format_error(meta: Any) -> str | None:
    """What is wrong with the format fields of a parsed ``zero_meta.json``, or None."""
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        return "not an hf_lowzero checkpoint metadata file"
    version = meta.get("format_version")
    if version in (1, 2, FORMAT_VERSION):  # 1: without checksums, read unverified; 1-2: row shards only
        return None
    return (
        f"unknown format version {version!r}; this hf_lowzero reads versions 1 to {FORMAT_VERSION}. "
        "Upgrade hf_lowzero to load it."
    )


def packed_class_error(name: Any) -> str | None:
    """Why ``name`` may not be imported as a packed state class, or None ([Note: loading runs no
    code] in ``meta_check.py``): only the names in ``PACKED_STATE_CLASSES`` are, compared as strings."""
    if name in PACKED_STATE_CLASSES:
        return None
    return f"packed state class {name!r} is not one this hf_lowzero loads (allowed: {', '.join(PACKED_STATE_CLASSES)})"


def has_checksums(meta: dict[str, Any]) -> bool:
    """Whether every tensor of the checkpoint must carry checksums: from version 2 on. Version 1
    checkpoints (the same layout, saved before checksums existed) still load; a tensor whose file
    holds checksums is verified whatever the version says (an edited version turns nothing off)."""
    return meta["format_version"] >= 2


def file_checksums(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """The safetensors metadata of a file holding ``tensors``: each key's chunk checksums."""
    return {key: " ".join(f"{c:08x}" for c in chunk_checksums(t)) for key, t in tensors.items()}


def chunk_checksums(tensor: torch.Tensor) -> list[int]:
    """CRC-32 of each CHECKSUM_CHUNK_NUMEL-element chunk of ``tensor`` flattened (last one shorter)."""
    import torch  # here, not at the top: see the TYPE_CHECKING import

    flat = tensor.detach().contiguous().reshape(-1)
    raw = memoryview(flat.view(torch.uint8).numpy())  # the bytes as stored (numpy has no bf16)
    return byte_chunk_checksums(raw, flat.element_size())


def byte_chunk_checksums(raw: bytes | memoryview, element_size: int) -> list[int]:
    """CRC-32 of each CHECKSUM_CHUNK_NUMEL-element chunk of a tensor's bytes (``element_size`` bytes
    an element): the same checksums as ``chunk_checksums``, from bytes alone (no torch needed)."""
    step = CHECKSUM_CHUNK_NUMEL * element_size
    return [crc32(raw[i : i + step]) for i in range(0, len(raw), step)]


def chunk_span(start: int, end: int, numel: int) -> tuple[int, int]:
    """The chunk-aligned elements ``[lo, hi)`` of a ``numel``-element tensor that hold ``[start, end)``."""
    lo = start // CHECKSUM_CHUNK_NUMEL * CHECKSUM_CHUNK_NUMEL
    hi = min(-(-end // CHECKSUM_CHUNK_NUMEL) * CHECKSUM_CHUNK_NUMEL, numel)
    return lo, hi


def checksum_error(stored: str | None, data: torch.Tensor, start: int = 0) -> str | None:
    """Compare ``data`` (the tensor's elements from ``start``, chunk-aligned; see ``chunk_span``)
    with the checksums ``stored`` in the file's metadata; what differs, or None."""
    if stored is None:
        return "has no checksum in the file's metadata"
    expected = stored.split()
    first = start // CHECKSUM_CHUNK_NUMEL
    for i, actual in enumerate(chunk_checksums(data), start=first):
        if i >= len(expected) or int(expected[i], 16) != actual:
            lo = i * CHECKSUM_CHUNK_NUMEL
            hi = min(lo + CHECKSUM_CHUNK_NUMEL, start + data.numel())
            return f"is corrupted: elements [{lo}, {hi}) do not match their checksum (the file changed after saving)"
    return None
