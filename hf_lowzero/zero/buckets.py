"""The static bucket plan, flat rank-major bucket layout, and plan-order launching.

A bucket is a fixed group of parameters whose gradients travel in one collective. Its packed flat
buffer is rank-major: chunk ``r`` holds rank ``r``'s piece of every parameter in the bucket, back to
back (``[g0_r0, g1_r0, ..., g0_r1, g1_r1, ...]``), so one reduce-scatter (or exchange) hands every
rank exactly its pieces. With row shards every chunk has the same length (``[W, row_numel]``); with
whole-parameter ownership the bucket's params are ordered by owner, so chunk ``r`` is the owned
params of rank ``r`` whole, and chunks differ in length (``Bucket.chunks``).

The pieces a rank owns are laid out bucket after bucket in one flat "owned rows" space
(``Bucket.row_offset``); the optimizer's fp32 master rows and the gradient rows use it.

# [Note: bucket order]
# Buckets are planned once, identically on every rank, and launched strictly in plan order:
# bucket k starts only after buckets 0..k-1 started. Ranks may finish parameters in different
# orders (layer drop, branches, MoE), but every rank issues the same collectives in the same
# sequence, so they always match and never hang. At the end of backward, every bucket that has
# not started is launched (in order) with zeros standing in for gradients this rank did not make.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum, auto

import torch

from hf_lowzero.zero.params import ParamSlot


class BucketState(Enum):
    WAITING = auto()  # collecting this backward's gradients
    REDUCING = auto()  # collective launched, not yet waited
    REDUCED = auto()  # result in place (stage 1: bucket buffer; stage 2: gradient rows)


@dataclass(eq=False)
class Bucket:
    index: int
    dtype: torch.dtype  # of the params (all params of a bucket share dtype and device)
    device: torch.device
    slots: list[ParamSlot] = field(default_factory=list)
    chunks: list[int] = field(default_factory=list)  # per rank: elements of its chunk (its pieces)
    packed_numel: int = 0  # elements of the packed bucket: sum(chunks)
    row_numel: int = 0  # this rank's chunk: chunks[rank]
    row_offset: int = 0
    state: BucketState = BucketState.WAITING
    pending: int = 0  # params whose gradient has not arrived in this backward
    has_grads: bool = False  # holds reduced gradients since the last step (accumulation)
    work: object = None  # async handle while REDUCING
    scratch: tuple = ()  # tensors a collective in flight writes to or reads from

    @property
    def whole(self) -> bool:
        """Its params are owned whole (chunks of any lengths), not in rows (chunks all equal)."""
        return self.slots[0].shard.whole

    @property
    def is_complete(self) -> bool:
        return self.pending == 0

    def expect_all(self) -> None:
        """A new backward: every param's gradient is outstanding."""
        self.pending = len(self.slots)

    def transition(self, old: BucketState, new: BucketState) -> None:
        assert self.state is old, f"bucket {self.index}: expected state {old}, found {self.state}"
        self.state = new


def plan_buckets(
    slots: list[ParamSlot], bucket_bytes: int, comm_dtype: torch.dtype | None, rank: int = 0
) -> list[Bucket]:
    """Assign params to buckets in reverse registration order (which approximates backward order).

    A bucket closes when the next param would push it past ``bucket_bytes`` (padded, in the
    communication dtype) or has another dtype/device; a param bigger than a bucket gets its own.
    Within a bucket of whole-owned params, params are ordered by owner (stable), so each rank's
    chunk is contiguous. Fills in every slot's ``bucket_index``, ``bucket_offset``, ``row_offset``
    and ``row_numel`` for ``rank``; the plan itself is the same on every rank.
    """
    buckets: list[Bucket] = []
    for slot in reversed(slots):
        p = slot.param
        itemsize = (comm_dtype or p.dtype).itemsize
        last = buckets[-1] if buckets else None
        if (
            last is None
            or last.dtype != p.dtype
            or last.device != p.device
            or ((last.packed_numel + slot.shard.padded_numel) * itemsize > bucket_bytes)
        ):
            last = Bucket(index=len(buckets), dtype=p.dtype, device=p.device)
            buckets.append(last)
        last.slots.append(slot)
        last.packed_numel += slot.shard.padded_numel
    row_offset = 0
    for bucket in buckets:
        bucket.slots.sort(key=lambda s: s.shard.owner or 0)  # stable; a no-op for row shards
        world_size = bucket.slots[0].shard.world_size
        bucket.chunks = [sum(s.shard.piece_numel(r) for s in bucket.slots) for r in range(world_size)]
        bucket.row_numel = bucket.chunks[rank]
        bucket.row_offset = row_offset
        for slot in bucket.slots:
            slot.bucket_index = bucket.index
            slot.row_numel = slot.shard.piece_numel(rank)
            slot.bucket_offset = row_offset - bucket.row_offset
            slot.row_offset = row_offset
            row_offset += slot.row_numel
    return buckets


class PlanOrderLauncher:
    """Launches buckets strictly in plan order (see [Note: bucket order]) with bounded in-flight work.

    ``launch(bucket)`` starts a bucket's collective and ``finish(bucket)`` waits for it and
    consumes the result; both come from the stage policy. At most ``max_in_flight`` buckets are
    REDUCING at once, which bounds the memory of transient bucket buffers.
    """

    def __init__(
        self,
        buckets: list[Bucket],
        launch: Callable[[Bucket], None],
        finish: Callable[[Bucket], None],
        max_in_flight: int = 2,
    ) -> None:
        self.buckets = buckets
        self._launch = launch
        self._finish = finish
        self.max_in_flight = max_in_flight
        self.next_bucket = 0  # plan position of the next bucket to launch in this backward
        self.in_flight: deque[Bucket] = deque()
        for bucket in buckets:
            bucket.expect_all()

    def mark_ready(self, slot: ParamSlot) -> None:
        self.buckets[slot.bucket_index].pending -= 1

    def launch_ready(self) -> None:
        """Launch, in plan order, every leading bucket whose params are all ready."""
        while self.next_bucket < len(self.buckets) and self.buckets[self.next_bucket].is_complete:
            self._launch_next()

    def launch_all(self, overlap: bool) -> None:
        """End of backward: launch every remaining bucket in plan order, then wait for all."""
        while self.next_bucket < len(self.buckets):
            self._launch_next()
            if not overlap:
                self.wait_all()
        self.wait_all()
        self.next_bucket = 0
        for bucket in self.buckets:
            bucket.expect_all()
            bucket.transition(BucketState.REDUCED, BucketState.WAITING)

    def wait_all(self) -> None:
        while self.in_flight:
            self._finish_oldest()

    @property
    def mid_backward(self) -> bool:
        """Some bucket of the current backward is ready or launched but the flush has not run."""
        return self.next_bucket > 0 or any(bucket.pending != len(bucket.slots) for bucket in self.buckets)

    def reset(self) -> None:
        """Forget a backward that never finished (it raised): wait for the collectives it started,
        so that no buffer is reused while a peer still writes to it, and return every bucket to
        WAITING. The caller discards the gradients (see [Note: failed backward])."""
        self.wait_all()
        self.next_bucket = 0
        for bucket in self.buckets:
            bucket.expect_all()
            bucket.state = BucketState.WAITING

    def _launch_next(self) -> None:
        bucket = self.buckets[self.next_bucket]
        while len(self.in_flight) >= self.max_in_flight:
            self._finish_oldest()
        bucket.transition(BucketState.WAITING, BucketState.REDUCING)
        self._launch(bucket)
        self.in_flight.append(bucket)
        self.next_bucket += 1

    def _finish_oldest(self) -> None:
        bucket = self.in_flight.popleft()
        self._finish(bucket)
        bucket.transition(BucketState.REDUCING, BucketState.REDUCED)
