"""Where each parameter of a bucket lies, for the per-parameter work of exact reduction: in the packed
bucket (every rank's chunk: ``[W, row_numel]`` for row shards, one row for whole params) and in this
rank's reduced chunk. Views are cut per call (the buffers come from a pool), in a few Python steps
per parameter; the work on them runs as multi-tensor (``torch._foreach_*``) kernels.

Example::

    packed, owned = Segments.packed(bucket), Segments.owned(bucket, rank)
    views = packed.views(flat)          # one view per param of the bucket: its columns of every chunk
    maxima = packed.max_abs(flat)       # [params] largest |value| per param
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from hf_lowzero.zero.layout.buckets import Bucket


@dataclass(frozen=True, eq=False)
class Segments:
    """Columns ``[starts[i], starts[i] + lengths[i])`` of a buffer viewed ``[rows, cols]`` belong to
    the param of slot ``slots[i]`` (only params with elements there are listed)."""

    rows: int
    cols: int
    slots: tuple[int, ...]
    starts: tuple[int, ...]
    lengths: tuple[int, ...]
    index: torch.Tensor  # ``slots`` as a tensor on the bucket's device

    @staticmethod
    def _build(bucket: Bucket, rows: int, lengths: list[int]) -> Segments:
        starts = [0, *itertools.accumulate(lengths)][:-1]
        kept = [(slot.index, a, n) for slot, a, n in zip(bucket.slots, starts, lengths) if n > 0]
        slots = tuple(k[0] for k in kept)
        return Segments(
            rows,
            sum(lengths),
            slots,
            tuple(k[1] for k in kept),
            tuple(k[2] for k in kept),
            torch.tensor(slots, dtype=torch.long).to(bucket.device),
        )

    @staticmethod
    def packed(bucket: Bucket) -> Segments:
        """The packed bucket: rank-major ``[W, row_numel]`` for row shards (every param's piece at the
        same columns of every chunk), one row of whole params back to back otherwise."""
        if bucket.whole:
            return Segments._build(bucket, 1, [slot.shard.numel for slot in bucket.slots])
        world_size = len(bucket.chunks)
        return Segments._build(bucket, world_size, [slot.shard.shard_numel for slot in bucket.slots])

    @staticmethod
    def owned(bucket: Bucket, rank: int) -> Segments:
        """This rank's chunk of the bucket: its piece of each param (a row, a whole param, or nothing)."""
        return Segments._build(bucket, 1, [slot.shard.piece_numel(rank) for slot in bucket.slots])

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """One view of ``flat`` (1D, ``rows * cols``) per listed param."""
        if self.rows == 1:
            return [flat[a : a + n] for a, n in zip(self.starts, self.lengths)]
        grid = flat.view(self.rows, self.cols)
        return [grid[:, a : a + n] for a, n in zip(self.starts, self.lengths)]

    def max_abs(self, flat: torch.Tensor) -> torch.Tensor:
        """``[params]``: each listed param's largest |value| in ``flat`` (NaN where it holds a NaN).
        From each view's min and max: no temporary. Measured on the CPU with torch 2.13, for GPT-2
        4x256: an inf-norm took 2-3x as long; ``aminmax`` reads a 1D view once (1.0 ms against 1.3 for
        ``amin`` and ``amax``) but copies a 2D one first (4.0 ms against 2.4)."""
        views = self.views(flat)
        if not views:
            return torch.zeros(0, dtype=flat.dtype, device=flat.device)
        if self.rows == 1:
            lows, highs = zip(*(torch.aminmax(v) for v in views))
        else:
            lows, highs = [v.amin() for v in views], [v.amax() for v in views]
        return torch.maximum(torch.stack(highs), torch.stack(lows).neg())

    def sums(self, flat: torch.Tensor) -> torch.Tensor:
        """``[params]``: each listed param's sum of |value| in ``flat``."""
        views = self.views(flat)
        if not views:
            return torch.zeros(0, dtype=flat.dtype, device=flat.device)
        return torch.stack(torch._foreach_norm(views, 1))

    def scale(self, flat: torch.Tensor, factors: list[float]) -> None:
        """Multiply each listed param's values in ``flat`` by its factor (one per listed param), in place."""
        if self.slots:
            torch._foreach_mul_(self.views(flat), factors)
