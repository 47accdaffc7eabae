"""A snapshot's pieces written back as the files of a checkpoint's ``zero_optimizer/`` folder, which
``load_checkpoint`` reads at any world size (the Trainer's own files: ``trainer/snapshot_files.py``).

Example::

    write_part("resume/checkpoint-15/zero_optimizer", manifest.frame, "shard", data)   # at restore
    write_zero_metadata("resume/checkpoint-15/zero_optimizer", manifests)
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hf_lowzero.checkpoint.atomic import atomic_write
from hf_lowzero.checkpoint.layout import EXTRAS_FILE, META_FILE, rank_file_name
from hf_lowzero.snapshot.frame import Frame, Manifest


def zero_metadata(manifests: Mapping[int, Manifest]) -> dict[str, Any]:
    """``zero_meta.json`` of the snapshot whose ranks' manifests are ``manifests`` (every rank of
    it): rank 0's metadata, each whole param described by its owner, each file's size."""
    first = manifests[0].frame
    world_size = first.world_size
    if sorted(manifests) != list(range(world_size)):
        raise ValueError(f"a snapshot of {world_size} ranks needs every rank's manifest, got ranks {sorted(manifests)}")
    meta = json.loads(json.dumps(manifests[0].details["zero_meta"]))  # a copy
    files = {}
    for rank, manifest in manifests.items():
        meta["params"].update(manifest.details["records"])
        files[rank_file_name(rank, world_size)] = manifest.frame.part_size("shard")
    if "extras" in first.parts:
        files[EXTRAS_FILE] = first.part_size("extras")
    meta["files"] = files
    return meta


def part_file_name(rank: int, part: str, world_size: int) -> str:
    """The file of a checkpoint's ``zero_optimizer/`` folder that part ``part`` of rank ``rank``'s piece is."""
    return rank_file_name(rank, world_size) if part == "shard" else EXTRAS_FILE


def write_part(zero_dir: str | Path, frame: Frame, part: str, data: bytes | memoryview) -> Path:
    """Write one part of the piece whose frame is ``frame`` (its bytes as ``SnapshotHolder.part``
    returns them) as its checkpoint file. Atomic, so ranks of one node may write the same file."""
    if len(data) != frame.part_size(part):
        raise ValueError(f"part {part!r} of rank {frame.rank}: {len(data)} bytes, expected {frame.part_size(part)}")
    path = Path(zero_dir) / part_file_name(frame.rank, part, frame.world_size)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda f: Path(f).write_bytes(data))
    return path


def write_zero_metadata(zero_dir: str | Path, manifests: Mapping[int, Manifest]) -> Path:
    """Write ``zero_meta.json`` of the snapshot whose manifests are ``manifests`` (every rank's)."""
    path = Path(zero_dir) / META_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda f: Path(f).write_text(json.dumps(zero_metadata(manifests), indent=1)))
    return path
