"""Backward-time machinery: one hook per bucket, plan-order bucket launches, the end-of-backward
flush, ``no_sync`` bookkeeping, params read before their all-gather landed, and recovery from a
backward that raised.

Example::

    sync = BackwardSync(slots, buckets, reducer, overlap=True, guard=WrapGuard(slots).check, pending=gather.stale_slots)
    loss.backward()        # bucket hooks launch complete buckets; the queued callback flushes the rest
    sync.reset()           # after a backward that raised: wait for its collectives, forget it

# [Note: one hook per bucket]
# Host work in backward grows with the number of buckets, not of parameters. A Python hook per
# parameter costs about a microsecond to call before its body runs: several milliseconds per step
# on a model of 2,000 small tensors (LoRA adapters), which DDP's C++ hooks do not pay. So each
# bucket has one post-accumulate-grad hook, on the param that backward reaches last in it (the
# earliest registered: buckets follow reverse registration order). When it fires, the buckets up to
# it are checked in plan order, and each whose params all got their gradient in this backward is
# launched; the check is a C-level scan of the params' ``.grad``. A bucket that is not complete
# then (a param unused on this rank, an order other than expected) waits for a later bucket's hook
# or for the end-of-backward flush, which launches every remaining bucket with zeros for missing
# gradients. Which params this rank used is read from ``.grad`` when a bucket is packed.
#
# "Got its gradient in this backward" is "has a ``.grad``" when the backward began with none: every
# flush frees them all. Stage 1's ``no_sync`` leaves the accumulated ones in place, so leaving
# ``no_sync`` records each ``.grad`` and its version counter (autograd's in-place accumulation
# bumps it, an out-of-place one makes a new tensor), and until the next flush a param counts as
# ready once its ``.grad`` is another tensor or a newer version. Gradients that no flush consumed
# (every backward of a step under ``no_sync``; a bare backward in which no bucket hook fired) are
# flushed before the norm is taken (``flush_loose``).
#
# The end of backward: ``opt.backward(loss)`` flushes after autograd returns, on every rank, also
# on one whose loss reached no parameter. A bare ``loss.backward()`` flushes from an autograd
# callback queued by the first bucket hook that fires; on a rank where none fires (its loss reached
# none of the buckets' last params) the gradients wait for ``step()``, which flushes them in the
# same plan order. That keeps every rank's collectives in the same sequence only if it was the
# step's last backward: where a rank's loss may miss the model, call ``opt.backward``.

# [Note: hooks hold the optimizer weakly]
# A param's hooks live on its tensor, which autograd's C++ side also holds, and Python's collector
# does not look through such a tensor: a hook that holds the optimizer (whose buckets hold the
# params) makes a cycle it never frees. Every optimizer, its model, master rows and optimizer
# state then stayed in memory for the life of the process: seen on an H100, where each of a
# benchmark's probes built a model and an optimizer and the later probes ran out of memory at a
# third of the width an earlier one had fitted. So a bucket's hook holds this object weakly, and
# the bucket only by its index and a few names for its error message.

# [Note: failed backward]
# An exception inside backward (an OOM in a layer's backward, a bad batch) stops autograd midway:
# some buckets are launched or reduced, some params hold gradients, and the end-of-backward
# callback queued by the first hook never runs (autograd drops the callbacks of a failed backward).
# Nothing of that backward may leak into a later step, and the next backward must start clean.
# ``zero_grad()`` does both: it waits for the collectives already started (every rank started the
# same ones when the exception is the same everywhere, as for DDP) and discards every gradient.
# Until then ``backward()`` and ``step()`` refuse with an error saying to call ``zero_grad()``.
# ``opt.backward`` always knows it failed; a bare ``loss.backward()`` that raised before any bucket
# hook fired leaves only gradients in ``.grad`` behind, as it would without ZeRO: call ``zero_grad()`` after
# catching it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from hf_lowzero.zero.grads.reducer import BucketReducer
from hf_lowzero.zero.layout.buckets import Bucket, BucketState, PlanOrderLauncher, Reduction
from hf_lowzero.zero.layout.packing import GRAD, holding_any, missing_any
from hf_lowzero.zero.layout.params import ParamSlot

MAX_IN_FLIGHT = 2  # buckets reducing at once; bounds transient buffer memory


class BackwardSync:
    """Turns backward's progress into bucket collectives in plan order ([Note: one hook per bucket])."""

    def __init__(
        self,
        slots: list[ParamSlot],
        buckets: list[Bucket],
        reducer: BucketReducer,
        overlap: bool,
        guard: Callable[[], None],
        pending: Callable[[], list[int]],
    ) -> None:
        self.overlap = overlap
        self.reducer = reducer
        self.params = [slot.param for slot in slots]
        self._bucket_params = [plan.params for plan in reducer.pack_plans]  # in packing order
        self._member_lists = [[slot.index for slot in bucket.slots] for bucket in buckets]  # in packing order
        self._bucket_members = [torch.tensor(members) for members in self._member_lists]
        self.launcher = PlanOrderLauncher(buckets, self._launch, reducer.finish, max_in_flight=MAX_IN_FLIGHT)
        self._guard = guard  # run once per backward, before the first bucket can launch
        self._pending = pending  # the slots whose all-gathers are still in flight
        self._stale_candidates: list[int] = []  # slots whose gathers were pending when the last backward began
        self.stale_reads: list[int] = []  # slots read before their gathers landed, since the last step
        self.enabled = True  # False inside no_sync()
        self.explicit = False  # inside opt.backward(), which flushes itself when autograd returns
        self.failed = False  # opt.backward() raised; zero_grad() clears it
        self.used = torch.zeros(len(slots), dtype=torch.bool)  # got a gradient on this rank since the last step
        self.grad_version = 0  # bumped by every flush; a norm computed before is stale
        self._before: list[list[tuple]] | None = None  # per bucket: (grad, version) left by no_sync
        self._reached = -1  # plan position of the furthest bucket whose hook fired in this backward
        self._flush_queued = False
        self.hook_handles = [
            min(bucket.slots, key=lambda s: s.index).param.register_post_accumulate_grad_hook(self._hook_for(bucket))
            for bucket in buckets
        ]

    @property
    def unfinished(self) -> bool:
        """A backward raised, or started launching buckets (or queued its flush) and never finished."""
        return self.failed or self._flush_queued or self.launcher.mid_backward

    def _hook_for(self, bucket: Bucket):
        # Runs once per bucket per backward, when the param expected last in it got its gradient.
        # It holds this object weakly ([Note: hooks hold the optimizer weakly]).
        this, index, names = weakref.ref(self), bucket.index, [s.name for s in bucket.slots[:3]]

        def hook(_param: torch.Tensor) -> None:
            sync = this()
            if sync is not None:
                sync._bucket_hook(index, names)

        return hook

    def _bucket_hook(self, index: int, names: list[str]) -> None:
        if not self.enabled:
            return
        if not self.explicit and not self._flush_queued:
            self._queue_flush()
        if self.launcher.phase[index] is not BucketState.WAITING:
            raise RuntimeError(
                f"a gradient of bucket {index} (parameters {names}...) arrived "
                "after the bucket was already reduced in this backward. Either a parameter is reached twice "
                "through reentrant autograd (use non-reentrant activation checkpointing, use_reentrant=False), "
                "or an earlier backward raised and was not followed by optimizer.zero_grad()."
            )
        if index > self._reached:
            self._reached = index
        if self.overlap:
            self.launcher.launch_ready(self._reached, self._complete)

    def _complete(self, index: int) -> bool:
        """Whether every param of bucket ``index`` got its gradient in this backward."""
        grads = map(GRAD, self._bucket_params[index])
        if self._before is None:
            return not missing_any(grads)
        return all(
            g is not None and (g is not old or g._version != version)
            for g, (old, version) in zip(grads, self._before[index])
        )

    def _launch(self, bucket: Bucket) -> Reduction:
        grads = list(map(GRAD, self._bucket_params[bucket.index]))
        members = self._bucket_members[bucket.index]
        if missing_any(grads):  # selected on the host: no data-dependent shape for a fake tensor
            present = [i for i, g in zip(self._member_lists[bucket.index], grads) if g is not None]
            members = torch.tensor(present, dtype=torch.long)
        self.used[members] = True
        if not self.reducer.replicated:
            return self.reducer.launch(bucket, grads)
        # [Note: replicated reduction]: the flags travel with the one bucket, final now (it is the last)
        self.close_stale_candidates()
        return self.reducer.launch(bucket, grads, flags=(self.used, bool(self.stale_reads)))

    def _queue_flush(self) -> None:
        # A bare loss.backward(): flush from an end-of-backward callback, queued by the first
        # hook. (Inside opt.backward() the flush runs after autograd returns, so the flush
        # never lands at the end of a nested, reentrant-checkpointing backward instead.)
        self.begin()
        self._flush_queued = True
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._flush_queued = False
        self.flush()

    def begin(self) -> None:
        """Once per backward, before a bucket can launch: the guard, and the params whose gathers are
        still pending: their modules' forward never ran, so a gradient for one of them means the
        forward read it before it landed ([Note: overlapped all-gather] in ``update/allgather.py``).
        They land at the step, after backward (landing now would change tensors autograd saved)."""
        self._guard()
        self.close_stale_candidates()
        self._stale_candidates = self._pending()

    def close_stale_candidates(self) -> None:
        """The candidates of the last backward that got a gradient in it were read stale."""
        used, params = self.used, self.params
        self.stale_reads += [i for i in self._stale_candidates if used[i] or params[i].grad is not None]
        self._stale_candidates = []

    def mark_start(self) -> None:
        """Record the gradients already accumulated (leaving ``no_sync``): the next backward's
        buckets are complete once each of these changed ([Note: one hook per bucket])."""
        if not holding_any(self.params):
            self._before = None
            return
        self._before = [
            [(g, -1 if g is None else g._version) for g in map(GRAD, params)] for params in self._bucket_params
        ]

    def flush(self) -> None:
        """Launch every bucket not yet launched in this backward, in plan order, and wait."""
        self.launcher.launch_all(self.overlap)
        self._before = None
        self._reached = -1
        self.grad_version += 1

    def flush_loose(self) -> None:
        """Flush gradients that no flush consumed (all of a step's backwards ran under ``no_sync``,
        or a bare backward fired no bucket hook)."""
        if holding_any(self.params):
            self.flush()

    def reset(self) -> None:
        """Forget everything since the last step, a failed backward included ([Note: failed backward])."""
        self.launcher.reset()
        self._flush_queued = False
        self.failed = False
        self._before = None
        self._reached = -1
        self.used.zero_()
        self._stale_candidates, self.stale_reads = [], []
        self.grad_version += 1

    def check_finished(self, action: str) -> None:
        if self.unfinished:
            raise RuntimeError(
                f"cannot {action}: a previous backward did not finish (it raised midway), so its "
                "gradients are incomplete. Call optimizer.zero_grad() to discard them, then continue "
                "with the next batch (see [Note: failed backward] in hf_lowzero/zero/grads/backward.py)."
            )
