"""What code outside the training step sees of a ``LowLevelZeroOptimizer``: torch.optim's surface
(param groups, state, state dicts, schedule-free modes, the inner optimizer's own attributes) and
the params and the shard between steps (the gathers in flight, copies between params and masters,
asynchronous readers of the shard, the memory it holds).

``LowLevelZeroOptimizer`` (``optimizer.py``) adds the training step to it: backward, ``no_sync``,
step, ``zero_grad``.

Example::

    opt.param_groups[0]["lr"] = 1e-4       # the model's params, hyperparameters synced into the inner groups
    opt.wait_for_params()                  # every param holds its value from the last step
    torch.save(opt.state_dict(), path)     # this rank's shard, torch's format
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Any

import torch

from hf_lowzero.zero.build import OptimizerParts
from hf_lowzero.zero.inner.groups import HOOK_TABLES
from hf_lowzero.zero.inner.shard_state import load_shard_state, shard_state_dict
from hf_lowzero.zero.runtime import device as dev
from hf_lowzero.zero.runtime.memory import MemoryReport, bytes_by_device, gather_buffer_bytes
from hf_lowzero.zero.update.allgather import MAX_GATHERS_IN_FLIGHT


class OptimizerFacade(torch.optim.Optimizer):
    """The base of ``LowLevelZeroOptimizer``: everything but the training step (module docstring).

    Args:
        model: The model whose trainable params ``optimizer`` held.
        optimizer: The inner optimizer, adopted onto this rank's inner params.
        parts: What the optimizer is made of (``build.build_parts``).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, parts: OptimizerParts) -> None:
        self.model, self.optim = model, optimizer
        self._parts = parts
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
        self._parts.groups.sync()
        return self._parts.groups.outer

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self._parts.groups.replace(groups)

    @property
    def state(self) -> dict[torch.Tensor, dict[str, Any]]:
        """The inner optimizer's state of this rank's rows, keyed by the model's params (read view)."""
        state, inner_params = self.optim.state, self._parts.inner_params
        return {
            s.param: state[inner_params[s.index]]
            for s in self._parts.slot_at
            if inner_params[s.index] is not None and inner_params[s.index] in state
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
        (``inner/shard_state.py``). Local and cheap: no communication, no copies.

        Returns:
            The state dict; its tensors are the live ones, not copies.
        """
        self.wait_for_params()  # [Note: params are current]
        return shard_state_dict(self._parts.shard_state)

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
        load_shard_state(self._parts.shard_state, state_dict)

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
            self._parts.master.gate.before_write()  # [Note: one gate for the shard's writers]
            with self._parts.precision.stepping():
                switch()  # moves the masters this rank holds
            self.copy_master_to_params()

    # ------------------------------------------------------------- the params between steps

    def copy_master_to_params(self) -> None:
        """Write the master rows back into the model's params (all-gather, bucketed, in the
        params' dtype) and wait for them. Collective. ``step()`` does this itself (leaving the
        gathers in flight with ``overlap_allgather``); checkpoint loading calls it.
        """
        self._parts.gather.issue(defer=False)

    @property
    def gathers_in_flight(self) -> list[int]:
        """The buckets whose all-gathers are still in flight after the step, in the order they were
        issued (the next forward's): empty once every param is current.
        """
        return list(self._parts.gather.pending)

    def wait_for_params(self) -> None:
        """Wait until every param holds its value from the last step.

        With ``overlap_allgather`` (on in the Trainer and the Ray job, off by default here) ``step()``
        returns with the all-gathers of the updated params in flight, and the next forward waits for
        each where it first reads it ([Note: every read waits] in ``reads/plan.py``). Everything else
        that reads params between ``step()`` and the next forward must call this first: an EMA of the
        weights, a metric computed from them, ``torch.save(model.parameters())``.
        ``model.state_dict()``, this optimizer's ``state_dict()``, checkpoints, the next ``backward()``
        and ``step()`` call it themselves; so does the Trainer before evaluation, saving and
        callbacks. Local; free when nothing is in flight.

        Example::

            opt.step()
            opt.wait_for_params()
            ema.update(model.parameters())
        """
        self._parts.gather.wait_all()

    def register_shard_reader(self, event) -> None:
        """An asynchronous copy of this rank's shard (master rows, optimizer state) completes with
        ``event`` (a CUDA event; None for a synchronous copy): every later write of the shard
        (a step, ``train()``/``eval()``, ``copy_params_to_master``, ``load_state_dict``) waits for
        it first ([Note: one gate for the shard's writers] in ``update/write_gate.py``).

        Args:
            event (torch.cuda.Event | None): Completes when the copy is done; None: the copy is done already.
        """
        self._parts.master.gate.read_by(event)

    def copy_params_to_master(self) -> None:
        """Re-read this rank's master rows from the model's params. Local.

        For code that loaded new weights into the model in place after wrapping (a Trainer resuming
        from a checkpoint without optimizer state, ``load_best_model_at_end``); optimizer state is
        kept. With 16-bit params the masters become the 16-bit values.
        """
        self.wait_for_params()
        self._parts.master.copy_from_params()

    def remove_hooks(self) -> None:
        """Detach from the model: remove the gradient hooks this optimizer put on its params.

        Call it before dropping an optimizer whose model lives on (rebuilding the optimizer for the
        same model); the optimizer must not be used afterwards.
        """
        sync = self._parts.sync
        for handle in sync.hook_handles:
            handle.remove()
        sync.hook_handles = []
        self._parts.gather.wait_all()
        if self._parts.reads is not None:
            self._parts.reads.detach()

    # ------------------------------------------------------------------------- what it holds

    @property
    def managed_params(self) -> list[torch.nn.Parameter]:
        """The sharded params, in the model's registration order."""
        return [slot.param for slot in self._parts.slots]

    def inner_param_pairs(self) -> list[tuple[torch.Tensor, torch.nn.Parameter]]:
        """The tensors this rank's inner optimizer steps, each with the model's param it stands for
        ([Note: inner params] in ``inner/adopt.py``): this rank's master row of each param (row
        shards), or the master of each param it owns, in the param's shape (whole-parameter ownership).

        Returns:
            ``(inner param, param)`` pairs, in the model's registration order; params this rank holds
            no piece of are left out.
        """
        inner_params = self._parts.inner_params
        return [(inner_params[s.index], s.param) for s in self._parts.slots if inner_params[s.index] is not None]

    def memory_report(self) -> MemoryReport:
        """Bytes this rank holds right now, per part and per device, measured from the live tensors.

        Counts storages, so it also measures fake tensors (a memory plan reads it after a step
        under ``FakeTensorMode``).

        Returns:
            The report.
        """
        parts, params = self._parts, list(self.model.parameters())
        managed = {id(slot.param) for slot in parts.slots}
        master, reducer = parts.master.flat, parts.reducer
        copy = [parts.host_step.copy.flat] if parts.host_step and parts.host_step.copy else []  # 16-bit rows
        state = [v for entry in self.optim.state.values() for v in entry.values() if isinstance(v, torch.Tensor)]
        host = [master, *copy, *reducer.store.tensors(), *state, parts.stats.host]
        return MemoryReport.measure(
            params=bytes_by_device(params),
            grads=bytes_by_device(p.grad for p in params if id(p) in managed and p.grad is not None),
            grad_buffers=reducer.buffer_bytes(),
            master_rows=bytes_by_device([master, *copy]),
            optimizer_state=bytes_by_device(state),
            buffers=bytes_by_device(self.model.buffers()),
            comm_buffers=bytes_by_device(reducer.pool.tensors()),
            gather_buffers=Counter({str(parts.shard.device): self._gather_buffers()}),
            pinned=dev.pinned_bytes(host),
        )

    def _gather_buffers(self) -> int:
        """The most the all-gathers into the params hold at once ([Note: overlapped all-gather])."""
        gather = self._parts.gather
        at_once = None if gather.defer else MAX_GATHERS_IN_FLIGHT
        return gather_buffer_bytes(gather.buckets, gather.flat, world_size=gather.shard.world_size, at_once=at_once)
