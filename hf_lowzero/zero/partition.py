"""Pad/split math for one parameter: pure functions, no communication.

Every trainable parameter of numel ``n`` is padded to ``padded_numel`` (a multiple of the world
size ``W``) and viewed as ``[W, shard_numel]``; rank ``r`` owns row ``r``. Elements past ``n`` in the
last rows are padding and are always zero.

Example::

    >>> shard = ParamShard(numel=10, world_size=4)
    >>> shard.padded_numel, shard.shard_numel
    (12, 3)
    >>> shard.owned_range(3)   # rank 3 owns flat elements [9, 10) plus two padding slots
    (9, 10)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def padded_numel(numel: int, world_size: int) -> int:
    """``numel`` rounded up to a multiple of ``world_size``."""
    return -(-numel // world_size) * world_size


@dataclass(frozen=True)
class ParamShard:
    """How one flattened parameter of ``numel`` elements splits over ``world_size`` ranks."""

    numel: int
    world_size: int
    padded_numel: int = field(init=False)
    shard_numel: int = field(init=False)  # length of every rank's row, padding included
    padding: int = field(init=False)

    def __post_init__(self) -> None:
        if self.numel <= 0 or self.world_size <= 0:
            raise ValueError(f"numel and world_size must be positive, got {self.numel}, {self.world_size}")
        # Fixed per parameter and read on every step: computed once.
        padded = padded_numel(self.numel, self.world_size)
        object.__setattr__(self, "padded_numel", padded)
        object.__setattr__(self, "shard_numel", padded // self.world_size)
        object.__setattr__(self, "padding", padded - self.numel)

    def owned_range(self, rank: int) -> tuple[int, int]:
        """``[start, end)`` of the real (unpadded) flat elements in ``rank``'s row; may be empty."""
        start = min(rank * self.shard_numel, self.numel)
        end = min(start + self.shard_numel, self.numel)
        return start, end

    def row_of(self, tensor: torch.Tensor, rank: int) -> torch.Tensor:
        """``rank``'s row of a tensor shaped like the parameter: 1D, ``shard_numel`` long, zero padding."""
        flat = torch.nn.functional.pad(tensor.detach().reshape(-1), (0, self.padding))
        return flat.view(self.world_size, self.shard_numel)[rank].clone()

    def owned_numel(self, rank: int) -> int:
        start, end = self.owned_range(rank)
        return end - start
