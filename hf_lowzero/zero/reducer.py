"""What a bucket's reduction does, and the one difference between the stages.

Both stages reduce-scatter each bucket: every rank receives only the averaged rows it owns and
adds them into its fp32 gradient rows (``grad_rows.py``), so a step sends the minimum
2Ψ(W-1)/W per rank, like DDP's all-reduce. The stages differ in what a rank may keep between
micro-batches of one step:

- stage 1 allows ``no_sync()``: gradients accumulate locally in full ``p.grad`` with no
  communication, and the first backward outside it reduce-scatters the total once (DDP's
  communication pattern, full-size gradients while accumulating);
- stage 2 forbids it: every backward reduce-scatters and adds into the fp32 rows, so no full
  gradient outlives its bucket (the memory pattern of the ZeRO paper's stage 2).

Both free ``p.grad`` as soon as it is copied into a bucket and average by pre-dividing by the
world size before a SUM collective, as DDP does.

Example::

    reducer = BucketReducer(buckets, group, world_size, comm_dtype=None, stage=2, grad_rows=rows, pool=BufferPool())
    reducer.launch(bucket); reducer.finish(bucket)      # driven by PlanOrderLauncher
    reducer.grad_rows(bucket)                           # this rank's fp32 rows, or None
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.profiler import record_function

from hf_lowzero.zero import comm
from hf_lowzero.zero.buckets import Bucket
from hf_lowzero.zero.buffers import BufferPool
from hf_lowzero.zero.grad_rows import DeviceGradRows
from hf_lowzero.zero.memory import bytes_by_device


def pack_bucket(bucket: Bucket, flat: torch.Tensor, world_size: int) -> None:
    """Copy every param's ``.grad`` into the rank-major ``flat`` buffer, then free it.

    One ``torch._chunk_cat`` kernel (FSDP2's packing op) pads each flattened gradient to a multiple
    of the world size and lays the W chunks out rank-major, whatever the number of params; whole
    params (ordered by owner) are simply concatenated. A param with no gradient contributes zeros
    (see [Note: bucket order]). The result is divided by ``world_size`` so that a SUM collective
    yields the average.
    """
    grads = []
    for slot in bucket.slots:
        grad = slot.param.grad
        grads.append(
            torch.zeros(slot.shard.numel, dtype=bucket.dtype, device=bucket.device) if grad is None else grad.view(-1)
        )
        slot.param.grad = None
    chunks = 1 if bucket.whole else world_size
    torch._chunk_cat(grads, dim=0, num_chunks=chunks, out=flat.view(chunks, bucket.packed_numel // chunks))
    if world_size > 1:
        flat.div_(world_size)


class BucketReducer:
    """Reduce-scatters buckets into this rank's gradient rows; ``launch``/``finish`` are driven
    by ``PlanOrderLauncher``."""

    def __init__(
        self,
        buckets: list[Bucket],
        group,
        world_size: int,
        comm_dtype: torch.dtype | None,
        stage: int,
        grad_rows: DeviceGradRows,
        pool: BufferPool,
    ) -> None:
        self.buckets = buckets
        self.group = group
        self.world_size = world_size
        self.comm_dtype = comm_dtype
        self.allows_no_sync = stage == 1
        self.store = grad_rows
        self.pool = pool
        self._needs_workspace = comm.uses_point_to_point(group)  # a receive buffer per bucket

    def launch(self, bucket: Bucket) -> None:
        dtype = self.comm_dtype or bucket.dtype
        direct = self.store.direct_target(bucket, dtype, first=not bucket.has_grads)
        taken = []  # pooled buffers this bucket holds until its collective is done

        def take(numel: int) -> torch.Tensor:
            taken.append(self.pool.take(numel, dtype, bucket.device))
            return taken[-1]

        if self.world_size == 1:  # nothing to reduce: the packed bucket is this rank's rows
            out = direct if direct is not None else take(bucket.row_numel)
            with record_function("hf_lowzero::pack_bucket"):
                pack_bucket(bucket, out, 1)
            bucket.scratch, bucket.work = (out, taken), None
            return
        flat = take(bucket.packed_numel)
        with record_function("hf_lowzero::pack_bucket"):
            pack_bucket(bucket, flat, self.world_size)
        if bucket.whole:  # [Note: uneven exchanges]: the workspace receives W chunks of this rank's length
            out = direct if direct is not None else take(bucket.row_numel)
            workspace = take(self.world_size * bucket.row_numel)
            bucket.scratch = (out, taken)
            bucket.work = comm.reduce_to_owners(out, flat, bucket.chunks, self.group, True, workspace)
            return
        workspace = take(flat.numel()) if self._needs_workspace else None
        if direct is not None:
            out = direct
        elif workspace is not None:
            out = workspace[: bucket.row_numel]  # summed in place there
        else:
            out = take(bucket.row_numel)
        bucket.scratch = (out, taken)
        bucket.work = comm.reduce_scatter(out, flat, self.group, async_op=True, workspace=workspace)

    def finish(self, bucket: Bucket) -> None:
        with record_function("hf_lowzero::reduce_wait"):
            comm.wait(bucket.work)  # on gloo also the local sum of the received chunks
        out, taken = bucket.scratch
        with record_function("hf_lowzero::accept_rows"):
            self.store.accept(bucket, out, first=not bucket.has_grads)
        for buffer in taken:
            self.pool.give(buffer)
        bucket.work, bucket.scratch, bucket.has_grads = None, (), True

    def grad_rows(self, bucket: Bucket) -> torch.Tensor | None:
        """This rank's averaged gradient rows of ``bucket`` (1D fp32, ``row_numel``), or None."""
        return self.store.rows(bucket) if bucket.has_grads else None

    def buffer_bytes(self) -> Counter:
        """Bytes of gradient storage right now, per device: the rows (and host staging)."""
        return bytes_by_device(self.store.tensors())

    def clear(self) -> None:
        """Forget all gradients (after ``step`` or on ``zero_grad``)."""
        self.store.clear()
        for bucket in self.buckets:
            bucket.has_grads = False
