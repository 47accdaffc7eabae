"""Stage 1's latency-bound case: one all-reduce per step brings every rank the whole reduced
gradient and the step's flags, so the step decides without a collective of its own.

Example::

    if replicates(buckets, stage=1, shard=shard, offloaded=False):
        reducer = BucketReducer(..., replicated=True)     # all-reduces its one bucket, trailer included
    totals = reducer.replicated_totals()                  # after the flush: ReplicatedTotals, or None
    stats.decide(reduced, used, stale, summed=totals)     # no all-reduce of its own

# [Note: replicated reduction]
# A ZeRO step synchronizes three times where DDP does once: the gradients' reduce-scatter, the
# all-reduce of [squared norm, stale reads, used flags] ([Note: one host sync per step] in
# ``update/step.py``), and the params' all-gather. On a small model every one of them costs its
# latency, not its bytes: 300 tiny tensors (one 160 KB bucket) at W=2 on gloo stepped 1.10-1.15x
# fused DDP's time, and the flags' all-reduce alone was about a tenth of the step.
#
# Where the model's trainable params fit one bucket of at most REPLICATED_MAX_BYTES, stage 1 (one
# reduction per step: ``no_sync`` accumulates locally) all-reduces that bucket instead, as DDP
# does, with a trailer of this rank's flags appended: [stale reads (0/1), used flag per param].
# Then every rank holds
# - every rank's reduced chunk, bit for bit the same on every rank (a collective's sum reaches all
#   ranks alike), so each computes the squared norm of each chunk, block by block as its owner
#   would (``blocked_squared_norm`` of the rows in fp32), and sums them in rank order: the norm the
#   stats all-reduce would have given, and the same skip decision on every rank;
# - the trailer summed over ranks: whether any rank read stale, and which params any rank used.
# It keeps only its own chunk in the gradient store; the other chunks are dropped after the norm.
# The step then needs no collective before its update, and the all-gather is the second and last
# synchronization. Bytes: the all-reduce sends twice the reduce-scatter's, which under the limit is
# less than a collective's latency (~0.1 ms at 10 GB/s for 1 MiB).
#
# A verify step stays replicated: the checks all-gather their own table, and it comes back to the
# host in the verdict's one copy. Everything else falls back to the stats all-reduce, the same way
# on every rank: a second reduction of the bucket in one step (backward twice without ``no_sync``:
# the norm is the sum's, not the last reduction's), stage 2, offload (the norm is taken before the
# copy to the host), exact reduction, whole-param ownership.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_lowzero.zero.grads.grad_store import GRAD_DTYPE
from hf_lowzero.zero.grads.norm import blocked_squared_norm
from hf_lowzero.zero.layout.buckets import Bucket
from hf_lowzero.zero.runtime import device as dev
from hf_lowzero.zero.runtime.shard_group import ShardGroup

REPLICATED_MAX_BYTES = 1 << 20  # the one bucket's packed bytes, at most ([Note: replicated reduction])
TRAILER_HEAD = 1  # trailer elements before the used flags: [stale reads]


def replicates(buckets: list[Bucket], *, stage: int, shard: ShardGroup, offloaded: bool) -> bool:
    """Whether the reduction of [Note: replicated reduction] applies: stage 1 over 2+ ranks, rows
    in device memory, one bucket of row shards of at most REPLICATED_MAX_BYTES."""
    if stage != 1 or shard.world_size < 2 or offloaded or len(buckets) != 1:
        return False
    (bucket,) = buckets
    return not bucket.whole and bucket.packed_numel * bucket.dtype.itemsize <= REPLICATED_MAX_BYTES


def trailer_numel(slots: int) -> int:
    """Elements appended to the packed bucket for ``slots`` params."""
    return TRAILER_HEAD + slots


class Trailer:
    """This rank's flags, staged in page-locked host memory for ``slots`` params (on a GPU the copy
    to the device does not wait; ``StepStats`` stages its flags the same way)."""

    def __init__(self, slots: int, dtype: torch.dtype, device: torch.device) -> None:
        self.host = dev.host_buffer(trailer_numel(slots), dtype, device)
        self._copied = None  # the event after the latest copy out of ``host`` (GPU)

    def write(self, out: torch.Tensor, used: torch.Tensor, stale: bool) -> None:
        """The flags into ``out`` (``trailer_numel`` elements, the bucket's dtype and device):
        whether this rank read any param stale, and each param's used flag (``used``: bool per
        slot, host)."""
        dev.host_waits(self._copied)  # a second reduction in a step: the first copy has read ``host``
        self.host[0] = float(stale)
        self.host[TRAILER_HEAD:].copy_(used)
        out.copy_(self.host, non_blocking=dev.is_cuda(out.device))
        self._copied = dev.record_event(dev.current_stream(out.device))


@dataclass(frozen=True)
class ReplicatedTotals:
    """What the replicated all-reduce brought back: every rank's reduced chunk (``chunks``, rank
    order, the bucket's dtype) and the trailer summed over ranks."""

    chunks: tuple[torch.Tensor, ...]
    trailer: torch.Tensor

    def stats(self) -> torch.Tensor:
        """[squared norm, stale reads, used flags...] summed over ranks, as the stats all-reduce
        gives them (float64, on the chunks' device): the norm in rank order of chunks."""
        squares = [blocked_squared_norm([chunk.to(GRAD_DTYPE)]).reshape(1) for chunk in self.chunks]
        total = squares[0]
        for square in squares[1:]:
            total = total + square
        return torch.cat([total.to(self.trailer.device), self.trailer.double()])

    def rows(self) -> list[torch.Tensor]:
        """Every rank's chunk in fp32 (the float64 norm's input, when the blocked one is not finite)."""
        return [chunk.to(GRAD_DTYPE) for chunk in self.chunks]
