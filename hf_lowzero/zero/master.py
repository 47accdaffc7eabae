"""This rank's master rows, and the copies between them and the model's params.

The rows live in one flat tensor (fp32, or bf16: ``ZeroConfig.master_dtype`` and
[Note: bf16 masters] in ``master_precision.py``) in the owned-rows space (bucket after bucket), on the
params' device, or in host memory (pinned for CUDA params) with optimizer offload, where the
inner optimizer then steps them.

Example::

    master = MasterRows(slots, buckets, rank, world_size, group, device, offload=False, pin_memory=True, pool=pool)
    master.rows[slot.index]        # 1D view (fp32 by default) of this rank's piece (padding included; may be empty)
    master.copy_to_params()        # all-gather the rows back into every rank's params (collective)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.profiler import record_function

from hf_lowzero.zero import comm
from hf_lowzero.zero import device as dev
from hf_lowzero.zero.buckets import Bucket
from hf_lowzero.zero.buffers import BufferPool
from hf_lowzero.zero.layout import bucket_view, piece_view, unpack_bucket, unpack_targets
from hf_lowzero.zero.params import ParamSlot
from hf_lowzero.zero.write_gate import WriteGate

MAX_GATHERS_IN_FLIGHT = 2  # bounds the transient all-gather buffers


@dataclass(frozen=True, eq=False)
class Gather:
    """A bucket's gather back into the params in flight: what to wait for and what it reads and
    writes, until it is unpacked."""

    bucket: Bucket
    work: object
    chunk: torch.Tensor  # this rank's updated chunk, in the params' dtype
    out: torch.Tensor  # every rank's chunks, rank-major
    copied: bool  # chunk is a copy of the master rows (goes back to the pool), not the rows themselves


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
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.slots, self.buckets = slots, buckets
        self.rank, self.world_size, self.group = rank, world_size, group
        self.pool = pool
        self.device = device
        total = sum(b.row_numel for b in buckets)
        if offload:
            self.flat = dev.host_buffer(total, dtype, pin_memory and device.type == "cuda")
        else:
            self.flat = torch.zeros(total, dtype=dtype, device=device)
        # Every writer of the rows (and of the optimizer state beside them) passes this gate first.
        self.gate = WriteGate(device, host_resident=offload)
        self.rows = [piece_view(self.flat, s) for s in slots]
        self._unpack_targets = [unpack_targets(b, world_size) for b in buckets]  # views of the params, made once
        self.copy_from_params()

    def bucket_rows(self, bucket: Bucket) -> torch.Tensor:
        return bucket_view(self.flat, bucket)

    @torch.no_grad()
    def copy_from_params(self) -> None:
        """Re-read every row from the model's params (this rank's slice of each). Local."""
        self.gate.before_write()
        for slot, row in zip(self.slots, self.rows):
            start, end = slot.shard.owned_range(self.rank)
            row[: end - start].copy_(slot.param.view(-1)[start:end])

    @torch.no_grad()
    def copy_to_params(self) -> None:
        """All-gather the rows back into the model's params, bucket by bucket, in the params'
        dtype. Collective. Offloaded rows go to the device first (from pinned memory: async,
        ordered before the all-gather on the same stream; until they are done, writers of the rows
        wait at the gate: [Note: one gate for the shard's writers])."""
        in_flight: list[Gather] = []

        def finish(gather: Gather) -> None:
            with record_function("hf_lowzero::all_gather_wait"):
                comm.wait(gather.work)  # chunk and out stay referenced until here
            with record_function("hf_lowzero::unpack_bucket"):
                unpack_bucket(gather.bucket, gather.out, self.world_size, self._unpack_targets[gather.bucket.index])
            self.pool.give(gather.out)
            if gather.copied:
                self.pool.give(gather.chunk)

        for bucket in self.buckets:
            master_rows = self.bucket_rows(bucket)
            rows = master_rows.to(bucket.device, non_blocking=True)
            if rows.dtype != bucket.dtype:
                rows = self.pool.take(bucket.row_numel, bucket.dtype, bucket.device).copy_(rows)
            copied = rows is not master_rows  # identity, not data_ptr(): this runs under FakeTensorMode too
            if self.world_size == 1:  # the rows are the whole params: nothing to gather
                with record_function("hf_lowzero::unpack_bucket"):
                    unpack_bucket(bucket, rows, 1, self._unpack_targets[bucket.index])
                if copied:
                    self.pool.give(rows)
                continue
            out = self.pool.take(bucket.packed_numel, bucket.dtype, bucket.device)
            if not bucket.whole:
                work = comm.all_gather(out, rows, self.group, async_op=True)
            else:
                work = comm.gather_from_owners(out, rows, list(bucket.chunks), self.group, async_op=True)
            in_flight.append(Gather(bucket, work, rows, out, copied))
            if len(in_flight) >= MAX_GATHERS_IN_FLIGHT:
                finish(in_flight.pop(0))
        for gather in in_flight:
            finish(gather)
        if self.flat.device != self.device:  # host rows were read by copies on the device's stream
            self.gate.read_by(dev.record_event(dev.current_stream(self.device)))
