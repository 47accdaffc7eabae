"""The process group as the sharded optimizer sees it, in one record.

Every part that needs the group, this rank, the world size or the params' device takes the one
``ShardGroup`` made at construction, by keyword (``shard=``), as FSDP2's parts take its
``FSDPMeshInfo``. The collectives stay stateless functions (``comm.py``) that are given the group.

Example::

    shard = ShardGroup(group=None, rank=dist.get_rank(), world_size=dist.get_world_size(), device=device)
    master = MasterRows(slots, buckets, offload=False, pin_memory=False, shard=shard)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed import ProcessGroup


@dataclass(frozen=True)
class ShardGroup:
    """The data-parallel group the optimizer shards over, and where this rank stands in it."""

    group: ProcessGroup | None  # None: the default group
    rank: int  # this rank, in ``group``
    world_size: int
    device: torch.device  # the params': streams, events and barriers follow it ([Note: the params' device])
