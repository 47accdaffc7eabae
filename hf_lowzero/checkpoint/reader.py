"""Reading a sharded checkpoint: its metadata, and any slice of any rank's rows, validated
(present, complete, of the recorded shape, matching its checksums: [Note: checksums] in layout.py).

Example::

    meta = read_metadata("ckpt/step-100")
    reader = ShardReader(Path("ckpt/step-100"), meta)
    row = torch.zeros(ParamShard(numel, world_size=3).shard_numel)
    read_row(reader, "master/head.weight", numel, ParamShard(numel, world_size=3), rank=1, out=row)
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from hf_lowzero.checkpoint.layout import (
    META_FILE,
    checksum_error,
    chunk_span,
    format_error,
    has_checksums,
    old_dir,
    partial_dir,
    rank_file_name,
)
from hf_lowzero.checkpoint.meta_check import check_metadata
from hf_lowzero.checkpoint.shards import CheckpointError
from hf_lowzero.zero.layout.partition import ParamShard


def read_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """Parse and check ``zero_meta.json`` of checkpoint directory ``path``."""
    meta_path = Path(path) / META_FILE
    if not meta_path.is_file():
        hint = unfinished_save(Path(path))
        raise CheckpointError(f"{meta_path}: missing; not a complete hf_lowzero checkpoint{hint}")
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{meta_path}: corrupted metadata ({e})") from e
    error = format_error(meta)
    if error is not None:
        raise CheckpointError(f"{meta_path}: {error}")
    check_metadata(meta, meta_path)
    return meta


def unfinished_save(path: Path) -> str:
    """What an interrupted save left beside checkpoint directory ``path`` (which lacks its metadata),
    as a hint for the error that refuses it, or "" ([Note: atomic save] in ``save.py``)."""
    partial, old = Path(partial_dir(path)), Path(old_dir(path))
    if (partial / META_FILE).is_file():
        previous = f", and {old} the previous one" if old.is_dir() else ""
        return (
            f". A save was cut between its last renames: {partial} holds the complete new checkpoint{previous}. "
            f"Restore it with: mv {partial} {path}"
        )
    hint = f". An unfinished save left {partial} (incomplete: not loadable)" if partial.exists() else ""
    if old.is_dir():
        hint += f". {old} holds the previous complete checkpoint; restore it with: mv {old} {path}"
    return hint


class ShardReader:
    """Opens checkpoint files lazily, validates each once, and reads slices of their tensors."""

    def __init__(self, path: Path, meta: dict[str, Any]) -> None:
        self.path = path
        self.meta = meta
        self.saved_world_size = meta["world_size"]
        self._open: dict[str, Any] = {}
        self._keys: dict[str, set[str]] = {}
        self._checksums: dict[str, dict[str, str]] = {}
        self._verify = has_checksums(meta)

    def file(self, name: str):
        if name not in self._open:
            file = self.path / name
            if not file.is_file():
                raise CheckpointError(
                    f"{file}: file missing (the checkpoint was saved by {self.saved_world_size} ranks)"
                )
            expected = self.meta["files"].get(name)
            if expected is not None and file.stat().st_size != expected:
                raise CheckpointError(
                    f"{file}: truncated or corrupted ({file.stat().st_size} bytes, metadata says {expected})"
                )
            try:
                self._open[name] = safe_open(str(file), framework="pt")
                self._keys[name] = set(self._open[name].keys())
                self._checksums[name] = self._open[name].metadata() or {}
            except Exception as e:  # safetensors raises its own error type for bad headers
                raise CheckpointError(f"{file}: truncated or corrupted ({e})") from e
        return self._open[name]

    def read(self, name: str, key: str, shape: list[int], start: int | None = None, end: int | None = None):
        """Tensor ``key`` of ``shape`` from file ``name``; elements ``[start, end)`` if given (1D).

        Reads and verifies the checksummed chunks that hold what is asked ([Note: checksums])."""
        f = self.file(name)
        if key not in self._keys[name]:
            raise CheckpointError(f"{self.path / name}: tensor {key!r} missing")
        sl = f.get_slice(key)
        if list(sl.get_shape()) != shape:
            raise CheckpointError(f"{self.path / name}: tensor {key!r} has shape {sl.get_shape()}, expected {shape}")
        try:
            if start is None:
                lo, data = 0, f.get_tensor(key)
            else:
                lo, hi = chunk_span(start, end, shape[0])
                data = sl[lo:hi]
        except Exception as e:
            raise CheckpointError(f"{self.path / name}: tensor {key!r} unreadable ({e})") from e
        stored = self._checksums[name].get(key)  # verified whenever present, whatever the version says
        error = checksum_error(stored, data, lo) if self._verify or stored is not None else None
        if error is not None:
            raise CheckpointError(f"{self.path / name}: tensor {key!r} {error}")
        return data if start is None else data[start - lo : end - lo]

    @property
    def files_read(self) -> list[str]:
        return sorted(self._open)


def read_row(
    reader: ShardReader,
    key: str,
    numel: int,
    new: ParamShard,
    rank: int,
    out: torch.Tensor,
    saved_owner: int | None = None,
) -> None:
    """Fill ``out`` (this rank's new piece, padding zero) from the saved ranks whose pieces overlap
    it: rows of every saved rank, or the whole tensor from its saved owner (``saved_owner``)."""
    start, end = new.owned_range(rank)
    if start >= end:
        return
    old = ParamShard(numel, world_size=reader.saved_world_size, owner=saved_owner)
    for old_rank in range(reader.saved_world_size):
        old_start, old_end = old.owned_range(old_rank)
        lo, hi = max(start, old_start), min(end, old_end)
        if lo < hi:
            name = rank_file_name(old_rank, reader.saved_world_size)
            saved = reader.read(name, key, [old_end - old_start], lo - old_start, hi - old_start)
            out[lo - start : hi - start].copy_(saved)
