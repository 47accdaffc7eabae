"""``ExactReducer``: a bucket's reduction in int64 fixed point ([Note: exact reduction] in ``__init__.py``).

Each micro-batch's bucket is packed as usual (in fp32 whatever the params' dtype), its per-parameter
maxima are kept for the step's overflow test and the next grid, and it is scaled to the grid and
converted to int64 (truncating); the int64 bucket is reduce-scattered (a SUM: exact on every backend) and added
into this rank's int64 accumulator. The conversion back to float happens once, at the step
(``step.py``). Every backward reduces: no ``no_sync()`` (a local float ``+=`` of ``p.grad`` would
round in an order that depends on the world size).

Example::

    reducer = ExactReducer(buckets, stage=2, store=store, pool=pool, params=len(slots), shard=shard)
    reducer.finish(reducer.launch(bucket))      # driven by PlanOrderLauncher, as BucketReducer
    reducer.accumulator(bucket)                 # this rank's exact int64 sums of the bucket
"""

from __future__ import annotations

from collections import Counter

import torch

from hf_lowzero.zero.exact.fixed_point import quantize
from hf_lowzero.zero.exact.grid import Grid
from hf_lowzero.zero.exact.segments import Segments
from hf_lowzero.zero.grads.grad_store import DeviceGradStore
from hf_lowzero.zero.grads.reducer import NO_TAP, BucketReducer, ReductionTap
from hf_lowzero.zero.layout.buckets import Bucket, Reduction
from hf_lowzero.zero.layout.packing import bucket_view, pack_bucket
from hf_lowzero.zero.runtime import comm
from hf_lowzero.zero.runtime.buffers import BufferPool
from hf_lowzero.zero.runtime.memory import bytes_by_device, same_memory
from hf_lowzero.zero.runtime.ranges import profiler_range
from hf_lowzero.zero.runtime.shard_group import ShardGroup

SUM_DTYPE = torch.int64


class ExactReducer(BucketReducer):
    """Reduces buckets into this rank's int64 accumulator (see the module docstring).

    ``tap``: sees each int64 bucket packed and reduced (the integrity checks' exact checksums).
    ``average``: the step divides the exact sums by the number of contributions (backwards, over all
    ranks): the mean, for losses that are each micro-batch's own. False: no division, for losses
    already normalized over the whole step (the Trainer's token-count normalization).
    """

    def __init__(
        self,
        buckets: list[Bucket],
        *,
        stage: int,
        store: DeviceGradStore,
        pool: BufferPool,
        params: int,
        shard: ShardGroup,
        tap: ReductionTap = NO_TAP,
    ) -> None:
        super().__init__(buckets, comm_dtype=None, stage=stage, store=store, pool=pool, tap=tap, shard=shard)
        self.allows_no_sync = False
        self.no_sync_refusal = (
            "no_sync() is not available with reduction='exact': each micro-batch's gradient must be rounded "
            "to the fixed-point grid and summed in integers, not added to p.grad in floating point (that sum's "
            "rounding depends on how many micro-batches a rank runs, so on the world size). Call backward() "
            "for every micro-batch without no_sync()."
        )
        self._needs_workspace = [
            comm.uses_point_to_point(shard.group, b.packed_numel * SUM_DTYPE.itemsize) for b in buckets
        ]
        self.acc = torch.zeros(store.flat.numel(), dtype=SUM_DTYPE, device=store.flat.device)  # owned space
        self.packed = [Segments.packed(b) for b in buckets]
        self.owned = [Segments.owned(b, shard.rank) for b in buckets]
        names = {slot.index: slot.name for bucket in buckets for slot in bucket.slots}
        self._names = [names[i] for i in range(params)]  # by slot index
        self.grid = Grid.first(params)
        self.next_grid: Grid | None = None  # decided by the step, taken on by clear()
        self._factors = self._grid_factors()
        self.max_abs = torch.zeros(params, dtype=torch.float32, device=store.flat.device)  # of contributions
        self.contributions = 0  # backwards since the last step on this rank
        self.average = True

    def grid_state(self) -> dict:
        """The grid, for checkpoints: a resumed run (at any world size) rounds as the saved one would
        have. Bounds by parameter name."""
        state = self.grid.state_dict()
        return state | {"bounds": dict(zip(self._names, state["bounds"]))}

    def load_grid_state(self, state: dict) -> None:
        """Restore :meth:`grid_state`; a parameter it does not name keeps this run's bound."""
        bounds = [int(state["bounds"].get(name, bound)) for name, bound in zip(self._names, self.grid.bounds)]
        self.grid = Grid.from_state_dict(state | {"bounds": bounds})
        self.next_grid = None
        self._factors = self._grid_factors()

    def _grid_factors(self) -> list[list[float]]:
        exponents = self.grid.exponents()
        return [[2.0 ** exponents[i] for i in packed.slots] for packed in self.packed]

    def accumulator(self, bucket: Bucket) -> torch.Tensor:
        """This rank's int64 sums of ``bucket`` (1D, ``row_numel``): valid once ``holds``."""
        return bucket_view(self.acc, bucket)

    def launch(self, bucket: Bucket, grads: list | None = None) -> Reduction:
        """Pack ``bucket``'s gradients, round them to the grid in int64, free them, start the SUM."""
        first = not self.holds[bucket.index]
        if bucket.index == 0:  # every backward launches every bucket once
            self.contributions += 1
        taken = []
        values = self.pool.take(bucket.packed_numel, torch.float32, bucket.device)
        with profiler_range("hf_lowzero::pack_bucket"):
            pack_bucket(bucket, values, world_size=1, plan=self.pack_plans[bucket.index], grads=grads, divide=False)
        with profiler_range("hf_lowzero::quantize"):
            direct = self.accumulator(bucket) if first else None
            if self.shard.world_size == 1:  # no collective: into the accumulator, or added to it
                quantized = self.accumulator(bucket)
            else:
                quantized = self.take(bucket.packed_numel, SUM_DTYPE, bucket.device, taken)
            adding = self.shard.world_size == 1 and not first  # int64 sums: exact in any order
            # times the grid's power of two (exact), truncated toward zero: [Note: exact reduction]
            quantize(
                self.packed[bucket.index], values, self._factors[bucket.index], self.max_abs, quantized, add=adding
            )
        self.pool.give(values)
        if self.shard.world_size == 1:
            return Reduction(bucket, None, quantized, tuple(taken))
        self.tap.after_pack(bucket, quantized)  # the int64 values sent ([Note: exact checksums] in integrity/)
        return self.start(bucket, quantized, direct, taken)

    def finish(self, reduction: Reduction) -> None:
        bucket = reduction.bucket
        with profiler_range("hf_lowzero::reduce_wait"):
            comm.wait(reduction.work)
        if self.shard.world_size > 1:
            self.tap.after_reduce(bucket, reduction.out)  # this micro-batch's int64 sums, before accumulating
        sums = self.accumulator(bucket)
        if not same_memory(reduction.out, sums):
            sums.add_(reduction.out) if self.holds[bucket.index] else sums.copy_(reduction.out)
        for buffer in reduction.buffers:
            self.pool.give(buffer)
        self.holds[bucket.index] = True

    def buffer_bytes(self) -> Counter:
        return bytes_by_device([*self.store.tensors(), self.acc])

    def clear(self) -> None:
        """Forget all gradients; the grid the last step decided on takes effect."""
        super().clear()
        if self.next_grid is not None:
            self.grid, self.next_grid = self.next_grid, None
            self._factors = self._grid_factors()
        self.max_abs.zero_()
        self.contributions = 0
