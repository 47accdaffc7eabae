"""What a bucket's reduction does, and the one difference between the stages.

Both stages reduce-scatter each bucket: every rank receives only the averaged rows it owns and
adds them into its fp32 gradient store (``grad_store.py``), so a step sends the minimum
2Ψ(W-1)/W per rank, like DDP's all-reduce. (With whole params the gradient goes only to its
owner: ``comm.reduce_to_owners``, the same bytes summed over ranks.) The stages differ in what a rank may keep between
micro-batches of one step:

- stage 1 allows ``no_sync()``: gradients accumulate locally in full ``p.grad`` with no
  communication, and the first backward outside it reduce-scatters the total once (DDP's
  communication pattern, full-size gradients while accumulating);
- stage 2 forbids it: every backward reduce-scatters and adds into the fp32 rows, so no full
  gradient outlives its bucket (the memory pattern of the ZeRO paper's stage 2).

Both free ``p.grad`` as soon as it is copied into a bucket and average by pre-dividing by the
world size before a SUM collective, as DDP does.

Stage 1 on a model of one small bucket all-reduces it instead, with the step's flags appended, so
the step needs no collective of its own ([Note: replicated reduction] in ``replicated.py``).

A ``ReductionTap`` sees each bucket packed and reduced: the integrity checks
(``integrity/checker.py``) are one, and the reducer knows them by that protocol only.

Example::

    reducer = BucketReducer(buckets, comm_dtype=None, stage=2, store=store, pool=BufferPool(), tap=checker, shard=shard)
    reducer.finish(reducer.launch(bucket))              # driven by PlanOrderLauncher
    reducer.reduced(bucket)                             # this rank's averaged fp32 chunk, or None
"""

from __future__ import annotations

from collections import Counter
from typing import Protocol

import torch

from hf_lowzero.zero.grads.grad_store import DeviceGradStore
from hf_lowzero.zero.grads.replicated import ReplicatedTotals, Trailer, trailer_numel
from hf_lowzero.zero.layout.buckets import Bucket, Reduction
from hf_lowzero.zero.layout.packing import pack_bucket, pack_plan
from hf_lowzero.zero.runtime import comm
from hf_lowzero.zero.runtime.buffers import BufferPool
from hf_lowzero.zero.runtime.memory import bytes_by_device
from hf_lowzero.zero.runtime.ranges import profiler_range
from hf_lowzero.zero.runtime.shard_group import ShardGroup


class ReductionTap(Protocol):
    """What sees every bucket's reduction on its way: packed (before the collective) and reduced
    (this rank's rows, right after it). Neither may change what training computes."""

    def after_pack(self, bucket: Bucket, flat: torch.Tensor, divided: bool = True) -> None:
        """``flat``: the packed bucket (1D, rank-major); ``divided``: by W already, or (False) the
        collective divides ([Note: the divide in the collective] in ``runtime/comm.py``)."""

    def after_reduce(self, bucket: Bucket, rows: torch.Tensor) -> None:
        """``rows``: this rank's reduced chunk of ``bucket``, before the gradient store takes it."""


class _NoTap:
    """A ``ReductionTap`` that sees nothing (a reduction no check reads: the exact reducer's int64 sums)."""

    def after_pack(self, bucket: Bucket, flat: torch.Tensor, divided: bool = True) -> None:
        pass

    def after_reduce(self, bucket: Bucket, rows: torch.Tensor) -> None:
        pass


NO_TAP = _NoTap()


class BucketReducer:
    """Reduces buckets into this rank's gradient store; ``launch``/``finish`` are driven by
    ``PlanOrderLauncher``. Knows which buckets hold reduced gradients since the last step."""

    def __init__(
        self,
        buckets: list[Bucket],
        *,
        comm_dtype: torch.dtype | None,
        stage: int,
        store: DeviceGradStore,
        pool: BufferPool,
        tap: ReductionTap,
        shard: ShardGroup,
        replicated: bool = False,
    ) -> None:
        self.buckets = buckets
        self.tap = tap  # sees each bucket after packing and after its collective
        self.shard = shard
        self.comm_dtype = comm_dtype
        self.allows_no_sync = stage == 1
        self.no_sync_refusal = (  # why no_sync() is refused, when it is
            "no_sync() is not available with ZeRO stage 2: gradients are sharded, so every "
            "backward must reduce-scatter into the owned rows (keeping full local gradients "
            "would undo stage 2's memory savings). Call backward() for every micro-batch "
            "without no_sync(), or use stage=1."
        )
        self.store = store
        self.pool = pool
        self.holds = [False] * len(buckets)  # per bucket: reduced gradients since the last step
        self._needs_workspace = [  # per bucket: a receive buffer for a point-to-point reduce-scatter
            comm.uses_point_to_point(shard.group, b.packed_numel * (comm_dtype or b.dtype).itemsize) for b in buckets
        ]
        self.pack_plans = [pack_plan(b, world_size=shard.world_size) for b in buckets]  # their params, packing order
        self.averages = comm.premultiplies(shard.group)  # the collective divides ([Note: the divide in the collective])
        self.replicated = replicated  # [Note: replicated reduction]: its one bucket is all-reduced, flags appended
        self._trailer = (
            Trailer(len(buckets[0].slots), comm_dtype or buckets[0].dtype, shard.device) if replicated else None
        )
        self._totals: ReplicatedTotals | None = None  # this step's, while its one reduction is the only one
        self._kept: list[torch.Tensor] = []  # the pooled buffer ``_totals`` reads, until ``clear``

    def launch(self, bucket: Bucket, grads: list | None = None, flags: tuple | None = None) -> Reduction:
        """Pack ``bucket``'s gradients (``grads``, read from its params' ``.grad``, or read now),
        free them, and start its collective. ``flags``: (this rank's used flags, whether it read a
        param stale), appended where ``replicated`` ([Note: replicated reduction])."""
        dtype = self.comm_dtype or bucket.dtype
        taken = []  # pooled buffers this bucket holds until its collective is done
        if self.replicated and self.shard.world_size > 1:
            return self._launch_replicated(bucket, dtype, grads, flags, taken)
        direct = self.store.direct_target(bucket, dtype, first=not self.holds[bucket.index])
        if self.shard.world_size == 1:  # nothing to reduce: the packed bucket is this rank's chunk
            out = direct if direct is not None else self.take(bucket.row_numel, dtype, bucket.device, taken)
            with profiler_range("hf_lowzero::pack_bucket"):
                pack_bucket(bucket, out, world_size=1, plan=self.pack_plans[bucket.index], grads=grads)
            return Reduction(bucket, None, out, tuple(taken))
        flat = self.take(bucket.packed_numel, dtype, bucket.device, taken)
        average = self.averages and not bucket.whole
        with profiler_range("hf_lowzero::pack_bucket"):
            plan = self.pack_plans[bucket.index]
            pack_bucket(bucket, flat, world_size=self.shard.world_size, plan=plan, grads=grads, divide=not average)
        self.tap.after_pack(bucket, flat, divided=not average)
        return self.start(bucket, flat, direct, taken, average)

    def _launch_replicated(self, bucket: Bucket, dtype: torch.dtype, grads, flags: tuple, taken: list) -> Reduction:
        used, stale = flags
        whole = self.take(bucket.packed_numel + trailer_numel(used.numel()), dtype, bucket.device, taken)
        flat = whole[: bucket.packed_numel]
        with profiler_range("hf_lowzero::pack_bucket"):
            plan = self.pack_plans[bucket.index]
            pack_bucket(bucket, flat, world_size=self.shard.world_size, plan=plan, grads=grads, divide=True)
        self._trailer.write(whole[bucket.packed_numel :], used, stale)
        self.tap.after_pack(bucket, flat, divided=True)
        return Reduction(bucket, comm.all_reduce(whole, self.shard.group, async_op=True), whole, tuple(taken))

    def take(self, numel: int, dtype: torch.dtype, device: torch.device, taken: list) -> torch.Tensor:
        """A pooled buffer, recorded in ``taken`` (given back once the bucket's collective is done)."""
        taken.append(self.pool.take(numel, dtype, device))
        return taken[-1]

    def start(
        self, bucket: Bucket, flat: torch.Tensor, direct: torch.Tensor | None, taken: list, average: bool = False
    ) -> Reduction:
        """Start the collective of a packed bucket (``flat``, 1D, rank-major): this rank's chunk lands
        in ``direct`` (None: a pooled buffer); ``average``: the collective divides by W."""

        def take(numel: int) -> torch.Tensor:
            return self.take(numel, flat.dtype, bucket.device, taken)

        if bucket.whole:  # [Note: uneven exchanges]: the workspace receives W chunks of this rank's length
            out = direct if direct is not None else take(bucket.row_numel)
            workspace = take(self.shard.world_size * bucket.row_numel)
            work = comm.reduce_to_owners(out, flat, list(bucket.chunks), self.shard.group, True, workspace)
            return Reduction(bucket, work, out, tuple(taken))
        workspace = take(flat.numel()) if self._needs_workspace[bucket.index] else None
        if direct is not None:
            out = direct
        elif workspace is not None:
            out = workspace[: bucket.row_numel]  # summed in place there
        else:
            out = take(bucket.row_numel)
        work = comm.reduce_scatter(out, flat, self.shard.group, async_op=True, workspace=workspace, average=average)
        return Reduction(bucket, work, out, tuple(taken))

    def finish(self, reduction: Reduction) -> None:
        bucket = reduction.bucket
        with profiler_range("hf_lowzero::reduce_wait"):
            comm.wait(reduction.work)  # on gloo also the local sum of the received chunks
        out, buffers = reduction.out, reduction.buffers
        if self.replicated:  # every rank's chunk, then the flags: keep them for the step
            out, buffers = self._keep(bucket, out, buffers)
        if self.shard.world_size > 1:
            self.tap.after_reduce(bucket, out)
        with profiler_range("hf_lowzero::accept_chunk"):
            self.store.accept(bucket, out, first=not self.holds[bucket.index])
        for buffer in buffers:
            self.pool.give(buffer)
        self.holds[bucket.index] = True

    def _keep(self, bucket: Bucket, whole: torch.Tensor, buffers: tuple) -> tuple[torch.Tensor, tuple]:
        """This rank's chunk of a replicated all-reduce; the totals kept while it is the step's only one."""
        row, rank = bucket.row_numel, self.shard.rank
        chunks = tuple(whole[r * row : (r + 1) * row] for r in range(self.shard.world_size))
        self._release()
        if self.holds[bucket.index]:  # a second reduction this step: the norm is the store's sum's
            return chunks[rank], buffers
        self._totals = ReplicatedTotals(chunks, whole[bucket.packed_numel :])
        self._kept = list(buffers)
        return chunks[rank], ()

    def _release(self) -> None:
        for buffer in self._kept:
            self.pool.give(buffer)
        self._kept, self._totals = [], None

    def replicated_totals(self) -> ReplicatedTotals | None:
        """[Note: replicated reduction]: what this step's all-reduce brought back, where it was the
        step's only reduction; None otherwise (the step then all-reduces its stats)."""
        return self._totals

    def reduced(self, bucket: Bucket) -> torch.Tensor | None:
        """This rank's averaged gradient chunk of ``bucket`` (1D, ``row_numel``), or None: fp32, or
        the communication dtype where the store keeps it so ([Note: 16-bit rows] in ``grad_store.py``)."""
        return self.store.rows(bucket) if self.holds[bucket.index] else None

    def buffer_bytes(self) -> Counter:
        """Bytes of gradient storage right now, per device: the store (and host staging)."""
        return bytes_by_device(self.store.tensors())

    def clear(self) -> None:
        """Forget all gradients (after ``step`` or on ``zero_grad``)."""
        self.store.clear()
        self._release()
        self.holds = [False] * len(self.buckets)
