"""A snapshot's pieces written back as the files of a checkpoint's ``zero_optimizer/`` folder, which
``load_checkpoint`` reads at any world size (the Trainer's own files: ``trainer/snapshot_files.py``).

Example::

    write_part("resume/checkpoint-15/zero_optimizer", manifest, "shard", data)   # at restore
    write_zero_metadata("resume/checkpoint-15/zero_optimizer", manifests)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hf_lowzero.checkpoint.layout import EXTRAS_FILE, META_FILE, rank_file_name
from hf_lowzero.checkpoint.shards import atomic_write


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
