"""The checksums of exact reductions (``reduction="exact"``): int64 sums of a bucket's segments,
compared without tolerance ([Note: exact checksums]).

Example::

    local, own = exact_plans(bucket, shard=shard)
    weights = hash_weights(device)                  # the replica hashes' weights, the same on every rank
    sent = local.checksums(quantized, weights)      # [W * m, 2] int64: per destination and param
    got = own.checksums(reduced_rows, weights)      # [m, 2] int64: this rank's rows, per param

# [Note: exact checksums]
# An exact reduction sums int64 values ([Note: exact reduction] in zero/exact/__init__.py); its
# checksums are int64 sums too, wrapping modulo 2^64. That arithmetic is a ring: a sum is the same in
# any order, and a linear checksum of the reduced rows equals the sum of the ranks' checksums of what
# they sent, exactly, overflow or not (the reduction wraps alike). So any difference is an error:
# there is no float bound and no probability of a false alarm.
# Per segment (a parameter's piece for one destination rank) two checksums, those of the replica
# hashes (``checksums.tensor_hash``) on the segment's int64 values: their sum, and their sum weighted
# by position (modulo HASH_WIDTH, fixed random weights). The first changes with every element changed
# alone, by any amount: +1 in the last bit shows. The second shows what cancels in the first (one
# element up, another down by as much; two elements swapped), unless the change times the weights'
# difference is a multiple of 2^64.
# The residual against each rank's checksums names a dropped contribution (-its checksums) or a doubled
# one (+its checksums) exactly; one no rank explains is corruption of the owner's rows.
# What the checksums cannot see: a wrong conversion to int64 that happened before them (the values sent
# are what is summed), and the accumulator over micro-batches after them. Non-finite gradients are
# named by the step's skip (``ExactStepStats``), not here: int64 holds no NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_lowzero.zero.integrity.checksums import _finish, _fold
from hf_lowzero.zero.layout.buckets import Bucket
from hf_lowzero.zero.runtime.shard_group import ShardGroup

PROBES = 2  # checksums per segment: the plain sum and the weighted one


@dataclass(frozen=True, eq=False)
class SumPlan:
    """Where the segments of a 1D int64 buffer lie, viewed as ``[rows, cols]`` (a packed bucket of row
    shards: one row per destination rank; otherwise one row): per segment its first column, length and
    output slot for row 0; row ``r``'s slot is that plus ``r * row_slots``. ``slots``: outputs in all
    (empty segments stay zero)."""

    rows: int
    cols: int
    segments: tuple[tuple[int, int, int], ...]
    row_slots: int
    slots: int

    def checksums(self, values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``[slots, PROBES]`` int64 on ``values``' device ([Note: exact checksums]); no host sync.
        ``values``: the 1D int64 buffer; ``weights``: ``checksums.hash_weights`` on its device."""
        view = values.view(self.rows, self.cols)
        out = torch.zeros(self.slots, PROBES, dtype=torch.int64, device=values.device)
        for start, length, slot in self.segments:
            sums = _finish(_fold(view[:, start : start + length]), weights)  # [rows, 2]
            if self.rows == 1:
                out[slot] = sums[0]
            else:
                out[slot : slot + self.rows * self.row_slots : self.row_slots] = sums
        return out


def exact_plans(bucket: Bucket, *, shard: ShardGroup) -> tuple[SumPlan, SumPlan]:
    """The plans of a bucket's two sides, as ``checksums.bucket_plans`` lays them out: the packed
    bucket (outputs per destination rank and param, ``[W * m]``) and this rank's reduced chunk
    (outputs per param, ``[m]``)."""
    m, world_size = len(bucket.slots), shard.world_size
    if bucket.whole:  # chunk after chunk, each param whole in its owner's chunk (packing order)
        pieces = [(s.shard.numel, s.shard.owner * m + j) for j, s in enumerate(bucket.slots)]
        local = _plan(1, bucket.packed_numel, pieces, row_slots=0, slots=world_size * m)
    else:  # [W, row_numel]: every chunk holds every param's piece at the same columns
        pieces = [(s.shard.shard_numel, j) for j, s in enumerate(bucket.slots)]
        local = _plan(world_size, bucket.row_numel, pieces, row_slots=m, slots=world_size * m)
    own = [(s.shard.piece_numel(shard.rank), j) for j, s in enumerate(bucket.slots)]
    return local, _plan(1, bucket.chunks[shard.rank], own, row_slots=0, slots=m)


def _plan(rows: int, cols: int, pieces: list[tuple[int, int]], *, row_slots: int, slots: int) -> SumPlan:
    """``pieces``: (length, slot of row 0) in column order, tiling ``[0, cols)``."""
    segments, start = [], 0
    for length, slot in pieces:
        if length > 0:
            segments.append((start, length, slot))
        start += length
    if start != cols:
        raise ValueError(f"the segments cover {start} columns of a buffer of {cols}: the bucket's layout changed")
    return SumPlan(rows, cols, tuple(segments), row_slots, slots)
