"""This rank's fp32 master rows, and the copies between them and the model's params.

The rows live in one flat fp32 tensor in the owned-rows space (bucket after bucket), on the
params' device, or in host memory (pinned for CUDA params) with optimizer offload, where the
inner optimizer then steps them.

Example::

    master = MasterRows(slots, buckets, rank, world_size, group, device, offload=False, pin_memory=True)
    master.rows[slot.index]        # 1D fp32 view, shard_numel long (padding included)
    master.copy_to_params()        # all-gather the rows back into every rank's params (collective)
"""

from __future__ import annotations

import torch

from hf_lowzero.zero import comm
from hf_lowzero.zero.buckets import Bucket
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
    ) -> None:
        self.slots, self.buckets = slots, buckets
        self.rank, self.world_size, self.group = rank, world_size, group
        total = sum(b.row_numel for b in buckets)
        if offload:
            self.flat = host_buffer(total, MASTER_DTYPE, pin_memory and device.type == "cuda")
        else:
            self.flat = torch.zeros(total, dtype=MASTER_DTYPE, device=device)
        self.rows = [self.flat[s.row_offset : s.row_offset + s.shard.shard_numel] for s in slots]
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
            comm.wait(work)  # rows and out stay referenced until here
            for slot in bucket.slots:
                slot.shard.gather_from(slot.rows(out, bucket.row_numel), slot.param.view(-1))

        for bucket in self.buckets:
            rows = self.bucket_rows(bucket).to(bucket.device, non_blocking=True).to(bucket.dtype)
            out = torch.empty(self.world_size * bucket.row_numel, dtype=bucket.dtype, device=bucket.device)
            in_flight.append((bucket, rows, out, comm.all_gather(out, rows, self.group, async_op=True)))
            if len(in_flight) >= MAX_GATHERS_IN_FLIGHT:
                finish(*in_flight.pop(0))
        for item in in_flight:
            finish(*item)
