"""Any Hugging Face ``Trainer`` on Ray Train: report its sharded checkpoints from every rank, resume them.

Inside the training function that ``ray.train.torch.TorchTrainer`` runs on every worker::

    def train_func(config):
        args = LowZeroTrainingArguments(output_dir=local_output_dir(), zero_stage=2, save_steps=10, use_cpu=True)
        trainer = prepare_trainer(LowZeroTrainer(model=build_model(), args=args, train_dataset=ds))
        trainer.train(resume_from_checkpoint=resume_checkpoint())

    TorchTrainer(train_func, scaling_config=ScalingConfig(num_workers=2),
                 run_config=RunConfig(storage_path="/mnt/shared/runs", failure_config=FailureConfig(3))).fit()

Every checkpoint the Trainer saves reaches Ray's storage with every rank's files ([Note: one
checkpoint from every rank] in ``reporting.py``); when Ray restarts the worker group, every rank
resumes the latest registered checkpoint, resharded if the worker count changed.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pyarrow.fs
import ray.train
import torch.distributed as dist
from transformers import Trainer

from hf_lowzero.ray.elastic import RecordWorldSize
from hf_lowzero.ray.events import quiet_designed_errors
from hf_lowzero.ray.integrity import guard_train
from hf_lowzero.ray.reporting import ReportShardedCheckpoints
from hf_lowzero.ray.restore import newest_state
from hf_lowzero.ray.snapshot_plan import check_every
from hf_lowzero.ray.snapshots import MemorySnapshots


def prepare_trainer(trainer: Trainer, upload: str = "async", snapshot_every: int | str | None = None) -> Trainer:
    """Make ``trainer`` report every checkpoint it saves to Ray Train, from every rank; returns it.

    Each rank reports the files of ``checkpoint-N`` it owns (its ZeRO shard and RNG state; rank 0
    every other file), so a checkpoint Ray registers holds every shard, also across nodes that share
    no filesystem. ``upload="async"`` uploads in the background, ``"sync"`` blocks training until the
    upload finished. Also adds the world size to every entry of the loss log (``RecordWorldSize``), and
    keeps Ray from printing a traceback for an error that ends the attempt by design (a rollback, a
    peer killed on purpose: ``quiet_designed_errors``).
    Works with any ``transformers.Trainer`` (``LowZeroTrainer``, or a plain ``Trainer`` with DDP);
    calling it again on the same trainer changes nothing.

    ``snapshot_every`` (steps, ``"auto"`` or None) also keeps snapshots of the whole training state in
    node memory (``MemorySnapshots``): each rank's shard on its own node and on a buddy node, never in
    storage, so a lost worker or node costs at most that many steps; ``"auto"`` picks the interval
    that keeps them within 2% of training time. It needs a ZeRO trainer (``LowZeroTrainer``, or a
    ``with_zero`` twin, with ``zero_stage`` 1 or 2). ``resume_checkpoint()`` then resumes the newer
    of the newest complete snapshot and the newest storage checkpoint. Add ``ReleaseSnapshots()`` to
    the ``TorchTrainer``'s ``RunConfig(callbacks=[...])`` so that a run that fails for good frees
    them at once (else when its driver exits; one that ends normally frees them itself).

    With ZeRO, ``train`` is guarded ([Note: rollback] in ``integrity.py``): an integrity failure is
    recorded in the run's storage with the nodes of the ranks it names; with
    ``zero_on_mismatch="rollback"`` the restart resumes from the newest verified memory snapshot, and
    a fault that repeats on one node stops the run there, naming it.

    Example::

        trainer = prepare_trainer(LowZeroTrainer(model=model, args=args, train_dataset=ds))
        trainer.train(resume_from_checkpoint=resume_checkpoint())

    Args:
        trainer: Any ``transformers.Trainer``, built inside the training function.
        upload: ``"async"`` (upload checkpoints in the background) or ``"sync"`` (training waits).
        snapshot_every: Keep memory snapshots every this many steps, ``"auto"``, or None/``"off"`` for none.

    Returns:
        ``trainer`` itself, with its callbacks added.

    Raises:
        RuntimeError: Outside a Ray Train worker (call it inside the training function), or when the
            trainer's world does not match the worker group's.
        ValueError: The trainer saves no checkpoints (``save_strategy="no"``: nothing could be resumed
            after a failure); ``snapshot_every`` is invalid, or set for a trainer without ZeRO; or the
            trainer was already prepared with another ``upload`` or ``snapshot_every``.
    """
    world_size = _train_worker_world_size("prepare_trainer")
    if trainer.args.world_size != world_size:
        raise RuntimeError(
            f"the trainer's args.world_size is {trainer.args.world_size} but the Ray Train worker group has "
            f"{world_size} workers; on CPU pass use_cpu=True to TrainingArguments (accelerate otherwise runs "
            "every worker as a single process)"
        )
    if trainer.args.save_strategy == "no":
        raise ValueError(
            "save_strategy='no': the trainer saves no checkpoints, so there is nothing to report to Ray and a "
            "restarted worker group would train from the start; set save_strategy='steps' and save_steps"
        )
    snapshot_every = check_every(snapshot_every)
    if snapshot_every is not None and not getattr(trainer, "zero_enabled", False):
        raise ValueError(
            f"snapshot_every={snapshot_every!r} needs a ZeRO trainer: memory snapshots keep each rank's optimizer "
            f"shard, and {type(trainer).__name__} (zero_stage={getattr(trainer.args, 'zero_stage', 0)}) has none. Use "
            "LowZeroTrainer (or hf_lowzero.with_zero(YourTrainer)) with zero_stage=1 or 2, or snapshot_every=None"
        )
    callbacks = trainer.callback_handler.callbacks
    reporters = [cb for cb in callbacks if isinstance(cb, ReportShardedCheckpoints)]
    if reporters:
        taken = [cb.schedule.every for cb in callbacks if isinstance(cb, MemorySnapshots)] or [None]
        if (reporters[0].upload, taken[0]) != (upload, snapshot_every):
            raise ValueError(
                f"trainer is already prepared with upload={reporters[0].upload!r}, snapshot_every={taken[0]!r}, "
                f"not upload={upload!r}, snapshot_every={snapshot_every!r}"
            )
        return trainer
    quiet_designed_errors()  # [Note: designed events] in events.py
    trainer.add_callback(ReportShardedCheckpoints(upload))
    trainer.add_callback(RecordWorldSize())
    if getattr(trainer, "zero_enabled", False):
        guard_train(trainer)  # [Note: rollback] in integrity.py
    if snapshot_every is not None:
        snapshots = MemorySnapshots(snapshot_every)
        snapshots.setup()
        trainer.add_callback(snapshots)
    return trainer


def resume_checkpoint() -> str | None:
    """The local ``checkpoint-N`` folder to resume this attempt from, or None on a fresh start: pass
    it to ``trainer.train(resume_from_checkpoint=...)``. Call it on every rank (it is collective).

    That is the newer of the checkpoint Ray Train hands this attempt (``ray.train.get_checkpoint()``)
    and the newest complete memory snapshot of this run (``prepare_trainer(snapshot_every=...)``),
    which is written into a local folder of each node from its own node's holder or, when that node
    is gone, from a buddy's (``hf_lowzero.ray.restore``).

    With local or shared storage it is the folder in storage itself; with remote storage
    (``s3://...``, a custom ``storage_filesystem``) every rank downloads the checkpoint to a
    temporary folder of its node first. The folder stays valid for the whole attempt.

    Example::

        trainer.train(resume_from_checkpoint=resume_checkpoint())

    Returns:
        The path of the ``checkpoint-N`` folder, or None when there is nothing to resume.

    Raises:
        RuntimeError: Outside a Ray Train worker, or when the Ray checkpoint does not hold exactly one
            Trainer ``checkpoint-N`` folder.
    """
    _train_worker_world_size("resume_checkpoint")
    checkpoint = ray.train.get_checkpoint()
    storage = None
    if checkpoint is not None:
        if isinstance(checkpoint.filesystem, pyarrow.fs.LocalFileSystem):
            folder = checkpoint.path
        else:
            folder = checkpoint.to_directory()
        storage = trainer_checkpoint_in(folder)
    return newest_state(storage).folder


def local_output_dir(prefix: str = "hf_lowzero_") -> str:
    """A new, empty Trainer ``output_dir`` for this attempt of the training function: the same path
    on every rank (the first rank picks it), created on every node. Ranks on one node then write one
    ``checkpoint-N`` together, and no attempt or concurrent run finds another's checkpoints there.
    Everything worth keeping is reported to Ray; remove the folder when training is done.

    Example::

        args = LowZeroTrainingArguments(output_dir=local_output_dir(), zero_stage=2, use_cpu=True)

    Args:
        prefix: The start of the folder's name.

    Returns:
        The folder's path.

    Raises:
        RuntimeError: Outside a Ray Train worker (call it inside the training function).
    """
    _train_worker_world_size("local_output_dir")
    path = [tempfile.mkdtemp(prefix=prefix)] if dist.get_rank() == 0 else [None]
    dist.broadcast_object_list(path, src=0)
    os.makedirs(path[0], exist_ok=True)
    return path[0]


def trainer_checkpoint_in(folder: str | os.PathLike) -> str:
    """The one Trainer ``checkpoint-N`` folder inside a Ray checkpoint folder.

    Example::

        with result.checkpoint.as_directory() as folder:
            export_pretrained(trainer_checkpoint_in(folder), "out/final")

    Args:
        folder: The Ray checkpoint's local folder.

    Returns:
        The path of the ``checkpoint-N`` folder in it.

    Raises:
        RuntimeError: ``folder`` holds no ``checkpoint-N`` folder, or more than one.
    """
    found = sorted(Path(folder).glob("checkpoint-*"))
    if len(found) != 1:
        raise RuntimeError(
            f"expected one Trainer checkpoint-N folder in the Ray checkpoint {folder}, found "
            f"{[f.name for f in found]}; report checkpoints with prepare_trainer, one Trainer checkpoint per report"
        )
    return str(found[0])


def _train_worker_world_size(caller: str) -> int:
    """The worker group's size; raises unless this is a Ray Train worker with its process group."""
    try:
        world_size = ray.train.get_context().get_world_size()
    except (RuntimeError, DeprecationWarning) as e:
        raise RuntimeError(
            f"{caller}() must be called inside the training function that ray.train.torch.TorchTrainer runs on "
            f"each worker, not on the driver or in a Tune trial's function ({e})"
        ) from e
    if not dist.is_initialized() or dist.get_world_size() != world_size:
        raise RuntimeError(
            f"{caller}() needs the process group of the Ray Train worker group ({world_size} workers); "
            "run the training function with ray.train.torch.TorchTrainer, which starts it"
        )
    return world_size
