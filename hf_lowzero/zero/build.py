"""How a ``LowLevelZeroOptimizer`` is put together: every part made once, in the order the data
flows (docs/architecture.md), each given the one ``ShardGroup`` by keyword.

Example::

    parts = build_parts(model, inner_optimizer, ZeroConfig(stage=2), partition="rows")
    parts.sync, parts.reducer, parts.gather      # what the optimizer drives, step after step
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from hf_lowzero.zero.exact import ExactReducer, ExactStepStats, use_row_invariant_kernels
from hf_lowzero.zero.grads.backward import BackwardSync
from hf_lowzero.zero.grads.grad_store import make_grad_store
from hf_lowzero.zero.grads.reducer import BucketReducer
from hf_lowzero.zero.grads.replicated import replicates
from hf_lowzero.zero.host.adam_step import HostAdamStep, make_host_step
from hf_lowzero.zero.inner.adopt import adopt_inner_optimizer
from hf_lowzero.zero.inner.groups import ParamGroups
from hf_lowzero.zero.inner.policy import prefer_fused_on_cpu
from hf_lowzero.zero.inner.shard_state import ShardParts
from hf_lowzero.zero.integrity.checker import IntegrityChecker, hashed_tensors
from hf_lowzero.zero.layout.buckets import Bucket, plan_buckets
from hf_lowzero.zero.layout.packing import inner_view
from hf_lowzero.zero.layout.params import ParamSlot, WrapGuard, managed_slots
from hf_lowzero.zero.reads import WaitPlan, WatchedParam
from hf_lowzero.zero.runtime import comm
from hf_lowzero.zero.runtime.buffers import BufferPool
from hf_lowzero.zero.runtime.shard_group import ShardGroup
from hf_lowzero.zero.update.allgather import ParamGather
from hf_lowzero.zero.update.loss_scaler import ConstantScale, DynamicLossScaler, make_scaler
from hf_lowzero.zero.update.master import MasterRows
from hf_lowzero.zero.update.master_precision import Bf16Masters, FullPrecisionMasters, make_master_precision
from hf_lowzero.zero.update.step import SkipCounts, StepStats, UnusedMask
from hf_lowzero.zero.zero_config import ZeroConfig

CHECK_ENV = "HF_LOWZERO_CHECK_PARAM_READS"  # "1": check_param_reads on, whatever the config says


@dataclass(frozen=True, eq=False)
class OptimizerParts:
    """Everything a ``LowLevelZeroOptimizer`` is made of, fixed at construction, in data-flow order."""

    shard: ShardGroup
    slots: list[ParamSlot]  # the managed params, in registration order
    buckets: list[Bucket]  # the static plan
    guard: WrapGuard  # [Note: params are fixed at wrap time]
    integrity: IntegrityChecker  # taps the reductions, checks at the step
    reducer: BucketReducer  # buckets into this rank's gradient store
    sync: BackwardSync  # backward's hooks and flushes
    stats: StepStats  # the step's one host sync
    master: MasterRows
    precision: FullPrecisionMasters | Bf16Masters
    gather: ParamGather  # the masters back into the params
    reads: WaitPlan | None  # where the next forward waits for the gathers (overlap_allgather)
    host_step: HostAdamStep | None  # host-memory masters: our host kernel where it is exact, else None
    inner_params: list[torch.Tensor | None]  # per slot ([Note: inner params] in inner/adopt.py)
    unused_mask: UnusedMask
    groups: ParamGroups  # [Note: two sets of param groups]
    slot_at: list[ParamSlot]  # by torch's position: groups in order, params in order
    scaler: DynamicLossScaler | ConstantScale
    counts: SkipCounts
    shard_state: ShardParts  # what state_dict() saves and load_state_dict() restores


def build_parts(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, config: ZeroConfig, partition: str
) -> OptimizerParts:
    """The parts of a ``LowLevelZeroOptimizer`` over ``model``'s trainable params.

    ``optimizer`` is re-pointed at this rank's inner params ([Note: inner params] in
    ``inner/adopt.py``); ``model`` gets the gradient hooks and the all-gather's forward pre-hooks.

    Args:
        model: The model whose trainable params ``optimizer`` holds.
        optimizer: A fresh inner optimizer over exactly those params.
        config: The configuration.
        partition: ``"rows"`` or ``"params"`` (``inner.policy.partition_for``).

    Returns:
        The parts, wired together.
    """
    group = config.process_group
    world_size = comm.group_size(group)
    slots = managed_slots(model, optimizer, world_size=world_size, whole=partition == "params")
    device = slots[0].param.device
    shard = ShardGroup(group=group, rank=comm.group_rank(group), world_size=world_size, device=device)
    buckets = plan_buckets(slots, config.reduce_bucket_bytes, config.communication_dtype, rank=shard.rank)
    offload, pin = config.offload_optimizer, config.pin_memory
    pool = BufferPool()  # communication scratch shared by the reduce-scatters and all-gathers
    integrity = IntegrityChecker(
        buckets, hashed_tensors(model), comm_dtype=config.communication_dtype, every=config.verify_every,
        on_mismatch=config.on_mismatch, shard=shard, exact=config.reduction == "exact",
    )  # fmt: skip
    store = make_grad_store(buckets, offload=offload, pin_memory=pin, shard=shard)
    exact = config.reduction == "exact"  # [Note: exact reduction]; checked by exact checksums
    if exact:
        use_row_invariant_kernels(optimizer, partition, device)  # exact/kernels.py
        reducer = ExactReducer(
            buckets, stage=config.stage, store=store, pool=pool, params=len(slots), shard=shard, tap=integrity,
        )  # fmt: skip
    else:
        reducer = BucketReducer(
            buckets, comm_dtype=config.communication_dtype, stage=config.stage, store=store, pool=pool,
            tap=integrity, shard=shard, replicated=replicates(buckets, stage=config.stage, shard=shard,
            offloaded=store.offloaded),
        )  # fmt: skip
    master = MasterRows(slots, buckets, offload=offload, pin_memory=pin, dtype=config.master_dtype, shard=shard)
    precision = make_master_precision(
        master.flat, slots, config.master_rounding, config.master_rounding_seed, shard=shard
    )
    host_step = None  # [Note: our kernel in torch's place]: fp32 masters in host memory, offloaded or not
    if master.flat.device.type == "cpu" and not exact and isinstance(precision, FullPrecisionMasters):
        host_step = make_host_step(
            optimizer, slots, buckets, precision.inner_params, master.flat, pin_for=device if pin else None,
            rows=store, keep_copy=offload,
        )  # fmt: skip
    gather = ParamGather(
        slots, buckets, master.flat, master.gate, pool=pool, defer=config.overlap_allgather, shard=shard,
        copy=host_step.copy if host_step else None,
    )  # fmt: skip
    reads = None
    if gather.defer:  # [Note: every read waits]: where the next forward waits for each bucket
        watched = [WatchedParam(s.name, s.param, s.bucket_index) for s in slots]
        reads = WaitPlan(model, watched, gather, check=config.check_param_reads or os.environ.get(CHECK_ENV) == "1")
        reads.attach()
    guard = WrapGuard(slots)
    sync = BackwardSync(
        slots, buckets, reducer, config.overlap_communication, guard=guard.check, pending=gather.stale_slots
    )

    # The inner optimizer steps the inner params, each with its fixed gradient view ([Note: inner params]).
    inner_params = precision.inner_params
    inner_grads = [inner_view(slot, store.piece(slot)) for slot in slots]
    if master.flat.device.type == "cpu" and not exact:  # see exact/kernels.py
        prefer_fused_on_cpu(optimizer)
    groups = ParamGroups(optimizer)
    slot_of = {id(slot.param): slot for slot in slots}
    slot_at = [slot_of[id(p)] for group in groups.outer for p in group["params"]]
    adopt_inner_optimizer(optimizer, slots, inner_params, inner_grads, rank=shard.rank)
    groups.freeze_sizes()

    scaler = make_scaler(config, {slot.param.dtype for slot in slots})
    counts = SkipCounts()
    shard_state = ShardParts(
        slot_at=slot_at, inner_params=inner_params, master_rows=master.rows, optim=optimizer, groups=groups,
        scaler=scaler, counts=counts, gate=master.gate, stage=config.stage, partition=partition, shard=shard,
        exact=reducer if exact else None,
    )  # fmt: skip
    stats = ExactStepStats(reducer, slots, shard=shard) if exact else StepStats(len(slots), shard=shard)
    return OptimizerParts(
        shard=shard, slots=slots, buckets=buckets, guard=guard, integrity=integrity, reducer=reducer, sync=sync,
        stats=stats, master=master, precision=precision, gather=gather, reads=reads, host_step=host_step,
        inner_params=inner_params, unused_mask=UnusedMask(inner_params, inner_grads), groups=groups,
        slot_at=slot_at, scaler=scaler, counts=counts, shard_state=shard_state,
    )  # fmt: skip
