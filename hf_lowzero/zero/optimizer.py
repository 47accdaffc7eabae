"""LowLevelZeroOptimizer: ZeRO stage 1 and 2 around any torch optimizer.

Example::

    model = build_model()
    opt = LowLevelZeroOptimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), stage=2)
    for batch in loader:
        opt.backward(model(**batch).loss)
        opt.step()
        opt.zero_grad()

Lifecycle of one step (docs/architecture.md, "The data path of one step"):

1. backward: a post-accumulate-grad hook marks each param ready; complete buckets are launched in
   plan order (see [Note: bucket order]); at the end of backward the rest are launched with zeros
   for missing gradients, and every collective is waited for (``backward.py``).
2. step: one all-reduce of ``[sum of squared gradients, per-param used flags]`` gives the global
   norm and which params were used on any rank. A non-finite norm means some rank overflowed:
   every rank sees the same sum, so every rank skips the same step. Otherwise masked params get
   ``grad=None`` so the inner optimizer skips them, the rows are unscaled and clipped in one
   multiply, the inner optimizer updates the fp32 master rows, and the updated rows are
   all-gathered (bucketed, in the params' dtype) back into the model's params.

``opt.param_groups`` hold the model's params; the inner optimizer's hold master rows (see
[Note: two sets of param groups] in ``groups.py``): slices of every param (row shards), or, with
whole-parameter ownership, the params this rank owns, whole and in their shape ([Note: two ways to
own a parameter] in ``partition.py``).
"""

from __future__ import annotations

import contextlib
import math
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import record_function

from hf_lowzero.zero import comm
from hf_lowzero.zero.backward import BackwardSync
from hf_lowzero.zero.buckets import plan_buckets
from hf_lowzero.zero.buffers import BufferPool
from hf_lowzero.zero.config import ZeroConfig
from hf_lowzero.zero.grad_store import make_grad_store
from hf_lowzero.zero.groups import HOOK_TABLES, NOT_HYPERPARAMETERS, ParamGroups
from hf_lowzero.zero.inner import (
    carry_bitsandbytes_overrides,
    has_taken_steps,
    partition_for,
    prefer_fused_on_cpu,
)
from hf_lowzero.zero.layout import holding_any
from hf_lowzero.zero.loss_scaler import make_scaler
from hf_lowzero.zero.master import MasterRows
from hf_lowzero.zero.memory import MemoryReport, bytes_by_device
from hf_lowzero.zero.norm import squared_norm
from hf_lowzero.zero.params import WrapGuard, managed_slots
from hf_lowzero.zero.reducer import BucketReducer
from hf_lowzero.zero.shard_state import SECTION, SHARD_FORMAT_VERSION, state_dict_error


class LowLevelZeroOptimizer(torch.optim.Optimizer):
    """Shards ``optimizer``'s state (stage 1) and gradients (stage 2) of ``model`` over ranks.

    ``optimizer`` must be a fresh torch optimizer over ``model``'s trainable params. Element-wise
    ones get row shards, any other whole-parameter ownership (``ZeroConfig.partition``).
    ``param_groups`` hold the model's params (see [Note: two sets of param groups]);
    ``state_dict()`` is torch's format for this rank's shard (see ``shard_state.py``).

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
        check_inner_optimizer(optimizer)
        self.partition = partition_for(
            optimizer, self.config.partition, self.config.allow_untested_optimizer
        )  # "rows" or "params"
        self.optim = optimizer
        self.model = model
        self.process_group = self.config.process_group
        self.world_size = comm.group_size(self.process_group)
        self.rank = comm.group_rank(self.process_group)

        self.slots = managed_slots(model, optimizer, self.world_size, whole=self.partition == "params")
        self.buckets = plan_buckets(
            self.slots, self.config.reduce_bucket_bytes, self.config.communication_dtype, self.rank
        )
        self._guard = WrapGuard(self.slots)
        self.device = self.slots[0].param.device
        offload, pin = self.config.offload_optimizer, self.config.pin_memory
        pool = BufferPool()  # communication scratch shared by the reduce-scatters and all-gathers
        self.reducer = BucketReducer(
            self.buckets,
            self.process_group,
            self.world_size,
            self.config.communication_dtype,
            self.config.stage,
            make_grad_store(self.buckets, self.device, offload, pin),
            pool,
        )
        self.master = MasterRows(
            self.slots, self.buckets, self.rank, self.world_size, self.process_group, self.device, offload, pin, pool
        )

        # Per slot: the tensor the inner optimizer steps (a master row, or an owned param's master
        # in its shape; None for a param owned elsewhere) and its gradient, fixed views of the stores.
        self._inner_params = [self._held(slot, self.master.rows[slot.index]) for slot in self.slots]
        self._inner_grads = [self._held(slot, self.reducer.store.piece(slot)) for slot in self.slots]
        for master, grad in zip(self._inner_params, self._inner_grads):
            if master is not None:
                master.grad = grad  # for good: a step masks the params used on no rank (_mask_unused)
        self._masked: set[int] = set()  # slots whose master.grad is None for the coming step
        if self.master.flat.device.type == "cpu":
            prefer_fused_on_cpu(optimizer)
        slot_of = {id(slot.param): slot for slot in self.slots}
        self._groups = ParamGroups(optimizer)
        self._slot_at = [slot_of[id(p)] for group in self._groups.outer for p in group["params"]]  # by position
        for group in optimizer.param_groups:
            slots = [slot_of[id(p)] for p in group["params"]]
            group["params"] = [self._adopt(optimizer, s) for s in slots if self._inner_params[s.index] is not None]
        carry_bitsandbytes_overrides(
            optimizer,
            {id(s.param): self._inner_params[s.index] for s in self.slots if self._inner_params[s.index] is not None},
        )
        self._group_sizes = (
            [len(g["params"]) for g in self._groups.outer],
            [len(g["params"]) for g in optimizer.param_groups],
        )

        self.scaler = make_scaler(self.config, {slot.param.dtype for slot in self.slots})
        self.skipped_steps = 0
        self.consecutive_skips = 0
        self.last_grad_norm: float | None = None
        self.last_step_applied: bool | None = None
        self._pending_norm = None  # (grad_version, reduced chunks, scaled norm, used flags) of this step
        self._sync = BackwardSync(
            self.slots,
            self.buckets,
            self.reducer,
            self.config.overlap_communication,
            guard=self._guard.check,
        )

        # Not Optimizer.__init__: it would build param groups and state of its own. The hook
        # tables are what Optimizer's step/state_dict wrappers and LR schedulers expect.
        self.defaults = optimizer.defaults
        for name in HOOK_TABLES:
            setattr(self, name, OrderedDict())
        self._patch_step_function()

    # ----------------------------------------------------------------- torch.optim.Optimizer API

    def _held(self, slot, row: torch.Tensor) -> torch.Tensor | None:
        """What the inner optimizer sees of ``row`` (this rank's piece of ``slot``): the row itself
        (row shards), the param's shape (owned whole), or None (owned by another rank)."""
        if not slot.shard.whole:
            return row
        return row.view(slot.param.shape) if slot.row_numel else None

    def _adopt(self, optimizer: torch.optim.Optimizer, slot) -> torch.Tensor:
        """The master that replaces ``slot``'s param in the inner optimizer. State the inner
        optimizer's constructor created for the param (Adagrad's ``sum``) moves to it: this rank's
        slice of each element-wise tensor, as the row slices the param, or the whole of it."""
        master = self._inner_params[slot.index]
        created = optimizer.state.pop(slot.param, None)
        if created:
            optimizer.state[master] = {key: self._piece_of(value, slot, master) for key, value in created.items()}
        return master

    def _piece_of(self, value, slot, master: torch.Tensor):
        if isinstance(value, torch.Tensor) and value.shape == slot.param.shape:
            return slot.shard.row_of(value, self.rank).to(self.master.flat).view(master.shape)
        return value.clone() if isinstance(value, torch.Tensor) else value

    def __getattr__(self, name: str) -> Any:
        # Public attributes of the inner optimizer that this class does not define (bitsandbytes'
        # ``mng``, an optimizer's own settings): code holding the optimizer Trainer built reaches
        # them as it would without ZeRO. Only reached when normal lookup failed.
        inner = self.__dict__.get("optim")
        if inner is None or name.startswith("_"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(inner, name)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The model's params in the inner optimizer's groups, with their (synced) hyperparameters."""
        self._groups.sync()
        return self._groups.outer

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self._groups.replace(groups)

    @property
    def state(self) -> dict[torch.Tensor, dict[str, Any]]:
        """The inner optimizer's state of this rank's rows, keyed by the model's params (read view)."""
        inner, held = self.optim.state, self._inner_params
        return {
            s.param: inner[held[s.index]] for s in self._slot_at if held[s.index] is not None and held[s.index] in inner
        }

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise RuntimeError(
            "LowLevelZeroOptimizer cannot add param groups after construction (the bucket plan is "
            "static); build the inner optimizer with every group before wrapping it."
        )

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard in torch's format, plus fp32 master rows, loss scaler and counters
        (``shard_state.py``). Local and cheap: no communication, no copies."""
        inner = self.optim.state
        state = {}
        for pos, slot in enumerate(self._slot_at):
            held = self._inner_params[slot.index]
            entry = inner.get(held) if held is not None else None
            if entry:
                state[pos] = dict(entry)
        groups, pos = [], 0
        for group in self.param_groups:  # synced
            n = len(group["params"])
            names = [s.name for s in self._slot_at[pos : pos + n]]
            groups.append(dict(group, params=list(range(pos, pos + n)), param_names=names))
            pos += n
        zero = {
            "format_version": SHARD_FORMAT_VERSION,
            "world_size": self.world_size,
            "rank": self.rank,
            "stage": self.config.stage,
            "partition": self.partition,
            "numels": [s.shard.numel for s in self._slot_at],
            "owners": [s.shard.owner for s in self._slot_at],
            "master_rows": {pos: self.master.rows[s.index] for pos, s in enumerate(self._slot_at)},
            "loss_scaler": self.scaler.state_dict(),
            "skipped_steps": self.skipped_steps,
            "consecutive_skips": self.consecutive_skips,
        }
        return {"state": state, "param_groups": groups, SECTION: zero}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore this rank's shard from :meth:`state_dict` of the same rank and world size.

        Validated before anything changes. Local: the model's params are not touched (restore
        them as with any torch optimizer, or call :meth:`copy_master_to_params`).
        """
        own = self.state_dict()[SECTION]
        expected = own | {"group_sizes": [len(g["params"]) for g in self.param_groups]}
        error = state_dict_error(state_dict, expected)
        if error is None and state_dict[SECTION]["loss_scaler"].get("kind") != own["loss_scaler"]["kind"]:
            error = (
                f"loss scaler {state_dict[SECTION]['loss_scaler'].get('kind')!r} saved, this optimizer uses "
                f"{own['loss_scaler']['kind']!r}: the params' dtype differs from the saved run's"
            )
        if error is not None:
            raise ValueError(f"LowLevelZeroOptimizer.load_state_dict: {error}")
        zero = state_dict[SECTION]
        with torch.no_grad():
            for pos, slot in enumerate(self._slot_at):
                self.master.rows[slot.index].copy_(zero["master_rows"][pos])
        saved_groups = state_dict["param_groups"]
        hyper = [{k: v for k, v in g.items() if k not in NOT_HYPERPARAMETERS} for g in saved_groups]
        # Positions of the params this rank holds, renumbered as the inner optimizer lists them.
        held = [pos for pos, s in enumerate(self._slot_at) if self._inner_params[s.index] is not None]
        inner_pos = {pos: i for i, pos in enumerate(held)}
        inner_groups = [
            dict(h, params=[inner_pos[p] for p in g["params"] if p in inner_pos]) for h, g in zip(hyper, saved_groups)
        ]
        state = {
            inner_pos[pos]: {k: self._in_shape(v, self._slot_at[pos]) for k, v in entry.items()}
            for pos, entry in state_dict["state"].items()
            if pos in inner_pos
        }
        self.optim.load_state_dict({"state": state, "param_groups": inner_groups})
        for group, h in zip(self._groups.outer, hyper):
            group.update(h)
        self._groups.sync()
        self.scaler.load_state_dict(zero["loss_scaler"])
        self.skipped_steps = int(zero["skipped_steps"])
        self.consecutive_skips = int(zero["consecutive_skips"])

    def _in_shape(self, value, slot):
        """A whole param's element-wise state saved flat (checkpoints store it 1D) in the param's shape."""
        if (
            slot.shard.whole
            and isinstance(value, torch.Tensor)
            and value.dim() == 1
            and value.numel() == slot.shard.numel
        ):
            return value.view(slot.param.shape)
        return value

    def train(self) -> None:
        """Schedule-free optimizers: switch the inner optimizer to its training point and write it
        into the params (collective). A no-op for optimizers without modes; ``Trainer`` calls it."""
        self._switch_mode("train")

    def eval(self) -> None:
        """Schedule-free optimizers: switch the inner optimizer to its evaluation point (the
        averaged weights) and write it into the params (collective). A no-op without modes."""
        self._switch_mode("eval")

    def _switch_mode(self, mode: str) -> None:
        switch = getattr(self.optim, mode, None)
        if callable(switch):
            switch()  # moves the masters this rank holds
            self.copy_master_to_params()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop every gradient: ``p.grad`` of managed params, bucket contents and gradient rows;
        also a backward that raised midway ([Note: failed backward])."""
        if holding_any(self._sync.params):  # after a step none does: skip the per-param loop
            for param in self._sync.params:
                param.grad = None
        self._forget_gradients()

    def _forget_gradients(self) -> None:
        self._sync.reset()
        self.reducer.clear()
        self._pending_norm = None

    def copy_master_to_params(self) -> None:
        """Write the fp32 master rows back into the model's params (all-gather, bucketed, in the
        params' dtype). Collective. ``step()`` does this itself; checkpoint loading calls it."""
        self.master.copy_to_params()

    def copy_params_to_master(self) -> None:
        """Re-read this rank's fp32 master rows from the model's params. Local.

        For code that loaded new weights into the model in place after wrapping (a Trainer resuming
        from a checkpoint without optimizer state, ``load_best_model_at_end``); optimizer state is
        kept. With 16-bit params the masters become the 16-bit values.
        """
        self.master.copy_from_params()

    def remove_hooks(self) -> None:
        """Detach from the model: remove the gradient hooks this optimizer put on its params.

        Call it before dropping an optimizer whose model lives on (rebuilding the optimizer for the
        same model); the optimizer must not be used afterwards.
        """
        for handle in self._sync.hook_handles:
            handle.remove()
        self._sync.hook_handles = []

    # ----------------------------------------------------------------------------- backward

    def backward(self, loss: torch.Tensor, **backward_kwargs) -> None:
        """``loss.backward()`` with loss scaling (fp16) and gradient synchronization.

        Synchronizes after autograd returns, also on a rank where no parameter got a gradient,
        so no peer waits forever.
        """
        self._sync.check_finished("run backward")
        self._guard.check()
        if self.scaler.scale != 1.0:
            loss = loss.float() * self.scaler.scale  # in fp32: a scaled fp16 loss would overflow
        self._sync.explicit = True
        try:
            loss.backward(**backward_kwargs)
        except BaseException:
            self._sync.failed = True  # [Note: failed backward]
            raise
        finally:
            self._sync.explicit = False
        if self._sync.enabled:
            self._sync.flush()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Stage 1: accumulate gradients locally in ``p.grad`` with no communication.

        The first backward outside the context reduces the accumulated total once.
        """
        if not self.reducer.allows_no_sync:
            raise RuntimeError(
                "no_sync() is not available with ZeRO stage 2: gradients are sharded, so every "
                "backward must reduce-scatter into the owned rows (keeping full local gradients "
                "would undo stage 2's memory savings). Call backward() for every micro-batch "
                "without no_sync(), or use stage=1."
            )
        previous = self._sync.enabled
        self._sync.enabled = False
        try:
            yield
        finally:
            self._sync.enabled = previous
            if previous:
                self._sync.mark_start()  # the gradients accumulated so far ([Note: one hook per bucket])

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
        self._sync.check_finished("step")
        self._guard.check()
        self._check_group_sizes()
        with record_function("hf_lowzero::grad_norm"):
            reduced, scaled_norm, used = self._norm_and_usage()
        if not math.isfinite(scaled_norm):
            self.last_step_applied = self._skip_step()
            return False

        # [Note: one multiply] unscaling and clipping are one factor applied once to each row.
        clip = self.config.clip_grad_norm
        clip_coef = min(1.0, clip / (self.last_grad_norm + 1e-6)) if clip > 0 else 1.0
        coef = clip_coef / self.scaler.scale
        if coef != 1.0:
            for chunk in reduced:
                if chunk is not None:
                    chunk.mul_(coef)
        self._mask_unused(used)
        self._groups.sync()
        with record_function("hf_lowzero::inner_step"):
            self.optim.step()
        with record_function("hf_lowzero::copy_master_to_params"):
            self.copy_master_to_params()
        self.scaler.update(overflow=False)
        self.consecutive_skips = 0
        self._forget_gradients()  # every p.grad was consumed by the flush
        self.last_step_applied = True
        return True

    def grad_norm(self) -> float:
        """Global L2 norm of this step's averaged, unscaled gradients (before clipping). Collective.

        For callers that log the norm before ``step()`` (as ``transformers.Trainer`` does); the
        result is cached, so the following ``step()`` does not communicate it again.
        """
        self._sync.check_finished("compute the gradient norm")
        self._norm_and_usage()  # sets last_grad_norm
        return self.last_grad_norm

    def _check_group_sizes(self) -> None:
        sizes = [len(g["params"]) for g in self._groups.outer]
        if (sizes, [len(g["params"]) for g in self.optim.param_groups]) != self._group_sizes:
            raise RuntimeError(
                f"opt.param_groups changed shape after wrapping (group sizes now {sizes}); the sharded "
                "optimizer's params are fixed at construction: edit hyperparameters only"
            )

    def _mask_unused(self, used: torch.Tensor) -> None:
        """Params used on no rank get no gradient: no update, no weight decay, no state. The
        masters' ``.grad`` are fixed views of the gradient store; only changes are written."""
        held = self._inner_params
        unused = {i for i in (~used).nonzero().flatten().tolist() if held[i] is not None}
        for index in self._masked - unused:
            held[index].grad = self._inner_grads[index]
        for index in unused - self._masked:
            held[index].grad = None
        self._masked = unused

    def _norm_and_usage(self):
        self._sync.flush_loose()  # [Note: one hook per bucket]: gradients no backward flushed
        if self._pending_norm is None or self._pending_norm[0] != self._sync.grad_version:
            reduced = [self.reducer.reduced(bucket) for bucket in self.buckets]
            scaled_norm, used = self._global_norm_and_usage(reduced)
            self.last_grad_norm = scaled_norm / self.scaler.scale
            self._pending_norm = (self._sync.grad_version, reduced, scaled_norm, used)
        return self._pending_norm[1:]

    def _global_norm_and_usage(self, reduced: list[torch.Tensor | None]) -> tuple[float, torch.Tensor]:
        """One all-reduce: the global L2 norm of the (scaled) averaged gradients, and which params
        got a gradient on any rank (bool per slot; DDP's unused-parameter detection). Padding rows
        are zero, so the norm equals ``clip_grad_norm_`` over the full gradients; any inf/nan makes
        it non-finite."""
        # Computed where the rows live (host memory with offload), reduced on the params' device;
        # fp32 block norms summed in float64 ([Note: blocked norm]).
        square_sum = squared_norm([chunk for chunk in reduced if chunk is not None]).reshape(1)
        used = self._sync.used.to(torch.float64)
        stats = torch.cat([square_sum.to(self.device), used.to(self.device)])
        comm.all_reduce(stats, self.process_group)
        stats = stats.cpu()
        return math.sqrt(stats[0].item()), stats[1:] > 0

    def _skip_step(self) -> bool:
        """Count a skipped step, back the loss scale off, discard the gradients; False, or raise
        when training can make no progress."""
        was_at_min_scale = self.scaler.at_min_scale
        self.skipped_steps += 1
        self.consecutive_skips += 1
        self.scaler.update(overflow=True)
        self.zero_grad()
        if was_at_min_scale:
            raise RuntimeError(
                f"gradients are not finite even at the minimum loss scale ({self.config.min_scale}); "
                f"{self.skipped_steps} steps skipped so far. The model itself produces inf/nan: lower "
                "the learning rate, enable clip_grad_norm, check the data, or train in bf16/fp32."
            )
        if self.consecutive_skips >= self.config.max_consecutive_skips:
            raise RuntimeError(
                f"{self.consecutive_skips} consecutive steps were skipped because gradients were not "
                f"finite (loss scale now {self.scaler.scale}); training is making no progress. Lower "
                "the learning rate, enable clip_grad_norm, check the data for inf/nan, or raise "
                "ZeroConfig.max_consecutive_skips if this is expected."
            )
        return False

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 unless the params are fp16)."""
        return self.scaler.scale

    # ------------------------------------------------------------------------------ helpers

    @property
    def managed_params(self) -> list[torch.nn.Parameter]:
        """The sharded params, in the model's registration order."""
        return [slot.param for slot in self.slots]

    def memory_report(self) -> MemoryReport:
        """Bytes this rank holds right now, per part and per device, measured from the live tensors."""
        managed = {id(slot.param) for slot in self.slots}
        state = (v for entry in self.optim.state.values() for v in entry.values() if isinstance(v, torch.Tensor))
        return MemoryReport.measure(
            params=bytes_by_device(self.model.parameters()),
            grads=bytes_by_device(p.grad for p in self.model.parameters() if id(p) in managed and p.grad is not None),
            grad_buffers=self.reducer.buffer_bytes(),
            master_rows=bytes_by_device([self.master.flat]),
            optimizer_state=bytes_by_device(state),
            buffers=bytes_by_device(self.model.buffers()),
            comm_buffers=bytes_by_device(self.reducer.pool.tensors()),
        )


def check_inner_optimizer(optimizer: object) -> None:
    """Raise a clear error unless ``optimizer`` is a fresh ``torch.optim.Optimizer`` (which way it
    can own state is ``choose_partition``'s question).

    Example::

        >>> check_inner_optimizer(torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))]))
    """
    cls = type(optimizer)
    if isinstance(optimizer, LowLevelZeroOptimizer):
        raise TypeError("the optimizer is already a LowLevelZeroOptimizer; pass its inner optimizer instead")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"expected a torch.optim.Optimizer instance, got {cls.__name__}")
    if has_taken_steps(optimizer):
        raise ValueError(
            f"{cls.__name__} already has state (it has taken steps); wrap a freshly built optimizer "
            "and load state through LowLevelZeroOptimizer's checkpoint API instead."
        )
