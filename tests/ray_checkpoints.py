"""What the Ray tests check about the checkpoints a run left in storage: which Trainer checkpoint a
Ray checkpoint folder holds, and which of the files a complete one needs are missing."""

from __future__ import annotations

import json
from pathlib import Path

from hf_lowzero.checkpoint.layout import META_FILE, TRAINER_SUBDIR

TRAINER_FILES = ("model.safetensors", "trainer_state.json", "scheduler.pt")


def trainer_checkpoint(ray_checkpoint_dir: str | Path) -> Path:
    """The ``checkpoint-N`` folder inside a Ray checkpoint folder."""
    (found,) = Path(ray_checkpoint_dir).glob("checkpoint-*")
    return found


def step_of(ray_checkpoint_dir: str | Path) -> int:
    return int(trainer_checkpoint(ray_checkpoint_dir).name.split("-")[1])


def saved_world_size(ray_checkpoint_dir: str | Path) -> int:
    """How many ranks saved it: its ZeRO metadata's world size."""
    meta = trainer_checkpoint(ray_checkpoint_dir) / TRAINER_SUBDIR / META_FILE
    return json.loads(meta.read_text())["world_size"]


def missing_files(ray_checkpoint_dir: str | Path) -> list[str]:
    """Files a complete checkpoint holds that this one lacks, or holds with another size than its
    ZeRO metadata records: every rank's shard and RNG state, and rank 0's Trainer files."""
    ckpt = trainer_checkpoint(ray_checkpoint_dir)
    meta_path = ckpt / TRAINER_SUBDIR / META_FILE
    if not meta_path.is_file():
        return [str(meta_path.relative_to(ckpt))]
    meta = json.loads(meta_path.read_text())
    world = meta["world_size"]
    expected = {f"{TRAINER_SUBDIR}/{name}": size for name, size in meta["files"].items()}
    rng_files = [f"rng_state_{r}.pth" for r in range(world)] if world > 1 else ["rng_state.pth"]
    expected |= {name: None for name in (*TRAINER_FILES, *rng_files)}
    return sorted(
        name
        for name, size in expected.items()
        if not (ckpt / name).is_file() or (size is not None and (ckpt / name).stat().st_size != size)
    )
