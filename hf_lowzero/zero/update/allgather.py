"""The all-gather of the updated master rows back into the model's params, and the gate that every
reader of the params passes while gathers are in flight.

Example::

    gather = ParamGather(slots, buckets, master.flat, master.gate, pool=pool, defer=True, shard=shard)
    gather.issue()             # after the inner step: every bucket's gather in flight, forward order
    model(**batch)             # each module's first use waits for the gathers of what it reads (reads/)
    gather.wait_all()          # anything else that reads params: every gather landed

# [Note: overlapped all-gather]
# After a step every rank must see every updated param. ``issue`` starts one gather per bucket (an
# all-gather of the rows, or the uneven exchange of whole params: [Note: uneven exchanges] in
# ``runtime/comm.py``), in the order the next forward needs them: buckets are planned in reverse
# registration order ([Note: bucket order] in ``layout/buckets.py``), so the forward's order is the plan's
# reversed. It is the same on every rank, so the collectives match whatever each rank's forward does.
#
# With ``defer`` (``ZeroConfig.overlap_allgather``: off for the optimizer API, on in the Trainer
# and the Ray job, where every reader is known) nothing waits in the step: forward pre-hooks finish
# (wait for and unpack) the gathers of the buckets each module reads when the module is first
# called, so the next forward's first layers wait for their own bucket while the later buckets are
# still on the wire (ColossalAI's ``overlap_allgather``, FSDP2's prefetch). Which module waits for
# which bucket is learned from the reads the forward makes ([Note: every read waits] in
# ``reads/plan.py``): a module's own forward is too small a unit. On a GPU the wait is a stream wait,
# never a host sync. Every other reader of the params passes ``wait_all`` first ([Note: params are
# current]); the step passes it before it writes the masters the gathers read.
#
# A read the plan did not learn (a path first taken later) cannot go unnoticed: each backward
# records the buckets still pending when it begins (``stale_slots``: nothing in the forward waited
# for them), and a param of theirs that gets a gradient in that backward was read before its gather
# landed; the step then stops with an error on every rank, naming it, before the update. Pending
# gathers land at the step, after backward: landing during backward would change tensors autograd
# saved from the stale read. The GPU simulation (``hf_lowzero.simulation``) fails any read of a
# param whose gather is pending, naming it.
#
# Memory: until the forward reaches them, every bucket's gathered buffer is alive at once (one copy
# of the trainable params in their dtype, and with 16-bit params a 16-bit copy of this rank's rows),
# at a point where the step's activations are freed; each is released as its bucket is unpacked.
# Without ``defer`` at most MAX_GATHERS_IN_FLIGHT are alive, all waited inside the step.

# [Note: rows sent as stepped]
# With offload the host kernel steps the rows bucket by bucket, in the order ``issue`` sends them
# (``host/adam_step.py``). As each bucket is done, ``upload`` starts its copy to the device
# (non-blocking, from pinned memory, on the compute stream), so it overlaps the host's step of the
# next bucket; ``_start`` then finds the rows already sent. Where the kernel also wrote the params'
# 16-bit copy (``ParamCopy``, fresh for this step only), that copy is what is sent (half the bytes of
# fp32) and no cast is left to do, on the host (the CPU) or on the device. The host rows are read
# by those copies: ``issue`` registers them with the write gate as before.

# [Note: params are current]
# Reads of params outside the training forward wait for every gather first: ``model.state_dict()``
# and ``model.load_state_dict()`` (pre-hooks on each module holding a managed param: a loaded
# weight must not be overwritten by a gather landing later), the optimizer's ``state_dict()`` and every
# writer of the shard, the step (before the masters the gathers read change), checkpoints,
# snapshots and exports (they go through ``state_dict()``), and in the Trainer evaluation,
# prediction, saving, the callbacks of each event (``trainer/trainer.py``) and TRL's weight syncs to
# vLLM (``trainer/weight_sync.py``). Code that uses the optimizer alone and reads params between
# ``step()`` and the next forward calls ``LowLevelZeroOptimizer.wait_for_params()``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_lowzero.zero.host.adam_step import ParamCopy
from hf_lowzero.zero.layout.buckets import Bucket
from hf_lowzero.zero.layout.packing import UnpackPlan, bucket_view, unpack_bucket, unpack_targets
from hf_lowzero.zero.layout.params import ParamSlot
from hf_lowzero.zero.runtime import comm
from hf_lowzero.zero.runtime import device as dev
from hf_lowzero.zero.runtime.buffers import BufferPool
from hf_lowzero.zero.runtime.ranges import profiler_range
from hf_lowzero.zero.runtime.shard_group import ShardGroup
from hf_lowzero.zero.update.write_gate import WriteGate

MAX_GATHERS_IN_FLIGHT = 2  # without deferral: bounds the transient all-gather buffers


@dataclass(frozen=True, eq=False)
class Gather:
    """A bucket's gather back into the params in flight: what to wait for and what it reads and
    writes, until it is unpacked."""

    bucket: Bucket
    work: object
    chunk: torch.Tensor  # this rank's updated chunk, in the params' dtype
    out: torch.Tensor  # every rank's chunks, rank-major
    copied: bool  # chunk is a copy of the master rows (goes back to the pool), not the rows themselves


class ParamGather:
    """Gathers the master rows (``flat``, in the owned space) into the params of ``slots``, bucket
    by bucket ([Note: overlapped all-gather]). ``gate``: the shard's write gate, told about the
    device's reads of host-resident (offloaded) rows."""

    def __init__(
        self,
        slots: list[ParamSlot],
        buckets: list[Bucket],
        flat: torch.Tensor,
        gate: WriteGate,
        *,
        pool: BufferPool,
        defer: bool,
        shard: ShardGroup,
        copy: ParamCopy | None = None,
    ) -> None:
        self.slots, self.buckets, self.flat, self.gate = slots, buckets, flat, gate
        self.shard, self.pool = shard, pool
        self.copy = copy  # the rows in the params' dtype, from the host kernel ([Note: rows sent as stepped])
        self._uploaded: dict[int, torch.Tensor] = {}  # bucket index -> its rows already sent to the device
        self.defer = defer and shard.world_size > 1  # one rank gathers nothing: the copy is the unpack
        self.pending: dict[int, Gather] = {}  # bucket index -> its gather in flight (deferred)
        self._targets: list[UnpackPlan] = [unpack_targets(b, world_size=shard.world_size) for b in buckets]
        self._params = [[s.param for s in b.slots] for b in buckets]
        self._names = [[s.name for s in b.slots] for b in buckets]
        self._hooks: list = []

    # -------------------------------------------------------------------------------- issue

    @torch.no_grad()
    def issue(self, defer: bool | None = None) -> None:
        """Start every bucket's gather, in forward order. Deferred (``self.defer``, or ``defer``
        given): return with them in flight; otherwise wait for each (at most
        MAX_GATHERS_IN_FLIGHT at once) and return with the params current."""
        self.wait_all()  # a gather never overlaps the next one into the same params
        defer = self.defer if defer is None else defer and self.shard.world_size > 1
        in_flight: list[Gather] = []
        with dev.phase("gather"):
            for bucket in reversed(self.buckets):  # the forward's order ([Note: overlapped all-gather])
                gather = self._start(bucket)
                if gather is None:
                    continue
                if defer:
                    self.pending[bucket.index] = gather
                    continue
                in_flight.append(gather)
                if len(in_flight) >= MAX_GATHERS_IN_FLIGHT:
                    self._finish(in_flight.pop(0))
            for gather in in_flight:
                self._finish(gather)
        if self.flat.device != self.shard.device:  # host rows were read by copies on the device's stream
            self.gate.read_by(dev.record_event(dev.current_stream(self.shard.device)))
        if self.copy is not None:
            self.copy.fresh = False  # read: the next writer of the masters may not keep it current
        self._uploaded.clear()

    def upload(self, bucket_index: int) -> None:
        """[Note: rows sent as stepped]: bucket ``bucket_index``'s rows are final; start their copy
        to the device now (a no-op where the rows already are on the params' device)."""
        bucket = self.buckets[bucket_index]
        if self._host_rows(bucket).device != bucket.device:
            self._uploaded[bucket_index] = self._host_rows(bucket).to(bucket.device, non_blocking=True)

    def _host_rows(self, bucket: Bucket) -> torch.Tensor:
        fresh = self.copy is not None and self.copy.fresh and self.copy.flat.dtype == bucket.dtype
        return bucket_view(self.copy.flat if fresh else self.flat, bucket)

    def _start(self, bucket: Bucket) -> Gather | None:
        master_rows = self._host_rows(bucket)
        rows = self._uploaded.pop(bucket.index, None)
        rows = master_rows.to(bucket.device, non_blocking=True) if rows is None else rows
        if rows.dtype != bucket.dtype:
            rows = self.pool.take(bucket.row_numel, bucket.dtype, bucket.device).copy_(rows)
        copied = rows is not master_rows  # identity, not data_ptr(): this runs under FakeTensorMode too
        if self.shard.world_size == 1:  # the rows are the whole params: nothing to gather
            with profiler_range("hf_lowzero::unpack_bucket"):
                unpack_bucket(bucket, rows, world_size=1, targets=self._targets[bucket.index])
            if copied:
                self.pool.give(rows)
            return None
        out = self.pool.take(bucket.packed_numel, bucket.dtype, bucket.device)
        if not bucket.whole:
            work = comm.all_gather(out, rows, self.shard.group, async_op=True)
        else:
            work = comm.gather_from_owners(out, rows, list(bucket.chunks), self.shard.group, async_op=True)
        dev.mark_stale(self._params[bucket.index], self._names[bucket.index])
        return Gather(bucket, work, rows, out, copied)

    def _finish(self, gather: Gather) -> None:
        with profiler_range("hf_lowzero::all_gather_wait"):
            comm.wait(gather.work)  # chunk and out stay referenced until here
        bucket = gather.bucket
        dev.mark_current(self._params[bucket.index])
        with profiler_range("hf_lowzero::unpack_bucket"):
            unpack_bucket(bucket, gather.out, world_size=self.shard.world_size, targets=self._targets[bucket.index])
        # The unpack read ``out`` on the stream current now (the forward's, maybe a side stream): the
        # allocator must not hand its memory to the stream it was made on before that read is done.
        dev.keep_alive(gather.out, dev.current_stream(bucket.device))
        self.pool.give(gather.out)
        if gather.copied:
            self.pool.give(gather.chunk)

    # --------------------------------------------------------------------------------- wait

    @torch.no_grad()
    def wait(self, indices: tuple[int, ...]) -> None:
        """Finish the pending gathers of buckets ``indices`` (a module's, at its first forward use)."""
        if not self.pending:
            return
        with dev.phase("gather"):
            for index in indices:
                gather = self.pending.pop(index, None)
                if gather is not None:
                    self._finish(gather)

    @torch.no_grad()
    def wait_all(self) -> None:
        """[Note: params are current]: finish every pending gather, in the order they were issued."""
        if not self.pending:
            return
        pending, self.pending = self.pending, {}
        with dev.phase("gather"):
            for gather in pending.values():
                self._finish(gather)

    def stale_slots(self) -> list[int]:
        """Slot indices of the params whose gathers are still pending (see [Note: overlapped all-gather])."""
        return [slot.index for index in self.pending for slot in self.buckets[index].slots]


def stale_read_message(names: list[str], *, rank: int) -> str:
    """The error of a step whose forward read params before their gathers landed (``names``: this
    rank's; none: another rank's)."""
    where = (
        f"on rank {rank}, {names[:5]}{'...' if len(names) > 5 else ''} got gradients although"
        if names
        else "on another rank (its error names them), params got gradients although"
    )
    return (
        f"{where} their all-gather was still in flight when backward began: the forward read them on a path its "
        "kind of forward had not taken when the wait plan was learned, so it used the previous step's values (see "
        "[Note: every read waits] in hf_lowzero/zero/reads/plan.py). Nothing was updated. Call "
        "LowLevelZeroOptimizer.wait_for_params() before such a forward, switch on check_param_reads to find the "
        "read, or pass overlap_allgather=False (Trainer: --zero_overlap_allgather false)."
    )
