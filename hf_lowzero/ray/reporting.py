"""Reporting Trainer checkpoints to Ray Train: every rank stages the files it owns and reports them.

Example (inside a Ray Train worker; ``hf_lowzero.ray.prepare_trainer`` adds it)::

    report = ReportShardedCheckpoints(upload="async")
    trainer = LowZeroTrainer(model=model, args=args, train_dataset=data, callbacks=[report])
    trainer.train()   # each save is reported
    print(report.checkpoint_wait_s, "s waited on", report.checkpoints_reported, "checkpoint reports")

# [Note: one checkpoint from every rank]
ray.train.report is a barrier and every rank uploads its own directory into the same checkpoint
folder in storage; files of the same name from different ranks overwrite each other. So each rank
reports only the files it owns (``layout.owner_rank``): rank r its own ZeRO shard and RNG state,
rank 0 everything else (model, metadata, scheduler, trainer state, a plain Trainer's
``optimizer.pt``); every file is uploaded once. A Trainer runs its ``on_save`` callbacks with no
barrier after the save (NOTES.md), so the reporter holds one: no rank stages checkpoint-N before
every rank finished writing it, whichever Trainer wrote it.
Ray registers the checkpoint only when every rank's report arrived, so a registered checkpoint
always holds every shard, also across nodes that share no filesystem. A restarted run restores
through ray.train.get_checkpoint(), never by scanning storage.

# [Note: asynchronous upload]
With ``CheckpointUploadMode.ASYNC`` (Ray 2.60, ``ray/train/v2/_internal/execution/context.py``)
report() returns once the ranks agreed on the checkpoint folder's name; one background thread per
worker then copies the staged folder to storage, deletes it, and only after that queues the report
for the controller. So the controller still registers a round only when every rank's upload
finished: a rank killed mid-upload leaves a partial folder in storage that Ray never registers and
never hands to get_checkpoint(); one killed after its upload but before the controller polled its
report leaves a complete folder that Ray never registers either (``tests/test_ray.py``). Uploads run
in report order, and the worker waits for pending ones when the training function returns. The
staged folder must not change while it uploads: it holds hard links to (or copies of) files of a
Trainer ``checkpoint-N`` folder, which are written once and never rewritten, and the Trainer's
``save_total_limit`` rotation only removes names, which leaves the linked files intact.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import ray.train
import torch.distributed as dist
from ray.train import Checkpoint, CheckpointUploadMode
from transformers import TrainerCallback

from hf_lowzero.checkpoint.layout import owner_rank
from hf_lowzero.ray.integrity import rollback_metrics
from hf_lowzero.ray.restore import last_resume

UPLOAD_MODES = {"async": CheckpointUploadMode.ASYNC, "sync": CheckpointUploadMode.SYNC}


class ReportShardedCheckpoints(TrainerCallback):
    """Reports every Trainer checkpoint to Ray from every rank (see [Note: one checkpoint from every
    rank]) and the final metrics at the end. ``upload="async"`` uploads in the background ([Note:
    asynchronous upload]); ``"sync"`` waits for the upload in report().

    Every report carries the last logged metrics, ``step``, and this attempt's ``world_size``,
    ``global_batch_size`` and ``resumed_from_step`` (0: started fresh), and after
    ``resume_checkpoint()`` ``resumed_from`` ("memory", "storage" or "none") and
    ``newest_storage_step`` (the newest storage checkpoint's step then); with ZeRO
    ``integrity_checks`` (verify steps this attempt), ``integrity_failures`` (the run's, every
    attempt's) and ``rolled_back_to`` (the step this attempt resumed at after an integrity failure,
    0 if none: [Note: rollback] in ``integrity.py``). ``checkpoint_wait_s`` sums
    the seconds this attempt's training spent staging and in ``ray.train.report`` for its
    checkpoints (``benchmarks/ray_report.py`` compares the upload modes).

    Args:
        upload: ``"async"`` (upload in the background) or ``"sync"`` (``ray.train.report`` waits for it).

    Raises:
        ValueError: ``upload`` is neither ``"async"`` nor ``"sync"``.
    """

    def __init__(self, upload: str = "async") -> None:
        if upload not in UPLOAD_MODES:
            raise ValueError(f"upload={upload!r} is invalid; expected one of {sorted(UPLOAD_MODES)}")
        self.upload = upload
        self.upload_mode = UPLOAD_MODES[upload]
        self._last_logs: dict[str, float] = {}
        self._attempt: dict[str, int] = {}
        self.checkpoint_wait_s = 0.0
        self.checkpoints_reported = 0
        self._optimizer = None

    def on_train_begin(self, args, state, control, **kwargs):
        """Record what every report of this attempt carries: where it resumed, its world size and global batch."""
        world = dist.get_world_size()
        resumed = last_resume()
        self._optimizer = kwargs.get("optimizer")
        self._attempt = {  # state is restored by now: global_step is where this attempt resumed
            "resumed_from_step": state.global_step,
            **(resumed.metrics() if resumed is not None else {}),
            **(rollback_metrics(state.global_step) if getattr(args, "zero_stage", 0) else {}),
            "world_size": world,
            "global_batch_size": args.per_device_train_batch_size * args.gradient_accumulation_steps * world,
        }

    def on_log(self, args, state, control, logs=None, **kwargs):
        """Keep the numbers of the last log entry with a loss, for the next report."""
        if logs and "loss" in logs:
            self._last_logs = {k: v for k, v in logs.items() if isinstance(v, (int, float))}

    def on_save(self, args, state, control, **kwargs):
        """Once every rank wrote ``checkpoint-N``: stage this rank's files of it and report them to Ray."""
        start = time.perf_counter()
        dist.barrier()  # every rank's files of checkpoint-N are written (see the Note above)
        rank = dist.get_rank()
        source = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        staging = Path(tempfile.mkdtemp(prefix=f"hf_lowzero_report_r{rank}_"))
        stage_owned_files(source, staging / source.name, rank)
        ray.train.report(
            self._metrics(state),
            checkpoint=Checkpoint.from_directory(str(staging)),
            checkpoint_upload_mode=self.upload_mode,
            delete_local_checkpoint_after_upload=True,
        )
        self.checkpoint_wait_s += time.perf_counter() - start
        self.checkpoints_reported += 1

    def on_train_end(self, args, state, control, **kwargs):
        """Report the final metrics, with ``train_end=True`` and no checkpoint."""
        # Not "done": Tune stops a trial whose result says done=True, killing the TorchTrainer
        # before it shuts down (its autoscaler resource request then outlives it by minutes).
        ray.train.report({**self._metrics(state), "train_end": True})

    def _metrics(self, state) -> dict[str, float]:
        checks = {}
        integrity = getattr(getattr(self._optimizer, "optimizer", self._optimizer), "integrity", None)
        if integrity is not None:
            checks = {"integrity_checks": integrity.checks}
        return {**self._last_logs, **self._attempt, **checks, "step": state.global_step}


def stage_owned_files(source: Path, target: Path, rank: int) -> list[Path]:
    """Hard-link (or copy) into ``target`` the files of ``source`` that ``rank`` reports; returns
    their paths relative to ``source``. Over all ranks these sets partition ``source``'s files.

    Args:
        source: The Trainer's ``checkpoint-N`` folder.
        target: The folder to stage into; created as needed.
        rank: This rank.

    Returns:
        The staged files' paths, relative to ``source``.
    """
    staged = []
    for path in source.rglob("*"):
        if not path.is_file() or owner_rank(path) != rank:
            continue
        relative = path.relative_to(source)
        dest = target / relative
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(path, dest)
        except OSError:
            shutil.copy2(path, dest)
        staged.append(relative)
    return staged
