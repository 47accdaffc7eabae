"""LowLevelZeroOptimizer: ZeRO stage 1 and 2 around any torch optimizer.

Example::

    model = build_model()
    opt = LowLevelZeroOptimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), stage=2)
    for batch in loader:
        opt.backward(model(**batch).loss)
        opt.step()
        opt.zero_grad()

Lifecycle of one step (docs/architecture.md, "The data path of one step"): backward launches
complete buckets in plan order ([Note: bucket order], ``grads/backward.py``); ``step`` takes the
global norm and the used flags in one all-reduce and skips on every rank alike when it is not finite
(``update/step.py``); ``apply_update`` steps the inner optimizer on the master rows and all-gathers
them back into the model's params (``update/allgather.py``).

This module holds the training step; the parts are made in ``build.py``, and what code outside the
step sees (torch.optim's surface, state dicts, the params between steps) is ``facade.py``'s.
``opt.param_groups`` hold the model's params; the inner optimizer's hold its inner params (see
[Note: two sets of param groups] in ``inner/groups.py`` and [Note: inner params] in
``inner/adopt.py``): slices of every param (row shards), or, with whole-parameter ownership, the
params this rank owns, whole and in their shape ([Note: two ways to own a parameter] in
``layout/partition.py``).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator

import torch
import torch.distributed as dist

from hf_lowzero.zero.build import build_parts
from hf_lowzero.zero.exact import determinism_warning
from hf_lowzero.zero.facade import OptimizerFacade
from hf_lowzero.zero.host.threads import host_threads_warning, local_ranks, machine_cores
from hf_lowzero.zero.inner.policy import check_fresh_optimizer, partition_for
from hf_lowzero.zero.layout.packing import holding_any
from hf_lowzero.zero.runtime import device as dev
from hf_lowzero.zero.runtime.notices import warn_once
from hf_lowzero.zero.runtime.ranges import profiler_range
from hf_lowzero.zero.update.allgather import stale_read_message
from hf_lowzero.zero.update.kernel_factor import StepFactor
from hf_lowzero.zero.update.step import StepVerdict, count_skipped_step, unscale_clip_coef
from hf_lowzero.zero.zero_config import ZeroConfig

logger = logging.getLogger(__name__)


def check_inner_optimizer(optimizer: object) -> None:
    """Raise a clear error unless ``optimizer`` is a fresh torch optimizer that is not itself a
    ``LowLevelZeroOptimizer`` (see ``inner.policy.check_fresh_optimizer``).

    Args:
        optimizer: The optimizer to wrap.

    Raises:
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer``, or is a ``LowLevelZeroOptimizer``.
        ValueError: ``optimizer`` already has state from steps it took.
    """
    if isinstance(optimizer, LowLevelZeroOptimizer):
        raise TypeError("the optimizer is already a LowLevelZeroOptimizer; pass its inner optimizer instead")
    check_fresh_optimizer(optimizer)


class LowLevelZeroOptimizer(OptimizerFacade):
    """Shards ``optimizer``'s state (stage 1) and gradients (stage 2) of ``model`` over ranks.

    ``optimizer`` must be a fresh torch optimizer over ``model``'s trainable params. Element-wise
    ones get row shards, any other whole-parameter ownership (``ZeroConfig.partition``).
    ``param_groups`` hold the model's params (see [Note: two sets of param groups]);
    ``state_dict()`` is torch's format for this rank's shard (see ``inner/shard_state.py``).

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
        parts = build_parts(model, optimizer, self.config, self.partition)
        super().__init__(model, optimizer, parts)
        self.shard_group = parts.shard
        self.process_group, self.rank = parts.shard.group, parts.shard.rank
        self.world_size, self.device = parts.shard.world_size, parts.shard.device
        self.slots, self.buckets = parts.slots, parts.buckets
        self.integrity, self.reducer, self.master = parts.integrity, parts.reducer, parts.master
        self.scaler, self.counts = parts.scaler, parts.counts
        self.host_step = parts.host_step  # host masters: our kernel where exact ([Note: our kernel in torch's place])
        self.last_grad_norm: float | None = None
        self.last_step_applied: bool | None = None
        self._pending_norm = None  # (grad_version, reduced chunks, verdict) of this step
        self._factor = StepFactor(self.optim, host_rows=self.config.offload_optimizer, host_step=parts.host_step)
        if self.rank == 0:  # said once per process (runtime/notices.py)
            if self.config.reduction == "exact":
                warn_once(logger, determinism_warning(self.device))
            if self.config.offload_optimizer:  # its cores: the worker's (Ray: --cpus-per-worker)
                threads = torch.get_num_threads()
                logger.info("[hf_lowzero] offload: the host step uses %d threads", threads)
                warn_once(logger, host_threads_warning(threads, machine_cores(), local_ranks()))

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
        sync = self._parts.sync
        sync.check_finished("run backward")
        sync.begin()
        self.integrity.begin_step()  # [Note: integrity checks]: decides whether this step verifies
        if self.scaler.scale != 1.0:
            loss = loss.float() * self.scaler.scale  # in fp32: a scaled fp16 loss would overflow
        sync.explicit = True
        try:
            loss.backward(**backward_kwargs)
        except BaseException:
            sync.failed = True  # [Note: failed backward]
            raise
        finally:
            sync.explicit = False
        if sync.enabled:
            sync.flush()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Stage 1: accumulate gradients locally in ``p.grad`` with no communication.

        The first backward outside the context reduces the accumulated total once.

        Yields:
            Nothing; backward passes inside only accumulate.

        Raises:
            RuntimeError: Under stage 2 or ``reduction="exact"``, which must reduce every backward.
        """
        if not self.allows_no_sync:
            raise RuntimeError(self.reducer.no_sync_refusal)
        sync = self._parts.sync
        previous = sync.enabled
        sync.enabled = False
        try:
            yield
        finally:
            sync.enabled = previous
            if previous:
                sync.mark_start()  # the gradients accumulated so far ([Note: one hook per bucket])

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
        self._parts.sync.check_finished("step")
        self._parts.guard.check()
        self._parts.groups.check_sizes()
        with profiler_range("hf_lowzero::grad_norm"):
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

        # [Note: one multiply] unscaling and clipping are one factor applied once to each row,
        # inside the host kernel where it takes it ([Note: the factor in the kernel]).
        coef = unscale_clip_coef(self.last_grad_norm, self.config.clip_grad_norm, self.scaler.scale)
        ours = self.host_step is not None and self.host_step.why_not() is None
        if not ours and self.reducer.store.offloaded:
            with profiler_range("hf_lowzero::widen_rows"):  # [Note: 16-bit rows]: torch's step reads fp32 rows
                if self.reducer.store.widen_all():
                    reduced = [self.reducer.reduced(bucket) for bucket in self.buckets]
        with self._factor.applied(reduced, coef, host_kernel=ours):
            self.apply_update(verdict.used)
        self.scaler.update(overflow=False)
        self.counts.consecutive = 0
        self.integrity.end_step(skipped_nonfinite=False)
        self._forget_gradients()  # every p.grad was consumed by the flush
        self.last_step_applied = True
        return True

    def apply_update(self, used: torch.Tensor | None = None) -> None:
        """The update of a step already decided, without the decision: no norm, clipping, skip or
        integrity check. ``step()`` runs it; a memory plan runs it alone on fake tensors.

        Masks the params used on no rank, syncs hyperparameters into the inner groups, steps the
        inner optimizer on the masters and writes them back into the params. Nothing here reads
        tensor data on the host, so it also runs under ``FakeTensorMode``. With ``overlap_allgather``
        the gathers are left in flight ([Note: overlapped all-gather] in ``update/allgather.py``).

        Args:
            used: A bool per managed param (``StepVerdict.used``): whether some rank used it; None
                keeps the masks of the last step (none on a fresh optimizer).
        """
        parts = self._parts
        if used is not None:
            parts.unused_mask.apply(used)
        parts.groups.sync()
        parts.master.gate.before_write()  # [Note: one gate for the shard's writers]
        with profiler_range("hf_lowzero::inner_step"), parts.precision.stepping(), dev.phase("inner_step"):
            # [Note: our kernel in torch's place]; each bucket's rows leave as stepped ([Note: rows sent as stepped])
            if parts.host_step is None or not parts.host_step.step(after_chunk=parts.gather.upload):
                self.reducer.store.widen_all()  # [Note: 16-bit rows] (a no-op when already widened)
                self.optim.step()  # whatever it syncs is its own, as without ZeRO (torch's Adafactor reads its step)
        with profiler_range("hf_lowzero::all_gather_issue"):
            parts.gather.issue()

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
        self._parts.sync.check_finished("compute the gradient norm")
        self._norm_and_usage()  # sets last_grad_norm
        return self.last_grad_norm

    def _norm_and_usage(self) -> tuple[list[torch.Tensor | None], StepVerdict]:
        sync = self._parts.sync
        sync.flush_loose()  # [Note: one hook per bucket]: gradients no backward flushed
        self.wait_for_params()  # the gathers land before the replicas are hashed (and the masters change)
        if self._pending_norm is None or self._pending_norm[0] != sync.grad_version:
            reduced = [self.reducer.reduced(bucket) for bucket in self.buckets]
            sync.close_stale_candidates()
            stale = sync.stale_reads
            table = self.integrity.verify_launch()  # a verify step's numbers ride along: [Note: one host sync per step]
            squares = [self.reducer.store.taken_square(bucket) for bucket in self.buckets]
            summed = self.reducer.replicated_totals()  # [Note: replicated reduction]: no stats all-reduce
            verdict = self._parts.stats.decide(
                reduced, sync.used, len(stale), extra=table, squares=squares, summed=summed
            )
            if table is not None:  # raises IntegrityError on every rank, before anything is updated
                self.integrity.verify_judge(verdict.extra.view(self.world_size, -1))
            if verdict.stale_reads:
                raise RuntimeError(stale_read_message([self.slots[i].name for i in sorted(stale)], rank=self.rank))
            self.last_grad_norm = verdict.scaled_norm / self.scaler.scale
            self._pending_norm = (sync.grad_version, reduced, verdict)
        return self._pending_norm[1:]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop every gradient: ``p.grad`` of managed params, bucket contents and gradient rows;
        also a backward that raised midway ([Note: failed backward]).

        Args:
            set_to_none: Accepted for torch's signature; gradients are always dropped (set to None).
        """
        params = self._parts.sync.params
        if holding_any(params):  # after a step none does: skip the per-param loop
            for param in params:
                param.grad = None
        self._forget_gradients()

    def _forget_gradients(self) -> None:
        self._parts.sync.reset()
        self.reducer.clear()
        self._pending_norm = None
        self.integrity.discard()

    # ------------------------------------------------------------------------------ counters

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

    @property
    def last_skip_reason(self) -> str | None:
        """Why the last step was skipped, where its decision names a cause (``reduction="exact"``: a
        gradient beyond the fixed-point grid, or not finite); None otherwise.
        """
        return getattr(self._parts.stats, "last_skip", None)

    @property
    def allows_no_sync(self) -> bool:
        """Whether :meth:`no_sync` is available: under stage 1 (stage 2 reduces every backward)."""
        return self.reducer.allows_no_sync

    @property
    def step_number(self) -> int:
        """The number of the step being taken: 1 on a fresh optimizer, one more after each step.

        Integrity checks are scheduled and reported by it (``verify_every``, ``IntegrityError.step``).
        A caller with its own count sets it before the step's first backward, as ``LowZeroTrainer``
        does (``global_step + 1``), so a resumed run goes on counting from its checkpoint.
        """
        return self.integrity.step

    @step_number.setter
    def step_number(self, step: int) -> None:
        self.integrity.step = step

    @property
    def integrity_checks(self) -> int | None:
        """Verify steps so far ([Note: integrity checks] in ``integrity/checker.py``); None when the
        checks are off (``verify_every="off"``, or a world of one rank).
        """
        return self.integrity.checks if self.integrity.enabled else None
