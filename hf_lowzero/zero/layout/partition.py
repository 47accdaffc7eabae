"""How each parameter's elements are divided among ranks: pure functions, no communication.

Two ways to own a parameter (``ZeroConfig.partition``; see [Note: two ways to own a parameter]):

- rows: a parameter of numel ``n`` is padded to ``padded_numel`` (a multiple of the world size
  ``W``) and viewed as ``[W, shard_numel]``; rank ``r`` owns row ``r``. Elements past ``n`` in the
  last rows are padding and are always zero.
- whole: one rank, the ``owner``, holds every element; the others hold none.

A rank's *piece* of a parameter is what it owns, padding included: a row, the whole tensor, or
nothing.

Example::

    >>> shard = ParamShard(numel=10, world_size=4)
    >>> shard.padded_numel, shard.shard_numel
    (12, 3)
    >>> shard.owned_range(3)   # rank 3 owns flat elements [9, 10) plus two padding slots
    (9, 10)
    >>> whole = ParamShard(numel=10, world_size=4, owner=2)
    >>> whole.piece_numel(2), whole.piece_numel(0), whole.owned_range(2)
    (10, 0, (0, 10))
    >>> assign_owners([6, 5, 4, 3], world_size=2)   # largest first, to the least-loaded rank
    [0, 1, 1, 0]

# [Note: two ways to own a parameter]
# Row shards give every rank exactly 1/W of every tensor: perfect balance and the plain
# reduce-scatter/all-gather, but an optimizer then sees slices, so only optimizers that update each
# element from that element alone are exact on them (AdamW, SGD, ...). Whole-parameter ownership
# gives each tensor to one rank, which runs the unmodified optimizer on the whole tensor: the result
# is the unsharded optimizer's by construction, whatever it computes (factored moments, 8-bit
# block-wise states, orthogonalization). Owners are assigned once, largest tensor first to the rank
# holding the fewest elements so far (the same plan on every rank), so each rank holds about 1/W of
# the state unless one tensor is larger than that. Each gradient travels only to its owner and each
# updated tensor only from it: per step every rank sends, summed over ranks, the same bytes as with
# row shards.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def padded_numel(numel: int, *, world_size: int) -> int:
    """``numel`` rounded up to a multiple of ``world_size``."""
    return -(-numel // world_size) * world_size


def assign_owners(numels: list[int], *, world_size: int) -> list[int]:
    """One owner per tensor: largest first (ties by position), each to the rank holding the fewest
    elements so far (ties to the lowest rank). Deterministic: every rank computes the same plan."""
    load = [0] * world_size
    owners = [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owners[i] = rank
        load[rank] += numels[i]
    return owners


@dataclass(frozen=True)
class ParamShard:
    """How one flattened parameter of ``numel`` elements splits over ``world_size`` ranks: in rows
    (``owner`` None) or whole to ``owner``."""

    numel: int
    world_size: int = field(kw_only=True)
    owner: int | None = field(default=None, kw_only=True)
    padded_numel: int = field(init=False)
    shard_numel: int = field(init=False)  # rows: length of every rank's row, padding included
    padding: int = field(init=False)

    def __post_init__(self) -> None:
        if self.numel <= 0 or self.world_size <= 0:
            raise ValueError(f"numel and world_size must be positive, got {self.numel}, {self.world_size}")
        if self.owner is not None and not 0 <= self.owner < self.world_size:
            raise ValueError(f"owner {self.owner} is not a rank of a world of size {self.world_size}")
        # Fixed per parameter and read on every step: computed once.
        padded = self.numel if self.whole else padded_numel(self.numel, world_size=self.world_size)
        object.__setattr__(self, "padded_numel", padded)
        object.__setattr__(self, "shard_numel", self.numel if self.whole else padded // self.world_size)
        object.__setattr__(self, "padding", padded - self.numel)

    @property
    def whole(self) -> bool:
        """Owned whole by one rank (not in rows)."""
        return self.owner is not None

    def piece_numel(self, rank: int) -> int:
        """Elements ``rank`` holds, padding included: its row, the whole tensor, or 0."""
        if self.whole:
            return self.numel if rank == self.owner else 0
        return self.shard_numel

    def owned_range(self, rank: int) -> tuple[int, int]:
        """``[start, end)`` of the real (unpadded) flat elements ``rank`` holds; may be empty."""
        if self.whole:
            return (0, self.numel) if rank == self.owner else (0, 0)
        start = min(rank * self.shard_numel, self.numel)
        end = min(start + self.shard_numel, self.numel)
        return start, end

    def row_of(self, tensor: torch.Tensor, rank: int) -> torch.Tensor:
        """``rank``'s piece of a tensor shaped like the parameter: 1D, ``piece_numel`` long, zero padding."""
        if self.whole:
            flat = tensor.detach().reshape(-1)
            return flat.clone() if rank == self.owner else flat[:0].clone()
        flat = torch.nn.functional.pad(tensor.detach().reshape(-1), (0, self.padding))
        return flat.view(self.world_size, self.shard_numel)[rank].clone()

    def owned_numel(self, rank: int) -> int:
        start, end = self.owned_range(rank)
        return end - start
