"""Where every file of a checkpoint lives and which rank owns it: the one place for these rules.

A sharded optimizer checkpoint directory (``hf_lowzero.save_checkpoint``)::

    zero_meta.json                               format, world size, shapes, groups, scaler (last)
    zero_model_extras.safetensors                frozen params and persistent buffers (rank 0)
    zero_shard_rank00000_of_00002.safetensors    rank 0's rows of master weights and state
    zero_shard_rank00001_of_00002.safetensors    rank 1's rows

Inside a Trainer ``checkpoint-N/`` folder that directory is ``zero_optimizer/``, next to the
Trainer's own files (model weights, ``trainer_state.json``, ``scheduler.pt``, ``rng_state_<rank>.pth``).

Example::

    >>> rank_file_name(1, 2)
    'zero_shard_rank00001_of_00002.safetensors'
    >>> owner_rank("checkpoint-10/zero_optimizer/zero_shard_rank00001_of_00002.safetensors")
    1
    >>> owner_rank("checkpoint-10/trainer_state.json")
    0
"""

from __future__ import annotations

import re
from pathlib import PurePath

FORMAT_VERSION = 1
META_FILE = "zero_meta.json"
EXTRAS_FILE = "zero_model_extras.safetensors"
TRAINER_SUBDIR = "zero_optimizer"  # the sharded optimizer inside a Trainer checkpoint-N folder
PARTIAL_SUFFIX = ".partial"  # a save in progress (see [Note: atomic save])

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
