"""Backward-time machinery: per-parameter hooks, plan-order bucket launches, the end-of-backward
flush, ``no_sync`` bookkeeping, and recovery from a backward that raised.

Example::

    sync = BackwardSync(slots, buckets, reducer, overlap=True, guard=WrapGuard(slots).check)
    loss.backward()        # hooks launch complete buckets; the queued callback flushes the rest
    sync.reset()           # after a backward that raised: wait for its collectives, forget it

# [Note: failed backward]
# An exception inside backward (an OOM in a layer's backward, a bad batch) stops autograd midway:
# some buckets are launched or reduced, some params are marked ready, and the end-of-backward
# callback queued by the first hook never runs (autograd drops the callbacks of a failed backward).
# Nothing of that backward may leak into a later step, and the next backward must start clean.
# ``zero_grad()`` does both: it waits for the collectives already started (every rank started the
# same ones when the exception is the same everywhere, as for DDP) and discards every gradient.
# Until then ``backward()`` and ``step()`` refuse with an error saying to call ``zero_grad()``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hf_lowzero.zero.buckets import Bucket, BucketState, PlanOrderLauncher
from hf_lowzero.zero.params import ParamSlot
from hf_lowzero.zero.reducer import BucketReducer

MAX_IN_FLIGHT = 2  # buckets reducing at once; bounds transient buffer memory


class BackwardSync:
    """Turns per-parameter "gradient ready" events into bucket collectives in plan order."""

    def __init__(
        self,
        slots: list[ParamSlot],
        buckets: list[Bucket],
        reducer: BucketReducer,
        overlap: bool,
        guard: Callable[[], None],
    ) -> None:
        self.slots = slots
        self.buckets = buckets
        self.overlap = overlap
        self.launcher = PlanOrderLauncher(buckets, reducer.launch, reducer.finish, max_in_flight=MAX_IN_FLIGHT)
        self._guard = guard  # run once per backward, before the first bucket can launch
        self.enabled = True  # False inside no_sync()
        self.explicit = False  # inside opt.backward(), which flushes itself when autograd returns
        self.locally_used = [False] * len(slots)  # got a gradient on this rank since the last step
        self.unsynced_local_grads = False  # a no_sync backward left gradients in p.grad
        self.grad_version = 0  # bumped by every gradient; a norm computed before is stale
        self._flush_queued = False
        self.hook_handles = [slot.param.register_post_accumulate_grad_hook(self._hook_for(slot)) for slot in slots]

    @property
    def unfinished(self) -> bool:
        """A backward started launching buckets (or queued its flush) and never finished."""
        return self._flush_queued or self.launcher.mid_backward

    def _hook_for(self, slot: ParamSlot):
        # Runs once per parameter per backward: kept to a few attribute updates (see
        # benchmarks/step_time.py, ms_our_python); the bucket work happens once per bucket.
        launcher, bucket_index = self.launcher, slot.bucket_index
        index = slot.index

        def hook(_param: torch.Tensor) -> None:
            self.grad_version += 1
            self.locally_used[index] = True
            if not self.enabled:
                self.unsynced_local_grads = True
                return
            if not self.explicit and not self._flush_queued:
                self._queue_flush()
            if launcher.phase[bucket_index] is not BucketState.WAITING:
                raise RuntimeError(
                    f"gradient of {slot.name!r} arrived after its bucket was already reduced in this "
                    "backward. Either a parameter is reached twice through reentrant autograd (use "
                    "non-reentrant activation checkpointing, use_reentrant=False), or an earlier backward "
                    "raised and was not followed by optimizer.zero_grad()."
                )
            if launcher.mark_ready(slot) and self.overlap:
                launcher.launch_ready()

        return hook

    def _queue_flush(self) -> None:
        # A bare loss.backward(): flush from an end-of-backward callback, queued by the first
        # hook. (Inside opt.backward() the flush runs after autograd returns, so the flush
        # never lands at the end of a nested, reentrant-checkpointing backward instead.)
        self._guard()
        self._flush_queued = True
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._flush_queued = False
        self.flush()

    def flush(self) -> None:
        """Launch every bucket not yet launched in this backward, in plan order, and wait."""
        self.launcher.launch_all(self.overlap)
        self.unsynced_local_grads = False

    def reset(self) -> None:
        """Forget everything since the last step, a failed backward included ([Note: failed backward])."""
        self.launcher.reset()
        self._flush_queued = False
        self.locally_used = [False] * len(self.slots)
        self.unsynced_local_grads = False
        self.grad_version += 1

    def check_finished(self, action: str) -> None:
        if self.unfinished:
            raise RuntimeError(
                f"cannot {action}: a previous backward did not finish (it raised midway), so its "
                "gradients are incomplete. Call optimizer.zero_grad() to discard them, then continue "
                "with the next batch (see [Note: failed backward] in hf_lowzero/zero/backward.py)."
            )
