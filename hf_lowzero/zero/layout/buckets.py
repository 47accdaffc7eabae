"""The static bucket plan, flat rank-major bucket layout, and plan-order launching.

A bucket is a fixed group of parameters whose gradients travel in one collective. Its packed flat
buffer is rank-major: chunk ``r`` holds rank ``r``'s piece of every parameter in the bucket, back to
back (``[g0_r0, g1_r0, ..., g0_r1, g1_r1, ...]``), so one reduce-scatter (or exchange) hands every
rank exactly its pieces. With row shards every chunk has the same length (``[W, row_numel]``); with
whole-parameter ownership the bucket's params are ordered by owner, so chunk ``r`` is the owned
params of rank ``r`` whole, and chunks differ in length (``Bucket.chunks``).

The pieces a rank owns are laid out bucket after bucket in one flat "owned space"
(``Bucket.row_offset``); the optimizer's fp32 master rows and the gradient store use it
(``packing.py`` holds the packing, unpacking and views).

The plan is frozen once made. What changes during a backward lives elsewhere, each piece in one
owner: the next bucket to launch and each bucket's phase in the ``PlanOrderLauncher``; whether a
bucket's gradients are complete in ``BackwardSync`` (``grads/backward.py``); each collective in flight
in a typed record (``Reduction`` here, ``Gather`` in ``update/allgather.py``) held by whoever waits for it,
as FSDP2 keeps its ``AllGatherState`` and ``ReduceScatterState``; whether a bucket holds reduced
gradients since the last step in the ``BucketReducer``.

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
from dataclasses import dataclass
from enum import Enum, auto

import torch

from hf_lowzero.zero.layout.params import ParamSlot


class BucketState(Enum):
    WAITING = auto()  # collecting this backward's gradients
    REDUCING = auto()  # collective launched, not yet waited
    REDUCED = auto()  # result in the gradient store


@dataclass(frozen=True, eq=False)
class Bucket:
    """One bucket of the static plan: which params, in which layout; nothing that changes."""

    index: int
    dtype: torch.dtype  # of the params (all params of a bucket share dtype and device)
    device: torch.device
    slots: tuple[ParamSlot, ...]  # in packing order (whole params: by owner)
    chunks: tuple[int, ...]  # per rank: elements of its chunk (its pieces)
    packed_numel: int  # elements of the packed bucket: sum(chunks)
    row_numel: int  # this rank's chunk: chunks[rank]
    row_offset: int  # where this rank's chunk starts in the owned space

    @property
    def whole(self) -> bool:
        """Its params are owned whole (chunks of any lengths), not in rows (chunks all equal)."""
        return self.slots[0].shard.whole


@dataclass(frozen=True, eq=False)
class Reduction:
    """A bucket's reduction in flight: what to wait for and what it writes to, until ``finish``."""

    bucket: Bucket
    work: object  # async handle, or None (world size 1: nothing to wait for)
    out: torch.Tensor  # this rank's reduced chunk lands here
    buffers: tuple[torch.Tensor, ...]  # pooled scratch the collective reads or writes


def plan_buckets(
    slots: list[ParamSlot], bucket_bytes: int, comm_dtype: torch.dtype | None, *, rank: int = 0
) -> list[Bucket]:
    """Assign params to buckets in reverse registration order (which approximates backward order).

    A bucket closes when the next param would push it past ``bucket_bytes`` (padded, in the
    communication dtype) or has another dtype/device; a param bigger than a bucket gets its own.
    Within a bucket of whole-owned params, params are ordered by owner (stable), so each rank's
    chunk is contiguous. Fills in every slot's ``bucket_index``, ``row_offset`` and ``row_numel``
    for ``rank``; the plan itself is the same on every rank.
    """
    groups: list[list[ParamSlot]] = []
    packed = 0
    for slot in reversed(slots):
        p, last = slot.param, groups[-1][-1].param if groups else None
        itemsize = (comm_dtype or p.dtype).itemsize
        if (
            last is None
            or last.dtype != p.dtype
            or last.device != p.device
            or ((packed + slot.shard.padded_numel) * itemsize > bucket_bytes)
        ):
            groups.append([])
            packed = 0
        groups[-1].append(slot)
        packed += slot.shard.padded_numel
    buckets, row_offset = [], 0
    for index, members in enumerate(groups):
        members.sort(key=lambda s: s.shard.owner or 0)  # stable; a no-op for row shards
        world_size = members[0].shard.world_size
        chunks = tuple(sum(s.shard.piece_numel(r) for s in members) for r in range(world_size))
        bucket = Bucket(
            index=index,
            dtype=members[0].param.dtype,
            device=members[0].param.device,
            slots=tuple(members),
            chunks=chunks,
            packed_numel=sum(s.shard.padded_numel for s in members),
            row_numel=chunks[rank],
            row_offset=row_offset,
        )
        for slot in members:
            slot.bucket_index = index
            slot.row_numel = slot.shard.piece_numel(rank)
            slot.row_offset = row_offset
            row_offset += slot.row_numel
        buckets.append(bucket)
    return buckets


class PlanOrderLauncher:
    """Launches buckets strictly in plan order (see [Note: bucket order]) with bounded in-flight work.

    Owns the per-backward progress: the next bucket to launch and each bucket's phase. Whether a
    bucket's gradients are complete is the caller's question (``launch_ready``'s ``complete``).
    ``launch(bucket)`` starts a bucket's collective and returns its ``Reduction``;
    ``finish(reduction)`` waits for it and consumes the result. At most ``max_in_flight`` buckets
    are REDUCING at once, which bounds the memory of transient bucket buffers.
    """

    def __init__(
        self,
        buckets: list[Bucket],
        launch: Callable[[Bucket], Reduction],
        finish: Callable[[Reduction], None],
        max_in_flight: int = 2,
    ) -> None:
        self.buckets = buckets
        self._launch = launch
        self._finish = finish
        self.max_in_flight = max_in_flight
        self.next_bucket = 0  # plan position of the next bucket to launch in this backward
        self.in_flight: deque[Reduction] = deque()
        self.phase = [BucketState.WAITING] * len(buckets)

    def launch_ready(self, upto: int, complete: Callable[[int], bool]) -> None:
        """Launch, in plan order, every leading bucket up to plan position ``upto`` for which
        ``complete(index)`` holds; stop at the first that does not."""
        while self.next_bucket <= upto and complete(self.next_bucket):
            self._launch_next()

    def launch_all(self, overlap: bool) -> None:
        """End of backward: launch every remaining bucket in plan order, then wait for all."""
        while self.next_bucket < len(self.buckets):
            self._launch_next()
            if not overlap:
                self.wait_all()
        self.wait_all()
        assert all(phase is BucketState.REDUCED for phase in self.phase), self.phase
        self._start_over()

    def wait_all(self) -> None:
        while self.in_flight:
            self._finish_oldest()

    @property
    def mid_backward(self) -> bool:
        """Some bucket of the current backward is launched but the flush has not run."""
        return self.next_bucket > 0

    def reset(self) -> None:
        """Forget a backward that never finished (it raised): wait for the collectives it started,
        so that no buffer is reused while a peer still writes to it, and return every bucket to
        WAITING. The caller discards the gradients (see [Note: failed backward])."""
        self.wait_all()
        self._start_over()

    def _start_over(self) -> None:
        self.next_bucket = 0
        self.phase = [BucketState.WAITING] * len(self.buckets)

    def _launch_next(self) -> None:
        index = self.next_bucket
        while len(self.in_flight) >= self.max_in_flight:
            self._finish_oldest()
        assert self.phase[index] is BucketState.WAITING, f"bucket {index}: {self.phase[index]}"
        self.phase[index] = BucketState.REDUCING
        self.in_flight.append(self._launch(self.buckets[index]))
        self.next_bucket += 1

    def _finish_oldest(self) -> None:
        reduction = self.in_flight.popleft()
        self._finish(reduction)
        self.phase[reduction.bucket.index] = BucketState.REDUCED
