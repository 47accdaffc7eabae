"""LowLevelZeroOptimizer: ZeRO stage 1 and 2 around any element-wise torch optimizer.

Example::

    model = build_model()
    opt = LowLevelZeroOptimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), stage=2)
    for batch in loader:
        opt.backward(model(**batch).loss)
        opt.step()
        opt.zero_grad()

Lifecycle of one step (DESIGN.md section 3):

1. backward: a post-accumulate-grad hook marks each param ready; complete buckets are launched in
   plan order (see [Note: bucket order]); at the end of backward the rest are launched with zeros
   for missing gradients, and every collective is waited for.
2. step: one all-reduce of ``[sum of squared grad rows, per-param used flags]`` gives the global
   norm and which params were used on any rank. A non-finite norm means some rank overflowed:
   every rank sees the same sum, so every rank skips the same step. Otherwise masked params get
   ``grad=None`` so the inner optimizer skips them, the rows are unscaled and clipped in one
   multiply, the inner optimizer updates the fp32 master rows, and the updated rows are
   all-gathered (bucketed, in the params' dtype) back into the model's params.

Mixed precision: cast the model to fp16/bf16 *before* wrapping; master rows are always fp32 and
only the owner holds them. fp16 gets dynamic loss scaling (``opt.backward`` scales); bf16/fp32
are not scaled but non-finite steps are still skipped and counted (``skipped_steps``).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hf_lowzero.config import ZeroConfig
from hf_lowzero.zero import checkpoint, comm
from hf_lowzero.zero.buckets import BucketState, ParamSlot, PlanOrderLauncher, plan_buckets
from hf_lowzero.zero.inner import check_inner_optimizer
from hf_lowzero.zero.loss_scaler import ConstantScale, DynamicLossScaler
from hf_lowzero.zero.memory import MemoryReport, tensor_bytes
from hf_lowzero.zero.partition import ParamShard
from hf_lowzero.zero.stages import MASTER_DTYPE, AllReduceGrads, ReduceScatterGrads

_HOOK_DICTS = (
    "_optimizer_step_pre_hooks",
    "_optimizer_step_post_hooks",
    "_optimizer_state_dict_pre_hooks",
    "_optimizer_state_dict_post_hooks",
    "_optimizer_load_state_dict_pre_hooks",
    "_optimizer_load_state_dict_post_hooks",
)
_MAX_IN_FLIGHT = 2  # buckets reducing or gathering at once; bounds transient buffer memory


class LowLevelZeroOptimizer(torch.optim.Optimizer):
    """Shards ``optimizer``'s state (stage 1) and gradients (stage 2) of ``model`` over ranks.

    ``optimizer`` must be a fresh element-wise torch optimizer over ``model``'s trainable params.
    Its ``param_groups`` keep their number, order and hyperparameters but hold this rank's fp32
    master rows; ``self.param_groups`` *is* that list, so LR schedulers work unchanged.

    Gradients live in the optimizer's buckets and rows, not in ``p.grad``: after a synchronized
    backward every managed ``p.grad`` is None. ``step()`` consumes and clears them.
    """

    def __init__(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, config: ZeroConfig | None = None, **overrides
    ) -> None:
        self.config = (config or ZeroConfig()).with_overrides(**overrides)
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "LowLevelZeroOptimizer needs torch.distributed: call "
                "torch.distributed.init_process_group(...) first (a world of size 1 works)."
            )
        check_inner_optimizer(optimizer, self.config.allow_untested_optimizer)
        self.optim = optimizer
        self.model = model
        self.group = self.config.process_group
        self.world_size = comm.group_size(self.group)
        self.rank = comm.group_rank(self.group)

        self.slots = _managed_slots(model, optimizer, self.world_size)
        self.buckets = plan_buckets(self.slots, self.config.reduce_bucket_bytes, self.config.communication_dtype)
        device = self.slots[0].param.device
        total_row_numel = sum(b.row_numel for b in self.buckets)
        sync_args = (self.buckets, self.group, self.rank, self.world_size, self.config.communication_dtype)
        if self.config.stage == 1:
            self.grad_sync = AllReduceGrads(*sync_args)
        else:
            self.grad_sync = ReduceScatterGrads(*sync_args, total_row_numel=total_row_numel, device=device)
        self._launcher = PlanOrderLauncher(
            self.buckets, self.grad_sync.launch, self.grad_sync.finish, max_in_flight=_MAX_IN_FLIGHT
        )

        # 1D fp32, the owned-rows space (bucket after bucket); one view per param below.
        self.flat_master_rows = torch.zeros(total_row_numel, dtype=MASTER_DTYPE, device=device)
        self.master_rows = [self._row_view(self.flat_master_rows, slot) for slot in self.slots]
        self._init_master_rows()
        slot_of = {id(slot.param): slot for slot in self.slots}
        for group in optimizer.param_groups:
            group["params"] = [self.master_rows[slot_of[id(p)].index] for p in group["params"]]

        self._locally_used = [False] * len(self.slots)  # got a gradient on this rank since the last step
        self._sync_enabled = True
        self._unsynced_local_grads = False  # stage 1: a no_sync backward left grads in p.grad
        self._end_of_backward_queued = False
        self._sync_count = 0
        self.last_grad_norm: float | None = None
        self.last_step_applied: bool | None = None
        self._pending_norm = None  # (grad rows, scaled norm, used flags) once computed for this step
        self.scaler = _make_scaler(self.config, {slot.param.dtype for slot in self.slots})
        self.skipped_steps = 0
        self._consecutive_skips = 0
        self._hook_handles = [
            slot.param.register_post_accumulate_grad_hook(self._make_hook(slot)) for slot in self.slots
        ]

        # Not Optimizer.__init__: it would build param groups of its own. We share the inner
        # optimizer's groups and state instead, and set up the hook tables Optimizer expects.
        self.defaults = optimizer.defaults
        for name in _HOOK_DICTS:
            setattr(self, name, OrderedDict())
        self._patch_step_function()

    # ----------------------------------------------------------------- torch.optim.Optimizer API

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optim.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.optim.param_groups = groups

    @property
    def state(self):
        return self.optim.state

    @state.setter
    def state(self, value) -> None:
        self.optim.state = value

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise RuntimeError(
            "LowLevelZeroOptimizer cannot add param groups after construction (the bucket plan is "
            "static); build the inner optimizer with every group before wrapping it."
        )

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard: inner optimizer state plus loss-scaler state (local, no communication)."""
        return {
            "inner": self.optim.state_dict(),
            "loss_scaler": self.scaler.state_dict(),
            "skipped_steps": self.skipped_steps,
            "consecutive_skips": self._consecutive_skips,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict produced by :meth:`state_dict` on the same rank and world size."""
        if not isinstance(state_dict, dict) or "inner" not in state_dict or "loss_scaler" not in state_dict:
            raise ValueError(
                "not a LowLevelZeroOptimizer state dict (expected keys 'inner' and 'loss_scaler'); "
                "use load_checkpoint() for sharded checkpoints saved at another world size"
            )
        self.optim.load_state_dict(state_dict["inner"])
        self.scaler.load_state_dict(state_dict["loss_scaler"])
        self.skipped_steps = int(state_dict["skipped_steps"])
        self._consecutive_skips = int(state_dict["consecutive_skips"])

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop every gradient: ``p.grad`` of managed params, bucket contents and gradient rows."""
        for slot in self.slots:
            slot.param.grad = None
        self.grad_sync.clear()
        self._locally_used = [False] * len(self.slots)
        self._unsynced_local_grads = False
        self._pending_norm = None

    # -------------------------------------------------------------------------- checkpoints

    def save_checkpoint(self, path: str | os.PathLike) -> Path:
        """Write this optimizer's sharded state to directory ``path``, atomically. Collective."""
        return checkpoint.save_checkpoint(self, path)

    def load_checkpoint(self, path: str | os.PathLike) -> dict[str, Any]:
        """Load a checkpoint saved at any world size (validated first; collective) and copy the
        loaded master weights into the model's params."""
        return checkpoint.load_checkpoint(self, path)

    def full_state_dict(self) -> dict[str, Any] | None:
        """The full (unsharded) inner-optimizer state in torch's format on rank 0. Collective."""
        return checkpoint.full_state_dict(self)

    # ----------------------------------------------------------------------------- backward

    def backward(self, loss: torch.Tensor, **backward_kwargs) -> None:
        """``loss.backward()`` with loss scaling (fp16) and gradient synchronization.

        Also synchronizes on a rank where no parameter got a gradient, so no peer waits forever.
        """
        syncs_before = self._sync_count
        if self.scaler.scale != 1.0:
            loss = loss.float() * self.scaler.scale  # in fp32: a scaled fp16 loss would overflow
        loss.backward(**backward_kwargs)
        if self._sync_enabled and self._sync_count == syncs_before:
            # No hook fired on this rank, so no end-of-backward callback was queued; the other
            # ranks still launch every bucket, so this rank must too.
            self._synchronize()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Stage 1: accumulate gradients locally in ``p.grad`` with no communication.

        The first backward outside the context reduces the accumulated total once.
        """
        if not self.grad_sync.allows_no_sync:
            raise RuntimeError(
                "no_sync() is not available with ZeRO stage 2: gradients are sharded, so every "
                "backward must reduce-scatter into the owned rows (keeping full local gradients "
                "would undo stage 2's memory savings). Call backward() for every micro-batch "
                "without no_sync(), or use stage=1."
            )
        previous = self._sync_enabled
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def _make_hook(self, slot: ParamSlot):
        def hook(_param: torch.Tensor) -> None:
            self._on_grad_ready(slot)

        return hook

    def _on_grad_ready(self, slot: ParamSlot) -> None:
        self._pending_norm = None  # new gradients: a norm computed earlier is stale
        self._locally_used[slot.index] = True
        if not self._sync_enabled:
            self._unsynced_local_grads = True
            return
        bucket = self.buckets[slot.bucket_index]
        if bucket.state is not BucketState.WAITING:
            raise RuntimeError(
                f"gradient of {slot.name!r} arrived after its bucket was already reduced in this "
                "backward (a parameter reached twice through reentrant autograd?). Use "
                "non-reentrant activation checkpointing (use_reentrant=False)."
            )
        if not self._end_of_backward_queued:
            self._end_of_backward_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        self._launcher.mark_ready(slot)
        if self.config.overlap_communication:
            self._launcher.launch_ready()

    def _end_of_backward(self) -> None:
        self._end_of_backward_queued = False
        self._synchronize()

    def _synchronize(self) -> None:
        """Launch every bucket not yet launched in this backward, in plan order, and wait."""
        self._launcher.launch_all(self.config.overlap_communication)
        self._unsynced_local_grads = False
        self._sync_count += 1

    # --------------------------------------------------------------------------------- step

    @torch.no_grad()
    def step(self, closure=None) -> bool:
        """Apply one update from the gradients gathered since the last step.

        Returns True when applied, False when skipped because some rank's gradients were not
        finite (every rank skips together). A skipped step changes no param, master row,
        optimizer state or step counter; its gradients are discarded either way.
        """
        if closure is not None:
            raise TypeError("LowLevelZeroOptimizer.step() does not support a closure")
        grad_rows, scaled_norm, used = self._norm_and_usage()
        self._pending_norm = None
        if not math.isfinite(scaled_norm):
            self.last_step_applied = self._skip_step()
            return False

        # [Note: one multiply] unscaling and clipping are one factor applied once to each row.
        clip = self.config.clip_grad_norm
        clip_coef = min(1.0, clip / (self.last_grad_norm + 1e-6)) if clip > 0 else 1.0
        coef = clip_coef / self.scaler.scale
        for bucket, rows in zip(self.buckets, grad_rows):
            if rows is not None and coef != 1.0:
                rows.mul_(coef)
            for slot in bucket.slots:
                applied = used[slot.index] and rows is not None
                self.master_rows[slot.index].grad = self._row_view(rows, slot, bucket.row_offset) if applied else None
        self.optim.step()
        for master in self.master_rows:
            master.grad = None
        self._gather_params()
        self.scaler.update(overflow=False)
        self._consecutive_skips = 0
        self.zero_grad()
        self.last_step_applied = True
        return True

    def grad_norm(self) -> float:
        """Global L2 norm of this step's averaged, unscaled gradients (before clipping). Collective.

        For callers that log the norm before ``step()`` (as ``transformers.Trainer`` does); the
        result is cached, so the following ``step()`` does not communicate it again.
        """
        self._norm_and_usage()  # sets last_grad_norm
        return self.last_grad_norm

    def _norm_and_usage(self):
        if self._pending_norm is None:
            if self._unsynced_local_grads:
                self._synchronize()  # stage 1: every backward of this step ran under no_sync()
            grad_rows = [self.grad_sync.grad_rows(bucket) for bucket in self.buckets]
            scaled_norm, used = self._global_norm_and_usage(grad_rows)
            self.last_grad_norm = scaled_norm / self.scaler.scale
            self._pending_norm = (grad_rows, scaled_norm, used)
        return self._pending_norm

    def _global_norm_and_usage(self, grad_rows: list[torch.Tensor | None]) -> tuple[float, list[bool]]:
        """One all-reduce: the global L2 norm of the (scaled) averaged gradients, and which params
        got a gradient on any rank (DDP's unused-parameter detection). Padding rows are zero, so
        the norm equals ``clip_grad_norm_`` over the full gradients; any inf/nan makes it non-finite."""
        stats = torch.zeros(1 + len(self.slots), dtype=MASTER_DTYPE, device=self.flat_master_rows.device)
        for rows in grad_rows:
            if rows is not None:
                stats[0] += rows.square().sum()
        stats[1:] = torch.tensor(self._locally_used, dtype=MASTER_DTYPE)
        comm.all_reduce(stats, self.group)
        stats = stats.cpu()
        return math.sqrt(stats[0].item()), (stats[1:] > 0).tolist()

    def _skip_step(self) -> bool:
        """Count a skipped step, back the loss scale off, discard the gradients; False, or raise
        when training can make no progress."""
        was_at_min_scale = self.scaler.at_min_scale
        self.skipped_steps += 1
        self._consecutive_skips += 1
        self.scaler.update(overflow=True)
        self.zero_grad()
        if was_at_min_scale:
            raise RuntimeError(
                f"gradients are not finite even at the minimum loss scale ({self.config.min_scale}); "
                f"{self.skipped_steps} steps skipped so far. The model itself produces inf/nan: lower "
                "the learning rate, enable clip_grad_norm, check the data, or train in bf16/fp32."
            )
        if self._consecutive_skips >= self.config.max_consecutive_skips:
            raise RuntimeError(
                f"{self._consecutive_skips} consecutive steps were skipped because gradients were not "
                f"finite (loss scale now {self.scaler.scale}); training is making no progress. Lower "
                "the learning rate, enable clip_grad_norm, check the data for inf/nan, or raise "
                "ZeroConfig.max_consecutive_skips if this is expected."
            )
        return False

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 unless the params are fp16)."""
        return self.scaler.scale

    @torch.no_grad()
    def _gather_params(self) -> None:
        """All-gather the updated master rows back into the model's params, bucket by bucket."""
        in_flight: list[tuple] = []

        def finish(bucket, out, work) -> None:
            comm.wait(work)
            for slot in bucket.slots:
                slot.shard.gather_from(slot.rows(out, bucket.row_numel), slot.param.view(-1))

        for bucket in self.buckets:
            rows = self.flat_master_rows[bucket.row_offset : bucket.row_offset + bucket.row_numel]
            out = torch.empty(self.world_size * bucket.row_numel, dtype=bucket.dtype, device=bucket.device)
            work = comm.all_gather(out, rows.to(bucket.dtype), self.group, async_op=True)
            in_flight.append((bucket, out, work))
            if len(in_flight) >= _MAX_IN_FLIGHT:
                finish(*in_flight.pop(0))
        for item in in_flight:
            finish(*item)

    # ------------------------------------------------------------------------------ helpers

    @staticmethod
    def _row_view(flat: torch.Tensor, slot: ParamSlot, base: int = 0) -> torch.Tensor:
        start = slot.row_offset - base
        return flat[start : start + slot.shard.shard_numel]

    @torch.no_grad()
    def _init_master_rows(self) -> None:
        for slot, master in zip(self.slots, self.master_rows):
            start, end = slot.shard.owned_range(self.rank)
            master[: end - start].copy_(slot.param.view(-1)[start:end])

    @property
    def managed_params(self) -> list[torch.nn.Parameter]:
        """The sharded params, in the model's registration order."""
        return [slot.param for slot in self.slots]

    def memory_report(self) -> MemoryReport:
        """Bytes this rank holds right now, measured from the live tensors."""
        managed = {id(slot.param) for slot in self.slots}
        return MemoryReport(
            params=tensor_bytes(self.model.parameters()),
            grads=tensor_bytes(p.grad for p in self.model.parameters() if id(p) in managed and p.grad is not None),
            grad_buffers=self.grad_sync.buffer_bytes(),
            master_rows=self.flat_master_rows.nbytes,
            optimizer_state=tensor_bytes(
                v for state in self.optim.state.values() for v in state.values() if isinstance(v, torch.Tensor)
            ),
            buffers=tensor_bytes(self.model.buffers()),
        )


def _make_scaler(config: ZeroConfig, dtypes: set[torch.dtype]) -> DynamicLossScaler | ConstantScale:
    """fp16 params need dynamic loss scaling; bf16 and fp32 do not."""
    if torch.float16 not in dtypes:
        return ConstantScale()
    return DynamicLossScaler.from_config(config)


def _managed_slots(model: torch.nn.Module, optimizer: torch.optim.Optimizer, world_size: int) -> list[ParamSlot]:
    """Validate that ``optimizer`` holds exactly ``model``'s trainable params; one slot each."""
    names = {id(p): n for n, p in model.named_parameters()}
    in_optimizer: set[int] = set()
    for i, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError(
                    f"optimizer param group {i} holds a tensor of shape {tuple(p.shape)} that is not a "
                    "parameter of the model; build the inner optimizer from model.parameters() (or "
                    "groups of them) of the same model you pass to LowLevelZeroOptimizer."
                )
            if not p.requires_grad:
                raise ValueError(
                    f"parameter {names[id(p)]!r} is in the optimizer but has requires_grad=False; "
                    "leave frozen parameters out of the optimizer."
                )
            in_optimizer.add(id(p))
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    missing = [n for n, p in trainable if id(p) not in in_optimizer]
    if missing:
        raise ValueError(
            f"model parameters {missing[:5]}{'...' if len(missing) > 5 else ''} require grad but are "
            "not in the optimizer; add them to a param group or set requires_grad=False."
        )
    if not trainable:
        raise ValueError("the model has no trainable parameters (none with requires_grad=True)")
    devices = {p.device for _, p in trainable}
    if len(devices) > 1:
        raise ValueError(f"all trainable parameters must be on one device, found {sorted(map(str, devices))}")
    for n, p in trainable:
        if not p.is_floating_point() or not p.is_contiguous():
            raise ValueError(f"parameter {n!r} must be a contiguous floating-point tensor (got {p.dtype})")
    return [
        ParamSlot(index=i, name=n, param=p, shard=ParamShard(p.numel(), world_size))
        for i, (n, p) in enumerate(trainable)
    ]
