"""LowLevelZeroOptimizer: ZeRO stage 1 and 2 around any torch optimizer.

Example::

    model = build_model()
    opt = LowLevelZeroOptimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), stage=2)
    for batch in loader:
        opt.backward(model(**batch).loss)
        opt.step()
        opt.zero_grad()

Lifecycle of one step (docs/architecture.md, "The data path of one step"): backward launches
complete buckets in plan order ([Note: bucket order], ``backward.py``); ``step`` takes the global
norm and the used flags in one all-reduce and skips on every rank alike when it is not finite
(``step.py``); ``_update`` steps the inner optimizer on the master rows and all-gathers them back
into the model's params (``master.py``).

``opt.param_groups`` hold the model's params; the inner optimizer's hold master rows (see
[Note: two sets of param groups] in ``groups.py``): slices of every param (row shards), or, with
whole-parameter ownership, the params this rank owns, whole and in their shape ([Note: two ways to
own a parameter] in ``partition.py``).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import record_function

from hf_lowzero.zero import comm
from hf_lowzero.zero import device as dev
from hf_lowzero.zero.adopt import adopt_inner_optimizer, held_piece
from hf_lowzero.zero.allgather import ParamGather, stale_read_message
from hf_lowzero.zero.backward import BackwardSync
from hf_lowzero.zero.buckets import plan_buckets
from hf_lowzero.zero.buffers import BufferPool
from hf_lowzero.zero.config import ZeroConfig
from hf_lowzero.zero.exact import ExactReducer, ExactStepStats, use_row_invariant_kernels
from hf_lowzero.zero.grad_store import make_grad_store
from hf_lowzero.zero.groups import HOOK_TABLES, ParamGroups
from hf_lowzero.zero.inner import check_fresh_optimizer, partition_for, prefer_fused_on_cpu
from hf_lowzero.zero.integrity import IntegrityChecker
from hf_lowzero.zero.layout import holding_any
from hf_lowzero.zero.loss_scaler import make_scaler
from hf_lowzero.zero.master import MasterRows
from hf_lowzero.zero.master_precision import make_master_precision
from hf_lowzero.zero.memory import MemoryReport, bytes_by_device
from hf_lowzero.zero.params import WrapGuard, canonical_name, managed_slots
from hf_lowzero.zero.reducer import BucketReducer
from hf_lowzero.zero.shard_state import ShardParts, load_shard_state, shard_state_dict
from hf_lowzero.zero.step import (
    SkipCounts,
    StepStats,
    StepVerdict,
    UnusedMask,
    count_skipped_step,
    scale_rows,
    unscale_clip_coef,
)

logger = logging.getLogger(__name__)


def hashed_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """What the replica check compares ([Note: integrity checks]): every parameter, trainable and
    frozen (tied ones once), and every persistent buffer, by name.

    Args:
        model: The model.

    Returns:
        ``(name, tensor)`` pairs, by canonical (uncompiled) name.
    """
    tensors = [(canonical_name(n), p) for n, p in model.named_parameters()]
    for module_name, module in model.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and name not in module._non_persistent_buffers_set:
                tensors.append((canonical_name(f"{module_name}.{name}" if module_name else name), buffer))
    return tensors


def check_inner_optimizer(optimizer: object) -> None:
    """Raise a clear error unless ``optimizer`` is a fresh torch optimizer that is not itself a
    ``LowLevelZeroOptimizer`` (see ``inner.check_fresh_optimizer``).

    Args:
        optimizer: The optimizer to wrap.

    Raises:
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer``, or is a ``LowLevelZeroOptimizer``.
        ValueError: ``optimizer`` already has state from steps it took.
    """
    if isinstance(optimizer, LowLevelZeroOptimizer):
        raise TypeError("the optimizer is already a LowLevelZeroOptimizer; pass its inner optimizer instead")
    check_fresh_optimizer(optimizer)


class LowLevelZeroOptimizer(torch.optim.Optimizer):
    """Shards ``optimizer``'s state (stage 1) and gradients (stage 2) of ``model`` over ranks.

    ``optimizer`` must be a fresh torch optimizer over ``model``'s trainable params. Element-wise
    ones get row shards, any other whole-parameter ownership (``ZeroConfig.partition``).
    ``param_groups`` hold the model's params (see [Note: two sets of param groups]);
    ``state_dict()`` is torch's format for this rank's shard (see ``shard_state.py``).

    Gradients live in the optimizer's buckets and rows, not in ``p.grad``: after a synchronized
    backward every managed ``p.grad`` is None. ``step()`` consumes and clears them.

    Args:
        model: The model whose trainable params ``optimizer`` holds; cast and move it before wrapping.
        optimizer: A fresh torch optimizer (no steps taken) over exactly ``model``'s trainable params.
        config: The configuration; None: ``ZeroConfig()``'s defaults.
        **overrides (Any): ``ZeroConfig`` fields that replace ``config``'s, e.g. ``stage=1``.

    Raises:
        RuntimeError: ``torch.distributed`` is not initialized (a world of size 1 works).
        TypeError: ``optimizer`` is not a torch optimizer, or is a ``LowLevelZeroOptimizer`` itself; or an
            override is not a ``ZeroConfig`` field.
        ValueError: An override has an invalid value; ``optimizer`` has taken steps, or does not hold
            exactly ``model``'s trainable params (all on one device, contiguous, floating point); or
            ``partition="rows"`` with an optimizer that is not element-wise.
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
        self.integrity = IntegrityChecker(
            self.buckets,
            {id(slot): slot.name for slot in self.slots},
            hashed_tensors(model),
            self.config.communication_dtype,
            self.process_group,
            self.rank,
            self.world_size,
            self.device,
            self.config.verify_every,
            self.config.on_mismatch,
        )
        store = make_grad_store(self.buckets, self.device, offload, pin)
        group, world_size, stage = self.process_group, self.world_size, self.config.stage
        if self.config.reduction == "exact":  # [Note: exact reduction]; replicas are still hashed, not sums
            use_row_invariant_kernels(optimizer, self.partition, self.device)  # exact/kernels.py
            self.reducer = ExactReducer(
                self.buckets, group, world_size, stage, store, pool, len(self.slots), self.rank, self.integrity.enabled
            )
        else:
            self.reducer = BucketReducer(
                self.buckets, group, world_size, self.config.communication_dtype, stage, store, pool, self.integrity
            )
        cfg = self.config
        self.master = MasterRows(
            self.slots, self.buckets, rank=self.rank, device=self.device, offload=offload, pin_memory=pin,
            dtype=cfg.master_dtype,
        )  # fmt: skip
        self._gather = ParamGather(
            self.slots, self.buckets, self.master.flat, self.master.gate, world_size=self.world_size,
            group=self.process_group, device=self.device, pool=pool, defer=cfg.overlap_allgather,
        )  # fmt: skip
        self._gather.attach(model)  # [Note: overlapped all-gather]
        if self.config.reduction == "exact":
            self._stats = ExactStepStats(self.reducer, self.slots, self.device, self.process_group)
        else:
            self._stats = StepStats(len(self.slots), self.device, self.process_group)
        self._stale_candidates: list[int] = []  # slots whose gathers were pending when the last backward began
        self._stale_reads: list[int] = []  # slots read before their gathers landed, in this step
        self._precision = make_master_precision(
            self.master.flat, self.slots, cfg.master_rounding, cfg.master_rounding_seed, self.rank
        )

        # Per slot: the tensor the inner optimizer steps (a master row, or an owned param's master
        # in its shape; None for a param owned elsewhere; an fp32 scratch view with bf16 masters)
        # and its gradient, fixed views of the stores.
        self._inner_params = [held_piece(slot, self._precision.step_rows[slot.index]) for slot in self.slots]
        self._inner_grads = [held_piece(slot, self.reducer.store.piece(slot)) for slot in self.slots]
        self._unused_mask = UnusedMask(self._inner_params, self._inner_grads)
        if self.master.flat.device.type == "cpu" and self.config.reduction != "exact":  # see exact/kernels.py
            prefer_fused_on_cpu(optimizer)
        slot_of = {id(slot.param): slot for slot in self.slots}
        self._groups = ParamGroups(optimizer)
        self._slot_at = [slot_of[id(p)] for group in self._groups.outer for p in group["params"]]  # by position
        adopt_inner_optimizer(optimizer, self.slots, self._inner_params, self._inner_grads, self.rank)
        self._groups.freeze_sizes()

        self.scaler = make_scaler(self.config, {slot.param.dtype for slot in self.slots})
        self.counts = SkipCounts()
        self._shard = ShardParts(
            slot_at=self._slot_at,
            held=self._inner_params,
            master_rows=self.master.rows,
            optim=optimizer,
            groups=self._groups,
            scaler=self.scaler,
            counts=self.counts,
            gate=self.master.gate,
            stage=self.config.stage,
            partition=self.partition,
            world_size=self.world_size,
            rank=self.rank,
            exact=self.reducer if self.config.reduction == "exact" else None,
        )
        self.last_grad_norm: float | None = None
        self.last_step_applied: bool | None = None
        self._pending_norm = None  # (grad_version, reduced chunks, scaled norm, used flags) of this step
        self._sync = BackwardSync(
            self.slots,
            self.buckets,
            self.reducer,
            self.config.overlap_communication,
            guard=self._before_backward,
        )

        # Not Optimizer.__init__: it would build param groups and state of its own. The hook
        # tables are what Optimizer's step/state_dict wrappers and LR schedulers expect.
        self.defaults = optimizer.defaults
        for name in HOOK_TABLES:
            setattr(self, name, OrderedDict())
        self._patch_step_function()

    # ----------------------------------------------------------------- torch.optim.Optimizer API

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
        """Refused: the bucket plan is fixed at construction.

        Args:
            param_group: The group that would be added.

        Raises:
            RuntimeError: Always; build the inner optimizer with every group before wrapping it.
        """
        raise RuntimeError(
            "LowLevelZeroOptimizer cannot add param groups after construction (the bucket plan is "
            "static); build the inner optimizer with every group before wrapping it."
        )

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard in torch's format, plus master rows, loss scaler and counters
        (``shard_state.py``). Local and cheap: no communication, no copies.

        Returns:
            The state dict; its tensors are the live ones, not copies.
        """
        self.wait_for_params()  # [Note: params are current]
        return shard_state_dict(self._shard)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore this rank's shard from :meth:`state_dict` of the same rank and world size.

        Validated before anything changes. Local: the model's params are not touched (restore
        them as with any torch optimizer, or call :meth:`copy_master_to_params`). Kernel choices
        (``fused``, ``foreach``, ``capturable``) stay this optimizer's own.

        Args:
            state_dict: A state dict from :meth:`state_dict` of the same rank and world size.

        Raises:
            ValueError: ``state_dict`` does not fit this optimizer (not a ``LowLevelZeroOptimizer`` state
                dict, or of another rank or world size, partition, model, param groups or loss scaler);
                nothing was changed.
        """
        self.wait_for_params()  # the gathers in flight read the masters this replaces
        load_shard_state(self._shard, state_dict)

    def train(self) -> None:
        """Schedule-free optimizers: switch the inner optimizer to its training point and write it
        into the params (collective). A no-op for optimizers without modes; ``Trainer`` calls it.
        """
        self._switch_mode("train")

    def eval(self) -> None:
        """Schedule-free optimizers: switch the inner optimizer to its evaluation point (the
        averaged weights) and write it into the params (collective). A no-op without modes.
        """
        self._switch_mode("eval")

    def _switch_mode(self, mode: str) -> None:
        switch = getattr(self.optim, mode, None)
        if callable(switch):
            self.wait_for_params()
            self.master.gate.before_write()  # [Note: one gate for the shard's writers]
            with self._precision.stepping():
                switch()  # moves the masters this rank holds
            self.copy_master_to_params()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop every gradient: ``p.grad`` of managed params, bucket contents and gradient rows;
        also a backward that raised midway ([Note: failed backward]).

        Args:
            set_to_none: Accepted for torch's signature; gradients are always dropped (set to None).
        """
        if holding_any(self._sync.params):  # after a step none does: skip the per-param loop
            for param in self._sync.params:
                param.grad = None
        self._forget_gradients()

    def _forget_gradients(self) -> None:
        self._sync.reset()
        self.reducer.clear()
        self._pending_norm = None
        self._stale_candidates, self._stale_reads = [], []
        self.integrity.discard()

    def copy_master_to_params(self) -> None:
        """Write the master rows back into the model's params (all-gather, bucketed, in the
        params' dtype) and wait for them. Collective. ``step()`` does this itself (leaving the
        gathers in flight with ``overlap_allgather``); checkpoint loading calls it.
        """
        self._gather.issue(defer=False)

    @property
    def gathers_in_flight(self) -> list[int]:
        """The buckets whose all-gathers are still in flight after the step, in the order they were
        issued (the next forward's): empty once every param is current."""
        return list(self._gather.pending)

    def wait_for_params(self) -> None:
        """Wait until every param holds its value from the last step.

        With ``overlap_allgather`` (the default) ``step()`` returns with the all-gathers of the
        updated params in flight, and each module's forward waits for its own ([Note: overlapped
        all-gather] in ``allgather.py``). Everything else that reads params between ``step()`` and
        the next forward must call this first: an EMA of the weights, a metric computed from them,
        ``torch.save(model.parameters())``. ``model.state_dict()``, this optimizer's ``state_dict()``,
        checkpoints, the next ``backward()`` and ``step()`` call it themselves; so does the Trainer
        before evaluation, saving and callbacks. Local; free when nothing is in flight.

        Example::

            opt.step()
            opt.wait_for_params()
            ema.update(model.parameters())
        """
        self._gather.wait_all()

    def register_shard_reader(self, event) -> None:
        """An asynchronous copy of this rank's shard (master rows, optimizer state) completes with
        ``event`` (a CUDA event; None for a synchronous copy): every later write of the shard
        (a step, ``train()``/``eval()``, ``copy_params_to_master``, ``load_state_dict``) waits for
        it first ([Note: one gate for the shard's writers] in ``write_gate.py``).

        Args:
            event (torch.cuda.Event | None): Completes when the copy is done; None: the copy is done already.
        """
        self.master.gate.read_by(event)

    def copy_params_to_master(self) -> None:
        """Re-read this rank's master rows from the model's params. Local.

        For code that loaded new weights into the model in place after wrapping (a Trainer resuming
        from a checkpoint without optimizer state, ``load_best_model_at_end``); optimizer state is
        kept. With 16-bit params the masters become the 16-bit values.
        """
        self.wait_for_params()
        self.master.copy_from_params()

    def remove_hooks(self) -> None:
        """Detach from the model: remove the gradient hooks this optimizer put on its params.

        Call it before dropping an optimizer whose model lives on (rebuilding the optimizer for the
        same model); the optimizer must not be used afterwards.
        """
        for handle in self._sync.hook_handles:
            handle.remove()
        self._sync.hook_handles = []
        self._gather.detach()

    # ----------------------------------------------------------------------------- backward

    def backward(self, loss: torch.Tensor, **backward_kwargs) -> None:
        """``loss.backward()`` with loss scaling (fp16) and gradient synchronization.

        Synchronizes after autograd returns, also on a rank where no parameter got a gradient,
        so no peer waits forever.

        Args:
            loss: The loss of this micro-batch (a scalar).
            **backward_kwargs (Any): Passed on to ``loss.backward`` (``retain_graph``, ...).

        Raises:
            RuntimeError: An earlier backward raised midway and ``zero_grad()`` was not called since, a
                managed param changed dtype, device or storage since wrapping, or a bucket got a
                gradient after it was reduced (reentrant activation checkpointing). Errors of autograd
                itself propagate; call ``zero_grad()`` before the next backward then.
        """
        self._sync.check_finished("run backward")
        self._before_backward()
        self.integrity.begin_step()  # [Note: integrity checks]: decides whether this step verifies
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

        Yields:
            Nothing; backward passes inside only accumulate.

        Raises:
            RuntimeError: Under stage 2 or ``reduction="exact"``, which must reduce every backward.
        """
        if not self.reducer.allows_no_sync:
            raise RuntimeError(self.reducer.no_sync_refusal)
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

        Args:
            closure (Callable[[], float] | None): Must be None: closures are not supported.

        Returns:
            Whether the update was applied.

        Raises:
            TypeError: A closure was given.
            RuntimeError: An earlier backward raised midway and ``zero_grad()`` was not called since; a
                managed param changed since wrapping, or ``param_groups`` changed shape; or too many steps
                were skipped (``max_consecutive_skips`` in a row, or an overflow at the minimum fp16 loss
                scale).
            hf_lowzero.IntegrityError: On a verify step, a replica or reduction check failed (on every rank,
                before anything was updated).
        """
        if closure is not None:
            raise TypeError("LowLevelZeroOptimizer.step() does not support a closure")
        self._sync.check_finished("step")
        self._guard.check()
        self._groups.check_sizes()
        with record_function("hf_lowzero::grad_norm"):
            reduced, verdict = self._norm_and_usage()
        if not math.isfinite(verdict.scaled_norm):
            self.last_step_applied = False
            why = self.integrity.nonfinite_text()
            if why and self.rank == 0:
                logger.warning("[hf_lowzero] step skipped: %s", why)
            self.integrity.end_step(skipped_nonfinite=True)
            self.zero_grad()
            count_skipped_step(self.counts, self.scaler, self.config, why)
            return False

        # [Note: one multiply] unscaling and clipping are one factor applied once to each row.
        scale_rows(reduced, unscale_clip_coef(self.last_grad_norm, self.config.clip_grad_norm, self.scaler.scale))
        self._update(verdict.used)
        self.scaler.update(overflow=False)
        self.counts.consecutive = 0
        self.integrity.end_step(skipped_nonfinite=False)
        self._forget_gradients()  # every p.grad was consumed by the flush
        self.last_step_applied = True
        return True

    def _update(self, used: torch.Tensor | None) -> None:
        """The update once the step is decided: mask params used on no rank (``used``: a bool per
        slot; None leaves the masks as the last step set them: none on a fresh optimizer), sync
        hyperparameters, step the inner optimizer on the masters, write them back into the params.
        Nothing here reads tensor data on the host, so it also runs under ``FakeTensorMode`` (a
        memory planner calls ``_update(None)``). With ``overlap_allgather`` the gathers are left in
        flight ([Note: overlapped all-gather]).
        """
        if used is not None:
            self._unused_mask.apply(used)
        self._groups.sync()
        self.master.gate.before_write()  # [Note: one gate for the shard's writers]
        with record_function("hf_lowzero::inner_step"), self._precision.stepping(), dev.phase("inner_step"):
            self.optim.step()  # whatever it syncs is its own, as without ZeRO (torch's Adafactor reads its step)
        with record_function("hf_lowzero::all_gather_issue"):
            self._gather.issue()

    def grad_norm(self) -> float:
        """Global L2 norm of this step's averaged, unscaled gradients (before clipping). Collective.

        For callers that log the norm before ``step()`` (as ``transformers.Trainer`` does); the
        result is cached, so the following ``step()`` does not communicate it again.

        Returns:
            The norm (inf or nan when some rank's gradients are not finite).

        Raises:
            RuntimeError: An earlier backward raised midway and ``zero_grad()`` was not called since.
            hf_lowzero.IntegrityError: On a verify step, a replica or reduction check failed (on every rank).
        """
        self._sync.check_finished("compute the gradient norm")
        self._norm_and_usage()  # sets last_grad_norm
        return self.last_grad_norm

    def _norm_and_usage(self) -> tuple[list[torch.Tensor | None], StepVerdict]:
        self._sync.flush_loose()  # [Note: one hook per bucket]: gradients no backward flushed
        self.wait_for_params()  # the gathers land before the replicas are hashed (and the masters change)
        if self._pending_norm is None or self._pending_norm[0] != self._sync.grad_version:
            reduced = [self.reducer.reduced(bucket) for bucket in self.buckets]
            self._close_stale_candidates()
            stale = self._stale_reads
            table = self.integrity.verify_launch()  # a verify step's numbers ride along: [Note: one host sync per step]
            verdict = self._stats.decide(reduced, self._sync.used, len(stale), extra=table)
            if table is not None:  # raises IntegrityError on every rank, before anything is updated
                self.integrity.verify_judge(verdict.extra.view(self.world_size, -1))
            if verdict.stale_reads:
                raise RuntimeError(stale_read_message([self.slots[i].name for i in sorted(stale)], self.rank))
            self.last_grad_norm = verdict.scaled_norm / self.scaler.scale
            self._pending_norm = (self._sync.grad_version, reduced, verdict)
        return self._pending_norm[1:]

    def _before_backward(self) -> None:
        """Once per backward, before a bucket can launch: the wrap guard, and the params whose
        gathers are still pending: their modules' forward never ran, so a gradient for one of them
        means the forward read it before it landed ([Note: overlapped all-gather]). They land at the
        step, after backward (landing now would change tensors autograd saved)."""
        self._guard.check()
        self._close_stale_candidates()
        self._stale_candidates = self._gather.stale_slots()

    def _close_stale_candidates(self) -> None:
        """The candidates of the last backward that got a gradient in it were read stale."""
        used, params = self._sync.used, self._sync.params
        self._stale_reads += [i for i in self._stale_candidates if used[i] or params[i].grad is not None]
        self._stale_candidates = []

    @property
    def skipped_steps(self) -> int:
        """Steps skipped so far because some rank's gradients were not finite."""
        return self.counts.skipped

    @property
    def consecutive_skips(self) -> int:
        """Steps skipped in a row up to now."""
        return self.counts.consecutive

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
        """Bytes this rank holds right now, per part and per device, measured from the live tensors.

        Returns:
            The report.
        """
        managed = {id(slot.param) for slot in self.slots}
        state = [v for entry in self.optim.state.values() for v in entry.values() if isinstance(v, torch.Tensor)]
        host = [self.master.flat, *self.reducer.store.tensors(), *state, self._stats.host]
        return MemoryReport.measure(
            params=bytes_by_device(self.model.parameters()),
            grads=bytes_by_device(p.grad for p in self.model.parameters() if id(p) in managed and p.grad is not None),
            grad_buffers=self.reducer.buffer_bytes(),
            master_rows=bytes_by_device([self.master.flat]),
            optimizer_state=bytes_by_device(state),
            buffers=bytes_by_device(self.model.buffers()),
            comm_buffers=bytes_by_device(self.reducer.pool.tensors()),
            pinned=dev.pinned_bytes(host),
        )
