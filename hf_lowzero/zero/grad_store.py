"""The gradient store: where this rank's reduced gradients accumulate, on the params' device or,
for optimizer offload, in host memory.

Both keep one flat fp32 tensor in the owned space (bucket after bucket, ``layout.py``). ``accept``
takes a bucket's reduced chunk (the params' device, the communication dtype) right after its
collective finished: the first contribution since the last step is copied, later ones
(accumulation) added, always in fp32.

Example::

    store = make_grad_store(buckets, device, offload=True, pin_memory=True)
    store.accept(bucket, reduced_chunk, first=True)   # async D2H on CUDA
    store.chunk(bucket)                                # waits for that copy, then returns the host chunk

# [Note: host copies]
# With offload on CUDA, a bucket's reduced chunk is copied to pinned host memory on a side stream
# that first waits for an event recorded on the params' device's compute stream after the
# collective (so the copy never reads a chunk still being reduced; [Note: the params' device] in
# ``device.py``), while backward goes on. The chunk's allocation is
# tied to the copy stream (``record_stream``), so the caching allocator cannot reuse it before
# the copy is done. Every copy records a completion event, and nothing reads (or rewrites) a
# staging buffer or a host chunk before that event completed: ``chunk()``, the next ``accept`` of
# the same bucket and ``clear()`` synchronize on it first. On CPU the same path runs with
# ordinary copies and no events.
"""

from __future__ import annotations

import torch

from hf_lowzero.zero import device as dev
from hf_lowzero.zero.buckets import Bucket
from hf_lowzero.zero.layout import bucket_view, piece_view
from hf_lowzero.zero.memory import same_memory
from hf_lowzero.zero.params import ParamSlot

GRAD_DTYPE = torch.float32  # gradient rows, whatever the params' and the masters' dtype


class DeviceGradStore:
    """fp32 gradients of this rank's pieces, on the params' device."""

    offloaded = False

    def __init__(self, buckets: list[Bucket], device: torch.device) -> None:
        self.flat = torch.zeros(sum(b.row_numel for b in buckets), dtype=GRAD_DTYPE, device=device)

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
        return self.view(bucket)

    def clear(self) -> None:
        pass

    def tensors(self) -> list[torch.Tensor]:
        """Every buffer this store holds (for the memory report)."""
        return [self.flat]


class HostGradStore(DeviceGradStore):
    """fp32 gradients in host memory (optimizer offload); see [Note: host copies]."""

    offloaded = True

    def __init__(self, buckets: list[Bucket], device: torch.device, pin_memory: bool) -> None:
        self.device = device
        self.pin = pin_memory and device.type == "cuda"
        self.flat = dev.host_buffer(sum(b.row_numel for b in buckets), GRAD_DTYPE, self.pin)
        self.stream = dev.side_stream(device)  # None on CPU
        self._staging: dict[int, torch.Tensor] = {}  # bucket index -> host buffer in the comm dtype
        self._pending: dict[int, tuple] = {}  # bucket index -> (host chunk, staging or None, event or None, first)

    def direct_target(self, bucket: Bucket, dtype: torch.dtype, first: bool) -> torch.Tensor | None:
        # On CPU the host chunk are the device's memory: reduce straight into them.
        return self.view(bucket) if first and dtype == GRAD_DTYPE and self.stream is None else None

    def accept(self, bucket: Bucket, reduced: torch.Tensor, first: bool) -> None:
        chunk = self.view(bucket)
        if same_memory(reduced, chunk):
            return  # the collective wrote into the chunk (direct_target: CPU, fp32, first contribution)
        self._resolve(bucket.index)  # a previous micro-batch's copy of this bucket
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
            event = dev.record_event(self.stream)
        self._pending[bucket.index] = (chunk, None if direct else target, event, first)

    def _staging_for(self, bucket: Bucket, dtype: torch.dtype) -> torch.Tensor:
        staging = self._staging.get(bucket.index)
        if staging is None or staging.dtype != dtype:
            staging = dev.host_buffer(bucket.row_numel, dtype, self.pin)
            self._staging[bucket.index] = staging
        return staging

    def _resolve(self, index: int) -> None:
        entry = self._pending.pop(index, None)
        if entry is None:
            return
        chunk, staging, event, first = entry
        dev.host_waits(event)  # [Note: host copies]: never read before the copy completed
        if staging is not None:
            chunk.copy_(staging) if first else chunk.add_(staging)

    def chunk(self, bucket: Bucket) -> torch.Tensor:
        self._resolve(bucket.index)
        return self.view(bucket)

    def clear(self) -> None:
        for index in list(self._pending):
            _, _, event, _ = self._pending.pop(index)
            dev.host_waits(event)  # the staging buffer may be written again only after the copy

    def tensors(self) -> list[torch.Tensor]:
        return [self.flat, *self._staging.values()]


def make_grad_store(buckets: list[Bucket], device: torch.device, offload: bool, pin_memory: bool):
    if offload:
        return HostGradStore(buckets, device, pin_memory)
    return DeviceGradStore(buckets, device)
