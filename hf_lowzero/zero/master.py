"""This rank's fp32 master rows, and the copies between them and the model's params.

The rows live in one flat fp32 tensor in the owned-rows space (bucket after bucket), on the
params' device, or in host memory (pinned for CUDA params) with optimizer offload, where the
inner optimizer then steps them.

Example::

    master = MasterRows(slots, buckets, rank, world_size, group, device, offload=False, pin_memory=True, pool=pool)
    master.rows[slot.index]        # 1D fp32 view of this rank's piece (padding included; may be empty)
    master.copy_to_params()        # all-gather the rows back into every rank's params (collective)
"""

from __future__ import annotations

import torch
from torch.profiler import record_function

from hf_lowzero.zero import comm
from hf_lowzero.zero.buckets import Bucket
from hf_lowzero.zero.buffers import BufferPool
from hf_lowzero.zero.grad_rows import MASTER_DTYPE, host_buffer
from hf_lowzero.zero.params import ParamSlot

MAX_GATHERS_IN_FLIGHT = 2  # bounds the transient all-gather buffers


class MasterRows:
    def __init__(
        self,
        slots: list[ParamSlot],
        buckets: list[Bucket],
        rank: int,
        world_size: int,
        group,
        device: torch.device,
        offload: bool,
        pin_memory: bool,
        pool: BufferPool,
    ) -> None:
        self.slots, self.buckets = slots, buckets
        self.rank, self.world_size, self.group = rank, world_size, group
        self.pool = pool
        total = sum(b.row_numel for b in buckets)
        if offload:
            self.flat = host_buffer(total, MASTER_DTYPE, pin_memory and device.type == "cuda")
        else:
            self.flat = torch.zeros(total, dtype=MASTER_DTYPE, device=device)
        self.rows = [self.flat[s.row_offset : s.row_offset + s.row_numel] for s in slots]
        self._unpack_targets = {b.index: unpack_targets(b, world_size) for b in buckets if not b.whole}
        self.copy_from_params()

    def bucket_rows(self, bucket: Bucket) -> torch.Tensor:
        return self.flat[bucket.row_offset : bucket.row_offset + bucket.row_numel]

    @torch.no_grad()
    def copy_from_params(self) -> None:
        """Re-read every row from the model's params (this rank's slice of each). Local."""
        for slot, row in zip(self.slots, self.rows):
            start, end = slot.shard.owned_range(self.rank)
            row[: end - start].copy_(slot.param.view(-1)[start:end])

    @torch.no_grad()
    def copy_to_params(self) -> None:
        """All-gather the rows back into the model's params, bucket by bucket, in the params'
        dtype. Collective. Offloaded rows go to the device first (from pinned memory: async,
        ordered before the all-gather on the same stream)."""
        in_flight: list[tuple] = []

        def finish(bucket: Bucket, rows: torch.Tensor, out: torch.Tensor, work) -> None:
            with record_function("hf_lowzero::all_gather_wait"):
                comm.wait(work)  # rows and out stay referenced until here
            with record_function("hf_lowzero::unpack_bucket"):
                unpack_bucket(bucket, out, self.world_size, self._unpack_targets.get(bucket.index))
            self.pool.give(out)
            self._release(bucket, rows)

        for bucket in self.buckets:
            rows = self.bucket_rows(bucket).to(bucket.device, non_blocking=True)
            if rows.dtype != bucket.dtype:
                rows = self.pool.take(bucket.row_numel, bucket.dtype, bucket.device).copy_(rows)
            if self.world_size == 1:  # the rows are the whole params: nothing to gather
                with record_function("hf_lowzero::unpack_bucket"):
                    unpack_bucket(bucket, rows, 1, self._unpack_targets.get(bucket.index))
                self._release(bucket, rows)
                continue
            out = self.pool.take(bucket.packed_numel, bucket.dtype, bucket.device)
            if not bucket.whole:
                work = comm.all_gather(out, rows, self.group, async_op=True)
            else:
                work = comm.gather_from_owners(out, rows, bucket.chunks, self.group, async_op=True)
            in_flight.append((bucket, rows, out, work))
            if len(in_flight) >= MAX_GATHERS_IN_FLIGHT:
                finish(*in_flight.pop(0))
        for item in in_flight:
            finish(*item)

    def _release(self, bucket: Bucket, rows: torch.Tensor) -> None:
        """Give ``rows`` back to the pool when it is a pooled copy in the params' dtype, not the
        master rows themselves."""
        if rows.data_ptr() != self.bucket_rows(bucket).data_ptr():
            self.pool.give(rows)


def unpack_targets(bucket: Bucket, world_size: int) -> list[torch.Tensor | None]:
    """Per param of ``bucket``: its ``[W, shard_numel]`` view when its numel divides by W (the
    gathered rows land in it directly), else None (it needs a temporary to drop the padding)."""
    return [
        slot.param.view(world_size, slot.shard.shard_numel) if slot.shard.padding == 0 else None
        for slot in bucket.slots
    ]


@torch.no_grad()
def unpack_bucket(
    bucket: Bucket, gathered: torch.Tensor, world_size: int, targets: list[torch.Tensor | None] | None = None
) -> None:
    """Copy a gathered rank-major bucket (``packed_numel`` flat) into its params.

    Row shards (``[W, row_numel]``): one ``split_with_sizes_copy`` kernel writes every param whose
    numel divides by W straight into it; a padded param goes through a temporary and drops its
    padding. ``targets`` is :func:`unpack_targets` of the bucket, built once by the caller. Whole
    params: the bucket is the params back to back, one ``split_with_sizes_copy`` into them all.
    """
    if bucket.whole:
        sizes = [slot.shard.numel for slot in bucket.slots]
        torch.split_with_sizes_copy(gathered, sizes, out=[slot.param.view(-1) for slot in bucket.slots])
        return
    targets = unpack_targets(bucket, world_size) if targets is None else targets
    outs = [
        torch.empty(world_size, slot.shard.shard_numel, dtype=bucket.dtype, device=bucket.device)
        if target is None
        else target
        for slot, target in zip(bucket.slots, targets)
    ]
    sizes = [slot.shard.shard_numel for slot in bucket.slots]
    torch.split_with_sizes_copy(gathered.view(world_size, bucket.row_numel), sizes, dim=1, out=outs)
    for slot, target, out in zip(bucket.slots, targets, outs):
        if target is None:
            slot.param.view(-1).copy_(out.view(-1)[: slot.shard.numel])
