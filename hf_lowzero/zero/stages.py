"""Stage policies: what a bucket's reduction does and what a rank keeps afterwards.

Stage 1 (:class:`AllReduceGrads`): every rank keeps the full averaged gradient of every bucket in
a persistent bucket buffer until ``step``; under ``no_sync`` gradients accumulate in ``p.grad``.
Stage 2 (:class:`ReduceScatterGrads`): every rank keeps only its own fp32 gradient rows; bucket
buffers live only while their collective is in flight, and each backward adds into the rows.

Both free ``p.grad`` as soon as it is copied into a bucket and average by pre-dividing by the
world size before a SUM collective, as DDP does.
"""

from __future__ import annotations

import torch

from hf_lowzero.zero import comm
from hf_lowzero.zero.buckets import Bucket

MASTER_DTYPE = torch.float32


def pack_bucket(bucket: Bucket, flat: torch.Tensor, world_size: int, accumulate: bool) -> None:
    """Copy (or add) every param's ``.grad`` into the rank-major ``flat`` buffer, then free it.

    A param with no gradient contributes zeros (see [Note: bucket order]). The result is divided
    by ``world_size`` so that a SUM collective yields the average.
    """
    for slot in bucket.slots:
        grad = slot.param.grad
        slot.shard.scatter_into(
            slot.rows(flat, bucket.row_numel), None if grad is None else grad.reshape(-1), accumulate
        )
        slot.param.grad = None
    flat.div_(world_size)


class GradientSync:
    """Base of the stage policies. ``launch``/``finish`` are driven by ``PlanOrderLauncher``."""

    allows_no_sync: bool

    def __init__(self, buckets: list[Bucket], group, rank: int, world_size: int, comm_dtype: torch.dtype | None):
        self.buckets = buckets
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.comm_dtype = comm_dtype

    def reduce_dtype(self, bucket: Bucket) -> torch.dtype:
        return self.comm_dtype or bucket.dtype

    def launch(self, bucket: Bucket) -> None:
        raise NotImplementedError

    def finish(self, bucket: Bucket) -> None:
        raise NotImplementedError

    def grad_rows(self, bucket: Bucket) -> torch.Tensor | None:
        """This rank's averaged gradient rows of ``bucket`` (1D fp32, ``row_numel``), or None."""
        raise NotImplementedError

    def buffer_bytes(self) -> int:
        """Bytes held by this policy's gradient storage right now."""
        raise NotImplementedError

    def clear(self) -> None:
        """Forget all gradients (after ``step`` or on ``zero_grad``)."""
        for bucket in self.buckets:
            bucket.has_grads = False


class AllReduceGrads(GradientSync):
    """Stage 1: all-reduce each bucket; the full averaged gradient stays in the bucket buffer."""

    allows_no_sync = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.flat_buckets: list[torch.Tensor | None] = [None] * len(self.buckets)  # persistent, lazily made

    def launch(self, bucket: Bucket) -> None:
        flat = self.flat_buckets[bucket.index]
        if flat is None:
            flat = torch.empty(
                self.world_size * bucket.row_numel, dtype=self.reduce_dtype(bucket), device=bucket.device
            )
            self.flat_buckets[bucket.index] = flat
        # A second synced backward in the same step adds its local gradients to the average
        # already held: sum_r (avg + g_r) / W = avg + mean_r(g_r), exactly DDP's arithmetic.
        pack_bucket(bucket, flat, self.world_size, accumulate=bucket.has_grads)
        bucket.work = comm.all_reduce(flat, self.group, async_op=True)

    def finish(self, bucket: Bucket) -> None:
        comm.wait(bucket.work)
        bucket.work = None
        bucket.has_grads = True

    def grad_rows(self, bucket: Bucket) -> torch.Tensor | None:
        if not bucket.has_grads:
            return None
        flat = self.flat_buckets[bucket.index]
        return flat.view(self.world_size, bucket.row_numel)[self.rank].to(MASTER_DTYPE)

    def buffer_bytes(self) -> int:
        return sum(f.numel() * f.element_size() for f in self.flat_buckets if f is not None)


class ReduceScatterGrads(GradientSync):
    """Stage 2: reduce-scatter each bucket and add this rank's chunk into fp32 gradient rows."""

    allows_no_sync = False

    def __init__(self, *args, total_row_numel: int, device: torch.device, **kwargs):
        super().__init__(*args, **kwargs)
        # 1D fp32, the owned-rows space: accumulation happens in fp32 even for bf16/fp16 params.
        self.flat_grad_rows = torch.zeros(total_row_numel, dtype=MASTER_DTYPE, device=device)
        self._in_flight_bytes = 0

    def _rows_of(self, bucket: Bucket) -> torch.Tensor:
        return self.flat_grad_rows[bucket.row_offset : bucket.row_offset + bucket.row_numel]

    def launch(self, bucket: Bucket) -> None:
        dtype = self.reduce_dtype(bucket)
        flat = torch.empty(self.world_size * bucket.row_numel, dtype=dtype, device=bucket.device)
        pack_bucket(bucket, flat, self.world_size, accumulate=False)
        rows = self._rows_of(bucket)
        # The first contribution of an fp32 reduction lands straight in the gradient rows.
        direct = not bucket.has_grads and dtype == MASTER_DTYPE
        out = rows if direct else torch.empty_like(rows, dtype=dtype)
        bucket.scratch = (flat, out, direct)
        self._in_flight_bytes += flat.nbytes + (0 if direct else out.nbytes)
        bucket.work = comm.reduce_scatter(out, flat, self.group, async_op=True)

    def finish(self, bucket: Bucket) -> None:
        comm.wait(bucket.work)
        flat, out, direct = bucket.scratch
        if not direct:
            rows = self._rows_of(bucket)
            rows.add_(out) if bucket.has_grads else rows.copy_(out)
        self._in_flight_bytes -= flat.nbytes + (0 if direct else out.nbytes)
        bucket.work, bucket.scratch, bucket.has_grads = None, (), True

    def grad_rows(self, bucket: Bucket) -> torch.Tensor | None:
        return self._rows_of(bucket) if bucket.has_grads else None

    def buffer_bytes(self) -> int:
        return self.flat_grad_rows.nbytes + self._in_flight_bytes


def make_grad_sync(config, buckets: list[Bucket], rank: int, world_size: int) -> GradientSync:
    """The stage policy of ``config.stage`` over ``buckets``."""
    args = (buckets, config.process_group, rank, world_size, config.communication_dtype)
    if config.stage == 1:
        return AllReduceGrads(*args)
    device = buckets[0].device
    return ReduceScatterGrads(*args, total_row_numel=sum(b.row_numel for b in buckets), device=device)
