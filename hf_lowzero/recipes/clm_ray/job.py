"""The causal-LM fine-tune on Ray Train, built from the public pieces any training function can use
(``prepare_trainer``, ``resume_checkpoint``, ``local_output_dir``, ``ConsoleProgress``).

Example::

    ray.init(address="local", num_cpus=3)
    result = run_finetune(RayFinetuneConfig(num_workers=2, zero_stage=2, max_steps=20, save_steps=5,
                                            storage_path="/tmp/ray_results"))
    print(result.metrics, result.checkpoint.path)

Elastic (``num_workers=(1, 4)``, or ``--num-workers 1-4``): Ray restarts the group at a new size
when capacity changes, and every attempt resumes the latest checkpoint, resharded (``hf_lowzero/ray/elastic.py``).

# [Note: a lost rank under NCCL]
# With gloo a rank whose peer died gets a connection error at its next collective and exits with
# it. With NCCL it may not: over sockets or InfiniBand NCCL sees the closed connection and, with
# asynchronous error handling (TORCH_NCCL_ASYNC_ERROR_HANDLING=1, which Ray Train sets), the
# watchdog aborts the communicator and the rank exits with an NCCL error; over NVLink or shared
# memory within a node nothing tells NCCL that the peer is gone, and the survivors block in the
# collective without a word. Either way Ray's controller notices the dead worker (a process: at
# once; a node: when its health checks fail, tens of seconds) and tears the group down, killing
# blocked survivors. What nothing else catches is a rank that hangs alive; the process group's
# timeout (``collective_timeout_s``, 600 s here, against Ray's 1800) ends that one.
"""

from __future__ import annotations

import dataclasses
import functools
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ray.train
import torch.distributed as dist
from ray.train import CheckpointConfig, FailureConfig, LoggingConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer
from transformers import TrainerCallback

from hf_lowzero.ray.console import ConsoleProgress, quiet_worker_console
from hf_lowzero.ray.faults import InjectCorruption, InjectWorkerFailure
from hf_lowzero.ray.prepare import local_output_dir, prepare_trainer, resume_checkpoint
from hf_lowzero.ray.reporting import ReportShardedCheckpoints
from hf_lowzero.ray.run_config import merge_run_config, with_job_callbacks
from hf_lowzero.recipes.clm import clm_trainer
from hf_lowzero.recipes.clm_ray.attempts import record_attempt
from hf_lowzero.recipes.clm_ray.job_config import RayFinetuneConfig
from hf_lowzero.trainer.step_clock import PlannedStepTime, plan_device_flags


def run_finetune(config: RayFinetuneConfig, **build_kwargs) -> ray.train.Result:
    """Fit the fine-tune on the connected Ray cluster; returns Ray's ``Result`` (metrics, checkpoint).

    Example::

        result = run_finetune(RayFinetuneConfig(max_steps=20, storage_path="/tmp/ray_results"))

    Args:
        config: The job's configuration.
        **build_kwargs (Any): Passed on to :func:`build_trainer` (``run_config``, ``trainer_callbacks``).

    Returns:
        The result of the run: its last reported metrics, its latest checkpoint and rank 0's return value.

    Raises:
        ray.train.TrainingFailedError: Training failed for good: the worker group failed more often than
            ``config.max_failures`` allows (an error raised by the training function is such a failure),
            or Ray Train's controller met an error it cannot retry.
    """
    return build_trainer(config, **build_kwargs).fit()


def build_trainer(
    config: RayFinetuneConfig, run_config: RunConfig | None = None, trainer_callbacks: Sequence[TrainerCallback] = ()
) -> TorchTrainer:
    """The ``TorchTrainer`` for ``config``. A caller's ``run_config`` is merged with the job's (see
    ``merge_run_config``): e.g. a Tune trial passes its ``TuneReportCallback`` and retry policy and
    keeps the job's name, storage and checkpoint policy. ``trainer_callbacks`` (pickled to every
    worker) join the Trainer's own, after the reporting one.

    Example::

        run_config = RunConfig(callbacks=[TuneReportCallback()], failure_config=FailureConfig(max_failures=1))
        result = build_trainer(RayFinetuneConfig(num_workers=(1, 4)), run_config, [MyCallback()]).fit()

    Args:
        config: The job's configuration.
        run_config: The caller's ``RunConfig``, merged with the job's; None: the job's alone.
        trainer_callbacks: Further ``TrainerCallback`` objects for the Trainer on every worker.

    Returns:
        The ``TorchTrainer``, not started: call ``fit()``.
    """
    job_run_config = RunConfig(
        name=config.name,
        storage_path=config.storage_path,
        failure_config=FailureConfig(max_failures=config.max_failures),
        checkpoint_config=CheckpointConfig(num_to_keep=config.num_to_keep),
        logging_config=LoggingConfig(log_level="WARNING"),  # [Note: console noise] in hf_lowzero/ray/console.py
    )
    return TorchTrainer(
        train_loop_per_worker=functools.partial(train_loop_per_worker, trainer_callbacks=tuple(trainer_callbacks)),
        train_loop_config=dataclasses.asdict(config),
        scaling_config=ScalingConfig(
            num_workers=config.num_workers,
            use_gpu=config.use_gpu,
            resources_per_worker=config.worker_resources(_alive_nodes()),
            elastic_resize_monitor_interval_s=config.resize_check_interval_s,
        ),
        # [Note: a lost rank under NCCL]: how long a collective may wait
        torch_config=TorchConfig(timeout_s=config.collective_timeout_s),
        run_config=with_job_callbacks(merge_run_config(run_config, job_run_config)),
    )


def _alive_nodes() -> list[dict[str, float]]:
    """The resources of the connected cluster's alive nodes (none when Ray is not started yet)."""
    if not ray.is_initialized():
        return []
    return [node["Resources"] for node in ray.nodes() if node.get("Alive")]


def train_loop_per_worker(
    config_dict: dict[str, Any], trainer_callbacks: Sequence[TrainerCallback] = ()
) -> dict[str, float]:
    """Runs on every Ray worker (process group already initialized by Ray Train), once per attempt.
    Returns the seconds training waited on checkpoint reports and their count, each step's time and
    the plan's prediction of it (rank 0's become ``Result.return_value``).

    Args:
        config_dict: The job's ``RayFinetuneConfig`` as a dict (``dataclasses.asdict``).
        trainer_callbacks: Further ``TrainerCallback`` objects to add to the Trainer.

    Returns:
        ``{"checkpoint_wait_s": ..., "checkpoints_reported": ..., "step_times_s": [...], "predicted_step_s": ...}``
        of this worker, this attempt (``predicted_step_s`` None when no plan ran: ``zero_stage`` not "auto").

    Raises:
        ValueError: ``config_dict`` is not a valid configuration, or ``zero_stage="auto"`` finds that
            nothing fits on the workers' devices.
        RuntimeError: Outside a Ray Train worker with its process group.
    """
    config = RayFinetuneConfig(**config_dict)
    quiet_worker_console()
    output_dir = local_output_dir(prefix=f"hf_lowzero_{config.name}_")
    world_size = dist.get_world_size()
    attempt = record_attempt(config.storage_path, config.name, world_size) if dist.get_rank() == 0 else None
    args = config.training_arguments(output_dir, world_size)
    trainer = clm_trainer(config.clm_arguments(), args, printer=ConsoleProgress(attempt))
    snapshots = config.snapshots if trainer.args.zero_stage > 0 else None  # auto may have picked stage 0 (DDP)
    prepare_trainer(trainer, upload=config.checkpoint_upload, snapshot_every=snapshots)
    run_dir = Path(config.storage_path) / config.name
    if config.inject_failure_at_step:
        trainer.add_callback(InjectWorkerFailure(config.inject_failure_at_step, run_dir))
    if config.inject_corruption_at_step:
        trainer.add_callback(InjectCorruption(config.inject_corruption_at_step, run_dir))
    for callback in trainer_callbacks:
        trainer.add_callback(callback)
    # the plan's step time in one line now, the measured one in the summary's ([Note: the measured step])
    clock = PlannedStepTime(getattr(trainer, "memory_plan", None), how_to_plan=_how_to_plan(config, trainer.args))
    trainer.add_callback(clock)
    try:
        trainer.train(resume_from_checkpoint=resume_checkpoint())
        dist.barrier()  # ranks on one node share output_dir: none removes it while another works in it
    finally:
        shutil.rmtree(output_dir, ignore_errors=True)  # everything worth keeping was reported
    (report,) = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, ReportShardedCheckpoints)]
    return {
        "checkpoint_wait_s": report.checkpoint_wait_s,
        "checkpoints_reported": report.checkpoints_reported,
        "step_times_s": clock.step_times_s,
        "predicted_step_s": clock.predicted_s,
    }


def _how_to_plan(config: RayFinetuneConfig, args) -> str:
    """What the start's line says when no plan ran: the job's flag, and with a model folder the plan's command."""
    hint = "--zero-stage auto plans the job as it starts and predicts its step time here"
    if config.model_name_or_path is None:  # the built-in tiny GPT-2: no folder for the command to read
        return hint
    return (
        f"{hint}; or, beforehand: python -m hf_lowzero.plan --model {config.model_name_or_path} --world-size "
        f"{args.world_size} {plan_device_flags(args)} --seq-len {config.clm_arguments().block_size} "
        f"--per_device_train_batch_size {args.per_device_train_batch_size} "
        f"--gradient_accumulation_steps {args.gradient_accumulation_steps}"
    )
