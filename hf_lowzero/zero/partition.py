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

from dataclasses import dataclass

import torch


def padded_numel(numel: int, world_size: int) -> int:
    """``numel`` rounded up to a multiple of ``world_size``."""
    return -(-numel // world_size) * world_size


@dataclass(frozen=True)
class ParamShard:
    """How one flattened parameter of ``numel`` elements splits over ``world_size`` ranks."""

    numel: int
    world_size: int

    def __post_init__(self) -> None:
        if self.numel <= 0 or self.world_size <= 0:
            raise ValueError(f"numel and world_size must be positive, got {self.numel}, {self.world_size}")

    @property
    def padded_numel(self) -> int:
        return padded_numel(self.numel, self.world_size)

    @property
    def shard_numel(self) -> int:
        """Length of every rank's row, padding included."""
        return self.padded_numel // self.world_size

    @property
    def padding(self) -> int:
        return self.padded_numel - self.numel

    def owned_range(self, rank: int) -> tuple[int, int]:
        """``[start, end)`` of the real (unpadded) flat elements in ``rank``'s row; may be empty."""
        start = min(rank * self.shard_numel, self.numel)
        end = min(start + self.shard_numel, self.numel)
        return start, end

    def owned_numel(self, rank: int) -> int:
        start, end = self.owned_range(rank)
        return end - start

    # [Note: padded copies]
    # The row-major ``[W, shard_numel]`` view of a parameter is split into full rows and one
    # partial row; copying those two pieces avoids materializing a padded copy of the parameter.
    # The padding slots of the destination are zeroed on copy, so sums over ranks stay exact.

    def scatter_into(self, rows: torch.Tensor, flat: torch.Tensor | None) -> None:
        """Write ``flat`` (1D, ``numel``) into ``rows`` (``[W, shard_numel]``, may be a strided view).

        ``flat=None`` means a zero contribution. The padding slots are zeroed.
        """
        if flat is None:
            rows.zero_()
            return
        full_rows, rem = divmod(self.numel, self.shard_numel)
        split = full_rows * self.shard_numel
        if full_rows:
            rows[:full_rows].copy_(flat[:split].view(full_rows, self.shard_numel))
        if rem:
            rows[full_rows, :rem].copy_(flat[split:])
        if self.padding:
            rows[full_rows, rem:].zero_()
            rows[full_rows + 1 :].zero_()

    def gather_from(self, rows: torch.Tensor, flat: torch.Tensor) -> None:
        """Inverse of :meth:`scatter_into`: copy the real elements of ``rows`` into ``flat``."""
        full_rows, rem = divmod(self.numel, self.shard_numel)
        split = full_rows * self.shard_numel
        if full_rows:
            flat[:split].view(full_rows, self.shard_numel).copy_(rows[:full_rows])
        if rem:
            flat[split:].copy_(rows[full_rows, :rem])
