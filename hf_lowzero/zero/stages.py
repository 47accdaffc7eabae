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

    reducer = BucketReducer(buckets, group, world_size, comm_dtype=None, stage=2, grad_rows=rows)
    reducer.launch(bucket); reducer.finish(bucket)      # driven by PlanOrderLauncher
    reducer.grad_rows(bucket)                           # this rank's fp32 rows, or None
"""

from __future__ import annotations

from collections import Counter

import torch

from hf_lowzero.zero import comm
from hf_lowzero.zero.buckets import Bucket
from hf_lowzero.zero.grad_rows import DeviceGradRows
from hf_lowzero.zero.memory import bytes_by_device


def pack_bucket(bucket: Bucket, flat: torch.Tensor, world_size: int) -> None:
    """Copy every param's ``.grad`` into the rank-major ``flat`` buffer, then free it.

    A param with no gradient contributes zeros (see [Note: bucket order]). The result is divided
    by ``world_size`` so that a SUM collective yields the average.
    """
    for slot in bucket.slots:
        grad = slot.param.grad
        slot.shard.scatter_into(slot.rows(flat, bucket.row_numel), None if grad is None else grad.reshape(-1))
        slot.param.grad = None
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
    ) -> None:
        self.buckets = buckets
        self.group = group
        self.world_size = world_size
        self.comm_dtype = comm_dtype
        self.allows_no_sync = stage == 1
        self.store = grad_rows
        self._in_flight_bytes = 0

    def launch(self, bucket: Bucket) -> None:
        dtype = self.comm_dtype or bucket.dtype
        flat = torch.empty(self.world_size * bucket.row_numel, dtype=dtype, device=bucket.device)
        pack_bucket(bucket, flat, self.world_size)
        out = self.store.direct_target(bucket, dtype, first=not bucket.has_grads)
        transient = flat.nbytes
        if out is None:
            out = torch.empty(bucket.row_numel, dtype=dtype, device=bucket.device)
            transient += out.nbytes
        bucket.scratch = (flat, out, transient)  # both stay alive until the collective is done
        self._in_flight_bytes += transient
        bucket.work = comm.reduce_scatter(out, flat, self.group, async_op=True)

    def finish(self, bucket: Bucket) -> None:
        comm.wait(bucket.work)
        _, out, transient = bucket.scratch
        self.store.accept(bucket, out, first=not bucket.has_grads)
        self._in_flight_bytes -= transient
        bucket.work, bucket.scratch, bucket.has_grads = None, (), True

    def grad_rows(self, bucket: Bucket) -> torch.Tensor | None:
        """This rank's averaged gradient rows of ``bucket`` (1D fp32, ``row_numel``), or None."""
        return self.store.rows(bucket) if bucket.has_grads else None

    def buffer_bytes(self) -> Counter:
        """Bytes of gradient storage right now, per device: the rows plus buckets in flight."""
        placed = bytes_by_device(self.store.tensors())
        placed[str(self.buckets[0].device)] += self._in_flight_bytes
        return placed

    def clear(self) -> None:
        """Forget all gradients (after ``step`` or on ``zero_grad``)."""
        self.store.clear()
        for bucket in self.buckets:
            bucket.has_grads = False
