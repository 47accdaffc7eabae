"""Ray Train launch for the causal-LM fine-tune: TorchTrainer, sharded-checkpoint reporting, restore.

Example::

    ray.init(address="local", num_cpus=3)
    result = run_finetune(RayFinetuneConfig(num_workers=2, zero_stage=2, max_steps=20, save_steps=5,
                                            storage_path="/tmp/ray_results"))
    print(result.metrics, result.checkpoint.path)

Elastic (``num_workers=(1, 4)``, or ``--num-workers 1-4``): Ray restarts the group at a new size
when capacity changes, and every attempt resumes the latest checkpoint, resharded (``elastic.py``).
Checkpoints are reported from every rank and uploaded in the background (``reporting.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray.train
import torch.distributed as dist
from ray.train import (
    CheckpointConfig,
    CheckpointConsistencyMode,
    FailureConfig,
    LoggingConfig,
    RunConfig,
    ScalingConfig,
)
from ray.train.torch import TorchTrainer
from transformers import TrainerCallback

from hf_lowzero.ray.attempts import record_attempt
from hf_lowzero.ray.console import ConsoleProgress, quiet_worker_console
from hf_lowzero.ray.elastic import RecordWorldSize, accumulation_for_global_batch, parse_num_workers, worker_range
from hf_lowzero.ray.reporting import UPLOAD_MODES, ReportShardedCheckpoints
from hf_lowzero.recipes.clm import ClmArguments, finetune_clm
from hf_lowzero.trainer.arguments import LowZeroTrainingArguments
from hf_lowzero.zero.config import check_stage

FAILURE_MARKER = ".hf_lowzero_failure_injected"

logger = logging.getLogger(__name__)


def _opt(default, help: str, **kwargs):
    return field(default=default, metadata={"help": help}, **kwargs)


@dataclass(kw_only=True)
class RayFinetuneConfig:
    """Everything the Ray job needs; ``ray_jobs/finetune.py`` turns each field into a flag."""

    num_workers: int | tuple[int, int] = _opt(
        2, "Ray workers, one process per rank (one GPU each with --use-gpu); MIN-MAX (e.g. 2-8) for elastic training"
    )
    resize_check_interval_s: float = _opt(
        60.0, "with MIN-MAX workers: seconds between checks whether the group can grow"
    )
    use_gpu: bool = _opt(False, "place one worker per GPU and use NCCL (gloo on CPU otherwise)")
    resources_per_worker: str | None = _opt(
        None,
        'Ray resources per worker as JSON, e.g. \'{"CPU": 8, "GPU": 1}\' (default: 1 GPU, or 1 CPU without --use-gpu)',
    )
    zero_stage: int = _opt(2, "0 = plain Trainer/DDP, 1 = shard optimizer states, 2 = also gradients")
    max_steps: int = _opt(40, "optimizer steps in total")
    save_steps: int = _opt(10, "checkpoint (and report to Ray) every N steps")
    checkpoint_upload: str = _opt("async", "async: upload checkpoints in the background; sync: training waits for it")
    learning_rate: float = _opt(3e-3, "peak learning rate")
    per_device_train_batch_size: int = _opt(4, "sequences per worker per micro-batch")
    gradient_accumulation_steps: int = _opt(1, "micro-batches per optimizer step")
    global_batch_size: int | None = _opt(
        None, "sequences per optimizer step on all workers: sets gradient_accumulation_steps per attempt to keep it"
    )
    bf16: bool = _opt(False, "bf16 params with fp32 master rows")
    offload_optimizer: bool = _opt(False, "fp32 master rows, optimizer state and gradient rows in host memory")
    zero_config: str | None = _opt(None, "other ZeroConfig fields as JSON")
    model_name_or_path: str | None = _opt(None, "local save_pretrained directory (default: a tiny GPT-2)")
    train_file: str | None = _opt(None, "plain-text corpus (default: the one shipped with hf_lowzero)")
    storage_path: str = field(
        default_factory=lambda: str(Path.home() / "ray_results"),
        metadata={"help": "where Ray keeps checkpoints: local, shared, or s3://... (default: ~/ray_results)"},
    )
    name: str = _opt("hf_lowzero_finetune", "run name; a rerun with the same name and storage resumes it")
    max_failures: int = _opt(3, "worker-group restarts before giving up")
    inject_failure_at_step: int | None = _opt(None, "kill one worker process once, at this step (demos, tests)")
    num_to_keep: int = _opt(2, "checkpoints Ray keeps")
    seed: int = _opt(0, "seed for model init and data order")

    def __post_init__(self) -> None:
        self.num_workers = parse_num_workers(self.num_workers)
        if self.resize_check_interval_s < 0:
            raise ValueError(f"resize_check_interval_s={self.resize_check_interval_s} is invalid; expected >= 0")
        self.resources_per_worker_dict()  # raises on bad JSON
        if self.checkpoint_upload not in UPLOAD_MODES:
            raise ValueError(
                f"checkpoint_upload={self.checkpoint_upload!r} is invalid; expected one of {sorted(UPLOAD_MODES)}"
            )
        if self.global_batch_size is not None:
            if self.gradient_accumulation_steps != 1:
                raise ValueError(
                    "global_batch_size and gradient_accumulation_steps both set; give one: global_batch_size "
                    "derives gradient_accumulation_steps for every worker count"
                )
            for world in worker_range(self.num_workers):
                self.gradient_accumulation_for(world)  # raises if the global batch does not divide
        check_stage(self.zero_stage, "zero_stage", allow_off=True)
        if self.max_steps < 1 or self.save_steps < 1:
            raise ValueError("max_steps and save_steps must be >= 1")
        if self.inject_failure_at_step is not None and not 0 < self.inject_failure_at_step <= self.max_steps:
            raise ValueError(f"inject_failure_at_step must be in [1, max_steps={self.max_steps}]")

    @property
    def max_workers(self) -> int:
        """The most workers the run may have (``num_workers``, or the MAX of MIN-MAX)."""
        return worker_range(self.num_workers)[-1]

    def gradient_accumulation_for(self, world_size: int) -> int:
        """Micro-batches per optimizer step at ``world_size`` (see [Note: global batch across resizes])."""
        if self.global_batch_size is None:
            return self.gradient_accumulation_steps
        return accumulation_for_global_batch(self.global_batch_size, self.per_device_train_batch_size, world_size)

    def resources_per_worker_dict(self) -> dict[str, float] | None:
        """``resources_per_worker`` parsed (None: Ray's default, 1 GPU or 1 CPU)."""
        if self.resources_per_worker is None:
            return None
        try:
            resources = json.loads(self.resources_per_worker)
        except json.JSONDecodeError:
            resources = None
        if not isinstance(resources, dict) or not all(
            isinstance(k, str) and isinstance(v, (int, float)) and v >= 0 for k, v in resources.items()
        ):
            raise ValueError(
                f"resources_per_worker={self.resources_per_worker!r} is invalid; expected a JSON object of "
                'resource names to non-negative amounts, e.g. \'{"CPU": 8, "GPU": 1}\''
            )
        return resources


def run_finetune(config: RayFinetuneConfig, **trainer_overrides) -> ray.train.Result:
    """Fit the fine-tune on the connected Ray cluster; returns Ray's ``Result`` (metrics, checkpoint)."""
    trainer = build_trainer(config, **trainer_overrides)
    return trainer.fit()


def build_trainer(
    config: RayFinetuneConfig,
    run_config: RunConfig | None = None,
    callbacks=None,
    trainer_callbacks: Sequence[TrainerCallback] = (),
) -> TorchTrainer:
    """The ``TorchTrainer`` for ``config``. The Tune sweep passes its Ray ``callbacks``;
    ``trainer_callbacks`` (pickled to every worker) join the Trainer's own, after the reporting one.

    Example::

        result = build_trainer(RayFinetuneConfig(num_workers=(1, 4)), trainer_callbacks=[MyCallback()]).fit()
    """
    run_config = run_config or RunConfig(
        name=config.name,
        storage_path=config.storage_path,
        failure_config=FailureConfig(max_failures=config.max_failures),
        checkpoint_config=CheckpointConfig(num_to_keep=config.num_to_keep),
        callbacks=callbacks,
        logging_config=LoggingConfig(log_level="WARNING"),  # [Note: console noise] in console.py
    )
    return TorchTrainer(
        train_loop_per_worker=functools.partial(train_loop_per_worker, trainer_callbacks=tuple(trainer_callbacks)),
        train_loop_config=dataclasses.asdict(config),
        scaling_config=ScalingConfig(
            num_workers=config.num_workers,
            use_gpu=config.use_gpu,
            resources_per_worker=config.resources_per_worker_dict(),
            elastic_resize_monitor_interval_s=config.resize_check_interval_s,
        ),
        run_config=run_config,
    )


def train_loop_per_worker(
    config_dict: dict[str, Any], trainer_callbacks: Sequence[TrainerCallback] = ()
) -> dict[str, float]:
    """Runs on every Ray worker (process group already initialized by Ray Train), once per attempt.
    Returns the seconds training waited on checkpoint reports and their count (rank 0's become
    ``Result.return_value``)."""
    config = RayFinetuneConfig(**config_dict)
    model_args, args = worker_arguments(config, _shared_local_dir(config.name), dist.get_world_size())
    output_dir = args.output_dir
    quiet_worker_console()
    attempt = record_attempt(config.storage_path, config.name, dist.get_world_size()) if dist.get_rank() == 0 else None
    report = ReportShardedCheckpoints(config.checkpoint_upload)
    callbacks = [report, RecordWorldSize()]
    if config.inject_failure_at_step:
        callbacks.append(InjectWorkerFailure(config.inject_failure_at_step, Path(config.storage_path) / config.name))
    callbacks.extend(trainer_callbacks)

    checkpoint = ray.train.get_checkpoint()
    try:
        if checkpoint is None:
            finetune_clm(model_args, args, callbacks=callbacks, printer=ConsoleProgress(attempt))
        else:
            with checkpoint.as_directory() as restored:
                resume = _trainer_checkpoint_in(restored)
                finetune_clm(model_args, args, callbacks=callbacks, resume=resume, printer=ConsoleProgress(attempt))
        dist.barrier()  # ranks on one node share output_dir: none removes it while rank 0 still saves there
    finally:
        shutil.rmtree(output_dir, ignore_errors=True)  # everything worth keeping was reported
    return {"checkpoint_wait_s": report.checkpoint_wait_s, "checkpoints_reported": report.checkpoints_reported}


def worker_arguments(
    config: RayFinetuneConfig, output_dir: str, world_size: int
) -> tuple[ClmArguments, LowZeroTrainingArguments]:
    """The model and Trainer arguments every worker of ``config`` trains with at ``world_size``.

    Example (the same training without Ray, e.g. as a reference; in every rank of a process group)::

        model_args, args = worker_arguments(RayFinetuneConfig(max_steps=3), "out", world_size=2)
        trainer, metrics = finetune_clm(model_args, args)
    """
    args = LowZeroTrainingArguments(
        output_dir=output_dir,
        zero_stage=config.zero_stage,
        zero_config=config.zero_config,
        zero_offload_optimizer=config.offload_optimizer,
        max_steps=config.max_steps,
        save_strategy="steps",
        save_steps=config.save_steps,
        save_total_limit=config.num_to_keep,
        learning_rate=config.learning_rate,
        per_device_train_batch_size=config.per_device_train_batch_size,
        gradient_accumulation_steps=config.gradient_accumulation_for(world_size),
        bf16=config.bf16,
        use_cpu=not config.use_gpu,
        logging_steps=1,
        report_to=[],
        disable_tqdm=True,
        seed=config.seed,
    )
    model_args = ClmArguments(model_name_or_path=config.model_name_or_path)
    if config.train_file:
        model_args.train_file = config.train_file
    return model_args, args


def _trainer_checkpoint_in(restored: str) -> str:
    found = sorted(Path(restored).glob("checkpoint-*"))
    if len(found) != 1:
        raise RuntimeError(f"expected one Trainer checkpoint-N folder in the Ray checkpoint {restored}, found {found}")
    return str(found[0])


def _shared_local_dir(name: str) -> str:
    """A fresh Trainer output directory for this attempt: the same path on every rank (rank 0
    picks it), created on every node (nodes may not share a filesystem)."""
    path = [tempfile.mkdtemp(prefix=f"hf_lowzero_{name}_")] if dist.get_rank() == 0 else [None]
    dist.broadcast_object_list(path, src=0)
    os.makedirs(path[0], exist_ok=True)
    return path[0]


class InjectWorkerFailure(TrainerCallback):
    """Kills the last rank's process once, at ``step``, on the first attempt only (a marker file in
    the run's storage folder remembers that it happened), after Ray registered every earlier
    checkpoint, so the restart resumes the last one before ``step``. At a checkpoint step it dies
    right after ``ray.train.report`` returned, with its upload still in flight ([Note: asynchronous
    upload]); at any other step, at the end of the step. For demos and fault-tolerance tests."""

    def __init__(self, step: int, run_dir: Path) -> None:
        self.step = step
        self.marker = run_dir / FAILURE_MARKER
        self._kill_after_report = False

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step != self.step or self.marker.exists():
            return
        dist.barrier()  # every rank checked the marker before it appears
        if dist.get_rank() == dist.get_world_size() - 1:
            # Reports reach the controller when it polls; one queued on a dead worker is lost.
            ray.train.get_all_reported_checkpoints(consistency_mode=CheckpointConsistencyMode.COMMITTED)
            self.marker.parent.mkdir(parents=True, exist_ok=True)
            self.marker.write_text(f"worker of rank {dist.get_rank()} killed at step {state.global_step}\n")
            logger.warning("[hf_lowzero] injecting a failure: killing rank %d at step %d", dist.get_rank(), self.step)
            if not control.should_save:  # set by DefaultFlowCallback, which runs first
                os._exit(1)
            self._kill_after_report = True

    def on_save(self, args, state, control, **kwargs):
        # Runs right after ReportShardedCheckpoints.on_save and nothing in between blocks, so the
        # upload that report() started in the background is still in flight: its report never arrives.
        if self._kill_after_report:
            os._exit(1)
