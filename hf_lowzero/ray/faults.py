"""Fault injection for demos and fault-tolerance tests: kill one worker process once, at a chosen step.

Example (inside a Ray Train training function, after ``prepare_trainer``)::

    trainer = prepare_trainer(LowZeroTrainer(model=model, args=args, train_dataset=ds))
    trainer.add_callback(InjectWorkerFailure(step=15, run_dir=Path("/mnt/shared/runs/demo")))
    trainer.train(resume_from_checkpoint=resume_checkpoint())   # attempt 1 dies at step 15, attempt 2 resumes
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import ray.train
import torch.distributed as dist
from ray.train import CheckpointConsistencyMode
from transformers import TrainerCallback

from hf_lowzero.ray.events import expect_lost_peer
from hf_lowzero.ray.snapshots import snapshot_takers

FAILURE_MARKER = ".hf_lowzero_failure_injected"

logger = logging.getLogger(__name__)


class InjectWorkerFailure(TrainerCallback):
    """Kills the last rank's process once, at ``step``, on the first attempt only (a marker file in
    the run's storage folder remembers that it happened), after Ray registered every earlier
    checkpoint, so the restart resumes the last one before ``step``. At a checkpoint step it dies
    right after ``ray.train.report`` returned, with its upload still in flight ([Note: asynchronous
    upload]): its report never reaches the controller, and its files in storage are usually cut
    short (the upload thread can win the race with the kill); at any other step, at the end of the
    step. Add it after ``prepare_trainer``, so that its ``on_save`` runs right after the report's. The
    console gets one line for it, and no traceback for the error the kill costs the other ranks
    ([Note: designed events] in ``events.py``).

    ``during="snapshot"`` kills it instead while the memory snapshot of ``step`` is being taken: after
    its pieces landed on the holders and before it marked them, so that snapshot is torn (never
    complete) and the restart resumes the one before ([Note: complete snapshot] in
    ``hf_lowzero/snapshot/protocol.py``). ``step`` must then be a snapshot step.

    Args:
        step: The step at which to kill the worker.
        run_dir: The run's folder in storage, shared by every attempt, where the marker file goes.
        during: ``"step"`` (at the end of the step, or after its checkpoint report) or ``"snapshot"``
            (while the step's memory snapshot is being taken).

    Raises:
        ValueError: ``during`` is neither ``"step"`` nor ``"snapshot"``.
    """

    def __init__(self, step: int, run_dir: Path, during: str = "step") -> None:
        if during not in ("step", "snapshot"):
            raise ValueError(f"during={during!r} is invalid; expected 'step' or 'snapshot'")
        self.step = step
        self.during = during
        self.marker = run_dir / FAILURE_MARKER
        self._kill_after_report = False

    def on_step_end(self, args, state, control, **kwargs):
        """At ``step``, on the first attempt: the last rank writes the marker and dies at once, or arms its
        death for right after the step's checkpoint report (a save step) or for its memory snapshot
        (``during="snapshot"``).
        """
        if state.global_step != self.step or self.marker.exists():
            return
        for taker in snapshot_takers():  # a snapshot on its way lands first, as a storage report is committed
            taker.wait()
        dist.barrier()  # every rank checked the marker before it appears
        if dist.get_rank() != dist.get_world_size() - 1:
            expect_lost_peer()  # the error losing it costs this rank prints no traceback
        else:
            # Reports reach the controller when it polls; one queued on a dead worker is lost.
            ray.train.get_all_reported_checkpoints(consistency_mode=CheckpointConsistencyMode.COMMITTED)
            self.marker.parent.mkdir(parents=True, exist_ok=True)
            self.marker.write_text(f"worker of rank {dist.get_rank()} killed at step {state.global_step}\n")
            logger.warning(failure_line(dist.get_rank(), self.step))
            if self.during == "snapshot":
                for taker in snapshot_takers():
                    taker.fault = (self.step, lambda: os._exit(1))
                return
            if not control.should_save:  # set by DefaultFlowCallback, which runs first
                os._exit(1)
            self._kill_after_report = True

    def on_save(self, args, state, control, **kwargs):
        """Kill the last rank right after its checkpoint report, when ``on_step_end`` armed it."""
        # Runs right after ReportShardedCheckpoints.on_save and nothing in between blocks, so the
        # upload that report() started in the background is still in flight: its report never arrives.
        if self._kill_after_report:
            os._exit(1)


def failure_line(rank: int, step: int) -> str:
    """The console line of an injected failure ([Note: designed events] in ``events.py``). It names the
    raylet's report of the dead worker, which Ray prints whatever we do, just before or after it.

    Example::

        >>> failure_line(1, 15)[:60]
        '[hf_lowzero] injecting a failure: killing rank 1 at step 15;'
    """
    return (
        f"[hf_lowzero] injecting a failure: killing rank {rank} at step {step}; Ray reports the dead worker "
        "(raylet: 'A worker died or was killed ...') and restarts the group, which resumes the newest memory "
        "snapshot or checkpoint"
    )


CORRUPTION_MARKER = ".hf_lowzero_corruption_injected"


class InjectCorruption(TrainerCallback):
    """Flips one bit of the last rank's reduced gradients of the first bucket, once, at ``step``, on
    the first attempt that reaches it (a marker file in the run's storage folder remembers it): a
    transient hardware fault, for demos and tests of the integrity checks
    (``hf_lowzero.zero.integrity.reduction_faults``).
    With ``verify_every=1`` the check of ``step`` catches it; with ``on_mismatch="rollback"`` the
    restart resumes from the snapshot before it and ends as the run without the fault.

    Args:
        step: The step whose reduced gradients get the flipped bit.
        run_dir: The run's folder in storage, shared by every attempt, where the marker file goes.
    """

    def __init__(self, step: int, run_dir: Path) -> None:
        self.step = step
        self.marker = run_dir / CORRUPTION_MARKER
        self._injecting = None

    def on_train_begin(self, args, state, control, **kwargs):
        """On the first attempt that has ``step`` ahead: write the marker and arm the fault on the last rank."""
        from hf_lowzero.zero.integrity.reduction_faults import Fault, inject

        due = not self.marker.exists() and state.global_step < self.step
        dist.barrier()  # every rank checked the marker before it appears
        if due and dist.get_rank() == dist.get_world_size() - 1:
            self.marker.parent.mkdir(parents=True, exist_ok=True)
            self.marker.write_text(f"a bit of rank {dist.get_rank()}'s reduced gradients flips at step {self.step}\n")
            logger.warning(
                "[hf_lowzero] injecting a corruption: rank %d's reduced gradients, step %d", dist.get_rank(), self.step
            )
            self._injecting = inject(Fault("flip", rank=dist.get_rank(), step=self.step, bucket=0, bit=28))
            self._injecting.__enter__()

    def on_train_end(self, args, state, control, **kwargs):
        """Disarm the fault if it is still armed."""
        if self._injecting is not None:
            self._injecting.__exit__(None, None, None)
            self._injecting = None
