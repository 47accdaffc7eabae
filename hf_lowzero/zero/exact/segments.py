"""Where each parameter of a bucket lies, for the per-parameter work of exact reduction: in the packed
bucket (every rank's chunk: ``[W, row_numel]`` for row shards, one row for whole params) and in this
rank's reduced chunk. Views are cut per call (the buffers come from a pool), in a few Python steps
per parameter; the work on them runs as multi-tensor (``torch._foreach_*``) kernels. On the CPU
``fixed_point.py``'s C++ kernels take the ``table`` instead and cut no views.

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
    table: torch.Tensor  # [3, params] int64 on the CPU: slots, starts, lengths (for the C++ kernels)

    @staticmethod
    def of(rows: int, slots: list[int], lengths: list[int], device: torch.device | str = "cpu") -> Segments:
        """Params ``slots`` back to back with ``lengths`` columns each, in a buffer of ``rows`` rows (a
        param of no columns is not listed)."""
        starts = [0, *itertools.accumulate(lengths)][:-1]
        kept = [(slot, a, n) for slot, a, n in zip(slots, starts, lengths) if n > 0]
        listed, kept_starts, kept_lengths = (tuple(column) for column in zip(*kept)) if kept else ((), (), ())
        return Segments(
            rows,
            sum(lengths),
            listed,
            kept_starts,
            kept_lengths,
            torch.tensor(listed, dtype=torch.long).to(device),
            torch.tensor([listed, kept_starts, kept_lengths], dtype=torch.long).reshape(3, len(listed)),
        )

    @staticmethod
    def packed(bucket: Bucket) -> Segments:
        """The packed bucket: rank-major ``[W, row_numel]`` for row shards (every param's piece at the
        same columns of every chunk), one row of whole params back to back otherwise."""
        slots = [slot.index for slot in bucket.slots]
        if bucket.whole:
            return Segments.of(1, slots, [slot.shard.numel for slot in bucket.slots], bucket.device)
        lengths = [slot.shard.shard_numel for slot in bucket.slots]
        return Segments.of(len(bucket.chunks), slots, lengths, bucket.device)

    @staticmethod
    def owned(bucket: Bucket, rank: int) -> Segments:
        """This rank's chunk of the bucket: its piece of each param (a row, a whole param, or nothing)."""
        lengths = [slot.shard.piece_numel(rank) for slot in bucket.slots]
        return Segments.of(1, [slot.index for slot in bucket.slots], lengths, bucket.device)

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
