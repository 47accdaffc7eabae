"""The gradient store: where this rank's reduced gradients accumulate, on the params' device or,
for optimizer offload, in host memory.

Both keep one flat fp32 tensor in the owned space (bucket after bucket, ``layout/packing.py``). ``accept``
takes a bucket's reduced chunk (the params' device, the communication dtype) right after its
collective finished: the first contribution since the last step is copied, later ones
(accumulation) added, always in fp32.

Example::

    store = make_grad_store(buckets, offload=True, pin_memory=True, shard=shard)
    store.accept(bucket, reduced_chunk, first=True)   # async D2H on CUDA
    store.chunk(bucket)                                # waits for that copy, then returns the host chunk

# [Note: host copies]
# With offload on CUDA, a bucket's reduced chunk is copied to pinned host memory on a side stream
# that first waits for an event recorded on the params' device's compute stream after the
# collective (so the copy never reads a chunk still being reduced; [Note: the params' device] in
# ``runtime/device.py``), while backward goes on. The chunk's allocation is tied to the copy stream
# (``record_stream``), so the caching allocator cannot reuse it before the copy is done. Every copy
# records a completion event, and nothing reads (or rewrites) a staging buffer or a host chunk
# before that event completed. Backward never waits for one ([Note: one host sync per step] in
# ``update/step.py``): a later micro-batch's copy of the same bucket asks whether earlier ones completed
# (``event_done``, a query), adds those into the chunk and reuses their staging buffers, and stages
# into another buffer otherwise; the step waits once, for the newest copy (copies on one stream
# complete in order), and adds what is left, micro-batch by micro-batch: the same additions in the
# same order as before. ``clear()`` waits too, before staging buffers are written again. On CPU the
# same path runs with ordinary copies and no events.

# [Note: the norm before the copy]
# The host never reads the gradient rows for the norm when it can be had on the device: a bucket's
# first reduced chunk since the last step has its squared norm taken right there, on the params'
# device, on the stream that waited for the collective (``norm.blocked_squared_norm``: the same
# blocks and float64 sum), before its copy to the host; the step sums these per-bucket values. A
# bucket that gets a second contribution (stage 2 accumulation) loses its value, and the step takes
# that bucket's norm from its host rows, as before. Only the norm's summation order changes (per
# bucket, then over buckets), so a clipped step differs from before at the norm's last bits and
# an unclipped one not at all; a non-finite total still goes to the float64 recount over the host
# rows ([Note: blocked norm] in ``norm.py``).

# [Note: 16-bit rows]
# A bucket reduced in 16 bits (bf16/fp16 communication) that gets one contribution in a step is
# kept as it came: its staging buffer is not widened into the fp32 chunk. ``rows`` hands out that
# 16-bit buffer, and our host kernel promotes each element as it steps it ([Note: our kernel in
# torch's place] in ``host/adam_step.py``), so the step makes no pass of its own over the rows. A
# widening is exact, so every reader that needs fp32 gets the same numbers, later: ``chunk``
# widens its bucket first, ``widen_all`` every bucket (before torch's step or a multiply of the
# rows), and a second contribution widens the first before it is added, the same additions in the
# same order as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_lowzero.zero.grads.norm import blocked_squared_norm
from hf_lowzero.zero.layout.buckets import Bucket
from hf_lowzero.zero.layout.packing import bucket_view, piece_view
from hf_lowzero.zero.layout.params import ParamSlot
from hf_lowzero.zero.runtime import device as dev
from hf_lowzero.zero.runtime.memory import same_memory
from hf_lowzero.zero.runtime.shard_group import ShardGroup

GRAD_DTYPE = torch.float32  # gradient rows, whatever the params' and the masters' dtype


class DeviceGradStore:
    """fp32 gradients of this rank's pieces, on the params' device."""

    offloaded = False

    def __init__(self, buckets: list[Bucket], *, shard: ShardGroup) -> None:
        self.flat = torch.zeros(sum(b.row_numel for b in buckets), dtype=GRAD_DTYPE, device=shard.device)

    def view(self, bucket: Bucket) -> torch.Tensor:
        return bucket_view(self.flat, bucket)

    def piece(self, slot: ParamSlot) -> torch.Tensor:
        """One param's piece (1D, ``row_numel``, possibly empty); valid for the store's lifetime."""
        return piece_view(self.flat, slot)

    def direct_target(self, bucket: Bucket, dtype: torch.dtype, first: bool) -> torch.Tensor | None:
        """Where a collective may write its result itself (saving a copy), or None."""
        return self.view(bucket) if first and dtype == GRAD_DTYPE else None

    def accept(self, bucket: Bucket, reduced: torch.Tensor, first: bool) -> None:
        chunk = self.view(bucket)
        if same_memory(reduced, chunk):
            return  # the collective wrote into the chunk (direct_target)
        chunk.copy_(reduced) if first else chunk.add_(reduced)

    def chunk(self, bucket: Bucket) -> torch.Tensor:
        """``bucket``'s rows in fp32."""
        return self.view(bucket)

    def rows(self, bucket: Bucket) -> torch.Tensor:
        """``bucket``'s rows as held: fp32, or in 16 bits where kept so ([Note: 16-bit rows])."""
        return self.view(bucket)

    def narrow(self, index: int) -> torch.Tensor | None:
        """Bucket ``index``'s rows where held in 16 bits ([Note: 16-bit rows]), else None."""
        return None

    def widen_all(self) -> bool:
        """Every bucket's rows in fp32 from here on; whether any was held in 16 bits."""
        return False

    def taken_square(self, bucket: Bucket) -> torch.Tensor | None:
        """The squared norm of ``bucket``'s chunk if already taken ([Note: the norm before the copy]),
        a 0-d float64 tensor on the params' device; None: the step takes it from the chunk."""
        return None

    def clear(self) -> None:
        pass

    def tensors(self) -> list[torch.Tensor]:
        """Every buffer this store holds (for the memory report)."""
        return [self.flat]


class HostGradStore(DeviceGradStore):
    """fp32 gradients in host memory (optimizer offload); see [Note: host copies]."""

    offloaded = True

    def __init__(self, buckets: list[Bucket], *, pin_memory: bool, shard: ShardGroup) -> None:
        self.device, self._buckets = shard.device, buckets
        self.pin_for = self.device if pin_memory else None  # page-locked for CUDA params only
        self.flat = dev.host_buffer(sum(b.row_numel for b in buckets), GRAD_DTYPE, self.pin_for)
        self.stream = dev.side_stream(self.device)  # None on CPU
        self._staging: dict[int, list[torch.Tensor]] = {}  # bucket index -> every staging buffer it made
        self._free: dict[int, list[torch.Tensor]] = {}  # bucket index -> its staging buffers not in use
        self._pending: dict[int, list[_Copy]] = {}  # bucket index -> its copies not yet added, in order
        self._last = None  # the event of the newest copy: every earlier one completed before it
        self._squares: dict[int, torch.Tensor] = {}  # bucket index -> its one contribution's squared norm
        self._narrow: dict[int, torch.Tensor] = {}  # bucket index -> its one contribution, kept in 16 bits

    def direct_target(self, bucket: Bucket, dtype: torch.dtype, first: bool) -> torch.Tensor | None:
        # On CPU the host chunk are the device's memory: reduce straight into them.
        return self.view(bucket) if first and dtype == GRAD_DTYPE and self.stream is None else None

    def accept(self, bucket: Bucket, reduced: torch.Tensor, first: bool) -> None:
        # [Note: the norm before the copy]: known only while the chunk holds one contribution.
        if first:
            self._squares[bucket.index] = blocked_squared_norm([reduced])
        else:
            self._squares.pop(bucket.index, None)
        chunk = self.view(bucket)
        if same_memory(reduced, chunk):
            return  # the collective wrote into the chunk (direct_target: CPU, fp32, first contribution)
        pending = self._pending.setdefault(bucket.index, [])
        self._settle(bucket.index, wait=False)  # copies of earlier micro-batches that already landed
        if not first:
            self._widen(bucket.index)  # its staging buffer is free for this contribution
        # An fp32 first contribution lands in the host chunk directly; anything to add is staged.
        direct = first and reduced.dtype == GRAD_DTYPE
        target = chunk if direct else self._staging_for(bucket, reduced.dtype)
        event = None
        if self.stream is None:
            target.copy_(reduced)
        else:
            # After the collective's wait, on the params' device ([Note: host copies]).
            dev.stream_waits(self.stream, dev.record_event(dev.current_stream(self.device)))
            with dev.on_stream(self.stream):
                target.copy_(reduced, non_blocking=True)
            dev.keep_alive(reduced, self.stream)
            event = self._last = dev.record_event(self.stream)
        pending.append(_Copy(None if direct else target, event, first))
        if self.stream is None:
            self._settle(bucket.index, wait=False)

    def _staging_for(self, bucket: Bucket, dtype: torch.dtype) -> torch.Tensor:
        free = self._free.setdefault(bucket.index, [])
        while free and free[-1].dtype != dtype:  # the communication dtype changed: make new ones
            free.pop()
        if free:
            return free.pop()
        staging = dev.host_buffer(bucket.row_numel, dtype, self.pin_for)
        self._staging.setdefault(bucket.index, []).append(staging)
        return staging

    def _settle(self, index: int, wait: bool) -> None:
        """Add bucket ``index``'s landed copies into its chunk, in order; with ``wait`` all of them
        (the caller waited for the newest copy), otherwise those whose copy already completed (a
        query, never a wait: [Note: host copies])."""
        pending = self._pending.get(index)
        while pending and (wait or pending[0].event is None or dev.event_done(pending[0].event)):
            copy = pending.pop(0)
            if copy.staging is None:
                continue  # landed in the chunk itself
            if copy.first:  # a first contribution is staged only when it is not fp32: kept so
                self._narrow[index] = copy.staging
                continue
            self._widen(index)
            self.view(self._buckets[index]).add_(copy.staging)
            self._free.setdefault(index, []).append(copy.staging)

    def _widen(self, index: int) -> None:
        narrow = self._narrow.pop(index, None)
        if narrow is not None:
            self.view(self._buckets[index]).copy_(narrow)
            self._free.setdefault(index, []).append(narrow)

    def chunk(self, bucket: Bucket) -> torch.Tensor:
        self.settle_all()
        self._widen(bucket.index)
        return self.view(bucket)

    def rows(self, bucket: Bucket) -> torch.Tensor:
        self.settle_all()
        narrow = self._narrow.get(bucket.index)
        return self.view(bucket) if narrow is None else narrow

    def narrow(self, index: int) -> torch.Tensor | None:
        self.settle_all()
        return self._narrow.get(index)

    def widen_all(self) -> bool:
        self.settle_all()
        held = bool(self._narrow)
        for index in list(self._narrow):
            self._widen(index)
        return held

    def settle_all(self) -> None:
        """Every copy landed and added: one host wait for the newest (the step's; [Note: host copies])."""
        if not any(self._pending.values()):
            return
        dev.host_waits(self._last)
        for index in list(self._pending):
            self._settle(index, wait=True)

    def taken_square(self, bucket: Bucket) -> torch.Tensor | None:
        return self._squares.get(bucket.index)

    def clear(self) -> None:
        self._squares.clear()
        self._narrow.clear()
        if any(self._pending.values()):
            dev.host_waits(self._last)  # a staging buffer may be written again only after its copy
        self._pending.clear()
        for index, buffers in self._staging.items():
            self._free[index] = list(buffers)

    def tensors(self) -> list[torch.Tensor]:
        return [self.flat, *(t for buffers in self._staging.values() for t in buffers)]


@dataclass(frozen=True, eq=False)
class _Copy:
    """A reduced chunk on its way to the host: where it lands (a staging buffer, or None: the chunk
    itself), the event it completes with (None on CPU), and whether it is the first contribution."""

    staging: torch.Tensor | None
    event: object
    first: bool


def make_grad_store(
    buckets: list[Bucket], *, offload: bool, pin_memory: bool, shard: ShardGroup
) -> DeviceGradStore | HostGradStore:
    if offload:
        return HostGradStore(buckets, pin_memory=pin_memory, shard=shard)
    return DeviceGradStore(buckets, shard=shard)
